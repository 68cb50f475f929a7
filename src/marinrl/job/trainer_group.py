"""TrainerGroup: a trainer that spans several hosts, as Ray actors — one per host, reserved together in
one placement group, joined into one JAX process group, each running the same `TrainWorker`
(marinrl/multihost.py, docs/multihost.md).

- **Placement.** One bundle per host (`job/placement.bundles`: the per-host request; a TPU slice's
  head resource on the first), STRICT_SPREAD on a cluster so each process has a host to itself; PACK on
  the job's own local Ray, which is one machine (tests). On a TPU slice every bundle is also pinned by
  Ray's node labels to one slice (the one whose head resource a probe took) and to its TPU worker id, so
  process i runs on TPU worker i, as JAX's own detection would number them.
- **Joining.** The first actor names the coordinator (its node's IP and a free port); every actor calls
  `multihost.initialize` before its JAX touches a device, then builds the TrainWorker. Only process 0
  gets the curriculum (its clock advances once per optimizer step) and its result is the job's.
- **Dying.** A killed process ends the others through multihost's peer watch (exit 75, a message naming
  the checkpoint). `result()` waits `death_grace_s` for that, kills what is left, and raises one
  `TrainerGroupDied` saying which process died and what the survivors said.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import Any, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from marinrl import multihost
from marinrl.config.placement import PlacementConfig
from marinrl.config.trainer_group import TrainerGroupConfig
from marinrl.curriculum.actor import CurriculumClient
from marinrl.job.placement import bundles, ray_options, slice_selectors
from marinrl.job.plan import build_trainer
from marinrl.logs import log_to_file

logger = logging.getLogger(__name__)

_PEER_LOST_MARK = "[marinrl] trainer process "
"""How multihost's peer watch starts its message; the group quotes those lines from the survivors' logs."""


class TrainerGroupDied(RuntimeError):
    """A process of the group died; `cause` is the first one's own exception when it raised one."""

    def __init__(self, message: str, cause: Optional[BaseException]):
        super().__init__(message)
        self.cause = cause


@ray.remote(max_concurrency=2)
class TrainerHostActor:
    """One host's trainer process. Nothing here touches JAX until `run` has joined the group."""

    def __init__(self, process_id: int, log_dir: Optional[str] = None):
        self.process_id = process_id
        self.worker = None
        if log_dir:  # named loggers: Levanter's initialize() replaces the root logger's handlers
            log_to_file(log_dir, f"trainer-{process_id}", loggers=("marinrl", "levanter"))

    def coordinator_address(self) -> str:
        """This node's IP and a port free on it now, for process 0's coordination service."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def run(self, plan, group: multihost.ProcessGroupConfig, curriculum_name: Optional[str],
            namespace: Optional[str]) -> dict:
        """`plan()` is the trainer's `TrainWorkerConfig`, derived here (job/plan.py: the driver never imports
        Levanter); its parts are built once this process joined the group (`plan.build_trainer`)."""
        multihost.initialize(group)
        from levanter.tracker import NoopConfig

        from marinrl.train.worker import TrainWorker

        config = plan()
        curriculum = None
        if group.process_id == 0 and curriculum_name is not None:  # one clock: process 0's optimizer steps
            curriculum = CurriculumClient(ray.get_actor(curriculum_name, namespace=namespace))
        if group.process_id != 0:  # one writer per run: process 0 logs for the group (Levanter's trackers
            # would otherwise race to create the same TensorBoard folder and duplicate every line)
            config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, tracker=NoopConfig()))
        self.worker = TrainWorker(config, build_trainer(config), curriculum=curriculum)
        result = self.worker.run()
        import jax

        mesh = {"processes": jax.process_count(), "global_devices": jax.device_count(),
                "local_devices": jax.local_device_count()}
        multihost.finish()
        return {**dataclasses.asdict(result), "node_id": ray.get_runtime_context().get_node_id(),
                "process_id": group.process_id, **mesh}

    def progress(self) -> dict:
        if self.worker is None:
            raise RuntimeError(f"trainer process {self.process_id} is still joining its group")
        return {"step": self.worker.step, **(self.worker.history[-1] if self.worker.history else {})}

    def trained_groups(self) -> list[tuple[int, list[str]]]:
        if self.worker is None:
            return []
        return [(h["step"], list(g)) for h, g in zip(list(self.worker.history), list(self.worker.trained_groups))]

    def stop(self) -> bool:
        """Process 0 tells the others at the next batch (its stop flag travels with it). Returns whether
        it is training (`TrainWorker.stop`); False while it is still joining its group or starting."""
        return self.worker.stop() if self.worker is not None else False


class TrainerGroup:
    """The trainer's processes on Ray: `start`, then `leader` (process 0: progress, stop) and `refs`
    (every process's `run`), `result()`, `shutdown()`."""

    def __init__(self, placement: PlacementConfig, config: TrainerGroupConfig, *, on_cluster: bool,
                 log_dir: Optional[str] = None):
        self.placement = placement
        self.config = config
        self.strategy = config.resolved_strategy(on_cluster)
        self.log_dir = log_dir
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self._pg = None

    @property
    def num_processes(self) -> int:
        return self.placement.hosts()

    @property
    def leader(self):
        return self.actors[0]

    def start(self, plan, curriculum_name: Optional[str], namespace: Optional[str], *,
              placement_timeout_s: float) -> None:
        """Reserves every host at once, starts one actor on each, and has them join and run."""
        n = self.num_processes
        options: dict[str, Any] = {}
        selectors = slice_selectors(self.placement, n, placement_timeout_s)
        if selectors is not None:
            options["bundle_label_selector"] = selectors
        self._pg = placement_group(bundles(self.placement), strategy=self.strategy, **options)
        ready, _ = ray.wait([self._pg.ready()], timeout=placement_timeout_s)
        if not ready:
            raise RuntimeError(f"the trainer's {n} hosts of {bundles(self.placement)[-1]} each ({self.strategy}) "
                               f"were not free within ray.placement_timeout_s={placement_timeout_s:g} s: another "
                               "job holds them, or the cluster lost a node since the placement check")
        self.actors = [
            TrainerHostActor.options(
                **ray_options(self.placement, head=i == 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            ).remote(i, self.log_dir)
            for i in range(n)]
        address = ray.get(self.leader.coordinator_address.remote())
        logger.info("trainer group: %d processes (%s), coordinator %s", n, self.strategy, address)
        c = self.config
        self.refs = [
            actor.run.remote(plan, multihost.ProcessGroupConfig(
                num_processes=n, process_id=i, coordinator_address=address, cpu_devices=c.cpu_devices,
                heartbeat_timeout_s=c.heartbeat_timeout_s, initialization_timeout_s=c.initialization_timeout_s),
                curriculum_name if i == 0 else None, namespace)
            for i, actor in enumerate(self.actors)]

    def result(self) -> dict:
        """Process 0's result once every process has returned. When one dies, the others get
        `death_grace_s` to end with their own message; raises TrainerGroupDied."""
        pending = list(self.refs)
        failures: list[tuple[int, BaseException]] = []
        results: dict[int, dict] = {}
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                break  # the grace is over: the stragglers are killed by shutdown()
            ref = ready[0]
            i = self.refs.index(ref)
            try:
                results[i] = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                failures.append((i, e))
                if deadline is None:
                    deadline = time.monotonic() + self.config.death_grace_s
        if not failures:
            return results[0]
        raise self._died(failures, [self.refs.index(r) for r in pending])

    def _died(self, failures: list[tuple[int, BaseException]], stuck: list[int]) -> TrainerGroupDied:
        n = self.num_processes
        first, error = failures[0]
        if len(failures) > 1:  # a survivor's task can end (a barrier broken) just before its peer watch logs why
            waited = time.monotonic() + min(5.0, self.config.death_grace_s)
            while not self._peer_lost_lines() and time.monotonic() < waited:
                time.sleep(0.1)
        cause = getattr(error, "cause", None)
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else \
            f"{type(error).__name__}: {error}"
        lines = [f"trainer process {first} of {n} died: {what.strip().splitlines()[0] if what.strip() else what}"]
        survivors = self._peer_lost_lines()
        lines += survivors
        ended = [i for i, _ in failures[1:]]
        if ended and not survivors:
            lines.append(f"processes {ended} ended after it")
        if stuck:
            lines.append(f"processes {stuck} did not end within trainer_group.death_grace_s="
                         f"{self.config.death_grace_s:g} s: killed")
        return TrainerGroupDied("\n".join(lines), cause if isinstance(cause, BaseException) else None)

    def _peer_lost_lines(self) -> list[str]:
        """What multihost's peer watch printed in each survivor's log (`trainer-<i>.log`)."""
        if not self.log_dir:
            return []
        out = []
        for i in range(self.num_processes):
            path = os.path.join(self.log_dir, f"trainer-{i}.log")
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                continue
            out += [line[line.index(_PEER_LOST_MARK):] for line in text.splitlines()
                    if _PEER_LOST_MARK in line and " is gone (" in line]
        return out

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # Ray is shutting down
                pass
            self._pg = None
