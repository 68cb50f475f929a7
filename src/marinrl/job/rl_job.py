"""RLJob: one config → a TrainWorker, N RolloutWorkers and the curriculum actor, on Ray.

With no cluster address the job starts a local Ray sized for this machine (the default); with an
address it joins that cluster and places the trainer and the rollout workers by resources. A rollout
worker that dies is restarted; a trainer that dies ends the job with its error and the checkpoint to
resume from; normal completion and Ctrl-C leave no actor behind, nor does the driver's death on a local Ray
(`kill -9` included: marinrl/job/reaper.py). A trainer that spans several hosts
(`ray.trainer.num_hosts`, or a multi-host `ray.trainer.tpu` slice) is a `TrainerGroup`: one actor per
host in one placement group, one JAX process group (marinrl/job/trainer_group.py, docs/multihost.md).
This module is the job's lifecycle; what each role is built with is job/plan.py's, what the terminal shows
job/terminal.py's, and what a user is told when a trainer dies or stops job/outcomes.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys
import time
from typing import Any, Optional

import ray

from marinrl.config.errors import ConfigError  # noqa: F401  (raised by RLJob(config))
from marinrl.config.job import RayJobConfig, RLJobConfig  # noqa: F401  (RayJobConfig: part of this module's API)
from marinrl.config.policies import resolve_policies, trainers
from marinrl.curriculum.actor import CurriculumClient, curriculum_actor
from marinrl.job.actors import RolloutActor, TrainerActor, actor_env, compilation_cache_dir
from marinrl.job.outcomes import (
    first_line,
    killed_for_memory,
    memory_advice,
    memory_kill_line,
    stopped_line,
    trainer_death_message,
)
from marinrl.job.placement import AutoscalerRequest, actor_options, check_cluster, cpus
from marinrl.job.plan import train_worker_config
from marinrl.job.preflight import check_job
from marinrl.job.reaper import Reaper
from marinrl.job.run_lock import RunLock, RunLockHeld, RunLockLost  # noqa: F401  (RunLockHeld: raised by run())
from marinrl.job.terminal import ProgressBar, StallNotices
from marinrl.job.trainer_group import TrainerGroup, TrainerGroupDied
from marinrl.logs import local_log_dir, log_actor_to_file
from marinrl.rollout.errors import EnvironmentFailedError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class JobResult:
    train: dict
    rollouts: list[dict]
    rollout_restarts: int
    seconds: float
    curriculum_step: int
    """The curriculum's clock at the end: one iteration per trainer step."""
    policies: dict = dataclasses.field(default_factory=dict)
    """Policy model name -> its trainer's result, for a job of several policy models (`train` is the
    first one's, whose trainer keeps the curriculum's clock); empty for one."""


LOCAL_RAY_STARTS = 3
"""Tries at starting the job's local Ray when Ray's own start times out (`RLJob._start_local_ray`)."""

LOCAL_RAY_BACKOFF_S = 5.0
"""The wait before the second try at starting the local Ray; doubled before each later one."""


def _ray_start_timed_out(error: BaseException) -> bool:
    """Ray's local start failed because its raylet did not register with the GCS within Ray's fixed 30 s."""
    return type(error) is Exception and "timed out during startup" in str(error)


class RLJob:
    """Runs one RLJobConfig on Ray. `run()` blocks until the trainer finishes."""

    def __init__(self, config: RLJobConfig):
        check_job(config)  # ranges, environments, model config, tokenizer, run_root: before Ray starts
        self.config = resolve_policies(config)  # a single policy's model, optimizer, loss, adapters: the job's
        self._started_ray = False
        self._actors: list[Any] = []
        self._group: Optional[TrainerGroup] = None
        self._lock: Optional[RunLock] = None
        self._autoscaler = AutoscalerRequest()  # cleared when the job ends: see shutdown()
        self._n_trainers = 1
        self._reaper: Optional[Reaper] = None

    def _init_ray(self) -> Optional[str]:
        cfg = self.config.ray
        if ray.is_initialized():
            return ray.get_runtime_context().namespace
        if cfg.address is None:
            trainer_cpus = sum(cpus(m.placement) for m in trainers(self.config))
            asked = trainer_cpus + self.config.n_rollout_workers * cpus(cfg.rollout)
            num_cpus = cfg.num_cpus or (math.ceil(asked) + 1)
            self._start_local_ray(num_cpus)
        else:
            try:
                ray.init(address=cfg.address, namespace=f"marinrl-{self.config.run_id}",
                         runtime_env={"env_vars": actor_env(compilation_cache_dir(self.config))},
                         logging_level=logging.ERROR)
            except (ConnectionError, TimeoutError, RuntimeError) as e:  # Ray's client: 40 lines of traceback
                text = " ".join(str(e).split())
                raise ConfigError("ray.address", f"cannot connect to the Ray cluster at {cfg.address!r} "
                                                 f"({type(e).__name__}: {text[:200]}): start the cluster (`ray start "
                                                 "--head`), fix the address, or remove ray.address to run on this "
                                                 "machine") from None
        self._started_ray = True
        return ray.get_runtime_context().namespace

    def _start_local_ray(self, num_cpus: int) -> None:
        """A local Ray of the job's own, its processes marked for the watchdog. Ray gives its raylet a fixed 30 s
        to register with the GCS and then fails the start; a machine busy enough for that gets
        `LOCAL_RAY_STARTS` tries, `LOCAL_RAY_BACKOFF_S` apart (doubling), each after sweeping what the failed one
        left, then one clear error."""
        for attempt in range(1, LOCAL_RAY_STARTS + 1):
            self._reaper = Reaper()  # the driver's death (kill -9 included) takes this Ray with it at once
            self._reaper.start()
            try:
                with self._reaper.marked():
                    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,  # never join a stranger's
                             namespace=f"marinrl-{self.config.run_id}",
                             object_store_memory=512 * 1024 * 1024,
                             runtime_env={"env_vars": actor_env(compilation_cache_dir(self.config))},
                             log_to_driver=False,  # actors log to <run_dir>/logs; errors still reach ray.get
                             logging_level=logging.ERROR,  # Ray's own startup lines would bury a one-line error
                             # Ray starts workers at nice 15: on a shared machine the job's own actors then lose
                             # the CPU to anything at 0 (SmolLM2's steps took 2-3x as long; docs/real_model.md)
                             _system_config={"worker_niceness": 0})
                return
            except BaseException as e:
                with contextlib.suppress(Exception):
                    ray.shutdown()
                self._reaper.stop()  # what Ray started before it failed
                self._reaper = None
                if not _ray_start_timed_out(e):
                    raise
                if attempt == LOCAL_RAY_STARTS:
                    raise RuntimeError(f"the job's local Ray did not start: {LOCAL_RAY_STARTS} tries, each ended by "
                                       "Ray's 30 s wait for its raylet to register with the GCS (a machine too busy "
                                       "to start Ray's processes?): run the job again when the machine is "
                                       "quieter, or start Ray yourself and set ray.address") from e
                wait = LOCAL_RAY_BACKOFF_S * 2 ** (attempt - 1)
                print(f"[marinrl] the job's local Ray did not start within Ray's 30 s (a busy machine?): starting "
                      f"it again in {wait:g} s (try {attempt + 1} of {LOCAL_RAY_STARTS})", flush=True)
                time.sleep(wait)

    def run(self) -> JobResult:
        """Holds the run's lease (marinrl/job/run_lock.py) from before Ray starts until the job ends."""
        self._lock = RunLock(self.config.run_dir, self.config.run_id)
        self._lock.acquire()  # RunLockHeld (one line naming the holder) if another live job has this run
        try:
            return self._run()
        finally:
            self._lock.release()

    def _run(self) -> JobResult:
        cfg = self.config
        started = self._started = time.time()  # the origin of the actors' `startup:` log lines
        self._log_dir = str(local_log_dir(cfg.run_dir, cfg.run_id))
        namespace = self._init_ray()
        try:  # before any actor: a request no node can hold would leave its actor pending forever
            on_cluster = cfg.ray.address is not None
            group = None
            if cfg.ray.trainer.hosts() > 1:
                group = TrainerGroup(cfg.ray.trainer, cfg.trainer_group, on_cluster=on_cluster, log_dir=self._log_dir)
            models = trainers(cfg)  # what each trainer trains: a model, or several adapters on one base
            placements = [m.placement for m in models]
            for placement in [p for i, p in enumerate(placements) if p not in placements[:i]]:  # each model's trainer
                check_cluster(placement, cfg.ray.rollout, cfg.n_rollout_workers,
                              wait_s=cfg.ray.placement_timeout_s if on_cluster else 0.0,
                              spread=group is not None and group.strategy == "STRICT_SPREAD",
                              autoscaler=self._autoscaler)
            curriculum_name = self._start_curriculum(namespace)
            curriculum_log = ray.get_actor(curriculum_name, namespace=namespace).__ray_call__.remote(
                log_actor_to_file, self._log_dir, "curriculum")  # awaited once the other actors are started
            actors, train_refs = self._start_trainers(group, models, curriculum_name, namespace)
            self._n_trainers = len(actors)  # the rollout workers' slots follow the trainers'
            trainer = actors[0]
            waited = dict(zip(train_refs, range(len(actors))))  # a trainer's result ref -> its index
            results: dict[int, dict] = {}
            rollouts, refs = [], []
            for i in range(cfg.n_rollout_workers):
                actor = self._rollout_actor(i, curriculum_name, namespace)
                rollouts.append(actor)
                refs.append(actor.run.remote())
            ray.get(curriculum_log)
            restarts = 0
            summaries: list[dict] = [{} for _ in rollouts]
            pending = {ref: i for i, ref in enumerate(refs)}
            bar = ProgressBar(cfg.num_train_steps)
            stalls = StallNotices()
            try:
                while True:
                    live = [r for r in train_refs if waited.get(r) not in results]
                    ready, _ = ray.wait([*live, *pending], num_returns=1, timeout=1.0)
                    bar.update(trainer)
                    stalls.poll(rollouts)
                    if self._lock.lost:  # another job took this run over (this one looked dead): it owns it now
                        raise RunLockLost(f"{self._lock.lost}; this job stopped: do not run it again while that "
                                          "one runs")
                    if self._group is not None:
                        if any(ref in ready for ref in train_refs):
                            results[0] = self._train_result(train_refs[0])
                    else:
                        for ref in ready:
                            if ref in waited:
                                results[waited[ref]] = self._train_result(ref, models[waited[ref]].run_dir)
                    if len(results) == len(actors):
                        break
                    for ref in (r for r in ready if r in pending):
                        i = pending.pop(ref)
                        try:
                            summaries[i] = ray.get(ref)
                        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError,
                                ray.exceptions.OutOfMemoryError) as e:
                            if isinstance(getattr(e, "cause", None), EnvironmentFailedError):
                                bar.close()  # restarting would repeat the failure: stop the job with it
                                raise EnvironmentFailedError(
                                    f"{e.cause}\nthe job stopped (rollout worker {i}; its log: {self._log_dir}/"
                                    f"rollout-{i}.log). Fix the environment or its args, then run the same config "
                                    "again: it resumes from the last checkpoint") from None
                            if restarts >= cfg.ray.max_rollout_restarts * cfg.n_rollout_workers:
                                raise RuntimeError(
                                    f"rollout worker {i} keeps dying: "
                                    + (f"{memory_kill_line(e)}\n{memory_advice(e)}" if killed_for_memory(e) else
                                       f"{first_line(e)}\nits log: {self._log_dir}/rollout-{i}.log")) from e
                            restarts += 1
                            logger.warning("rollout worker %d died (%s); restarting it", i, type(e).__name__)
                            rollouts[i] = self._rollout_actor(i, curriculum_name, namespace, restart=True)
                            pending[rollouts[i].run.remote()] = i
            except KeyboardInterrupt:
                bar.close()
                stop_trainers([(actors[k], ref, k == 0 and bar.answered) for ref, k in waited.items()
                               if k not in results], cfg.ray.stop_timeout_s)
                raise
            for ref, i in list(pending.items()):  # workers stop on their own once the final weights arrive
                try:
                    summaries[i] = ray.get(ref, timeout=120)
                except Exception as e:  # a worker that cannot finish is stopped below
                    logger.warning("rollout worker %d did not finish cleanly: %s", i, e)
            bar.close()
            curriculum_step = CurriculumClient(ray.get_actor(curriculum_name, namespace=namespace)).step()
            # each policy model's trainer result (the adapters of one base: their one trainer's)
            per_model = ({p.name: results[k] for k, m in enumerate(models) for p in m.models}
                         if len(models) > 1 or models[0].adapters else {})
            return JobResult(results[0], summaries, restarts, time.time() - started, curriculum_step, per_model)
        finally:
            self.shutdown()

    def _start_trainers(self, group: Optional[TrainerGroup], models, curriculum_name: str,
                        namespace: Optional[str]) -> tuple[list, list]:
        """(trainer actors, their `run` refs): one per entry of `policies.trainers` (a policy model, or the
        adapters of one base), the first keeping the curriculum's clock; or a multi-host trainer's group (its
        leader, each process's ref). Each derives its config and builds its parts in its own process (job/plan.py)."""
        cfg = self.config
        if group is not None:
            self._group = group
            group.start(functools.partial(train_worker_config, cfg), curriculum_name, namespace,
                        placement_timeout_s=cfg.ray.placement_timeout_s)
            return [group.leader], group.refs
        started = []
        for k, m in enumerate(models):
            started.append(TrainerActor.options(**actor_options(m.placement, k)).remote(
                functools.partial(train_worker_config, cfg, m),
                curriculum_name if k == 0 else None, namespace, self._log_dir,
                self._started, "trainer" if len(models) == 1 else f"trainer-{m.name}", m.placement))
        self._actors.extend(started)
        return started, [t.run.remote() for t in started]

    def _start_curriculum(self, namespace: Optional[str]) -> str:
        """The curriculum actor, saving its state at every trainer step: one that dies (Ray restarts
        it) resumes from its last step, not from fresh statistics and statuses (docs/curriculum.md)."""
        name = "curriculum"
        handle = curriculum_actor(self.config.curriculum, name=name, namespace=namespace,
                                  state_path=f"{self.config.run_dir}/curriculum/latest.json", save_every=1)
        self._actors.append(handle)
        return name

    def _rollout_actor(self, i: int, curriculum_name, namespace, restart: bool = False):
        cfg = self.config
        options = actor_options(cfg.ray.rollout, self._n_trainers + i)  # a restart takes its worker's slot
        actor = RolloutActor.options(**options).remote(  # a restart's clock starts at its own start
            cfg, i, curriculum_name, namespace, self._log_dir, None if restart else self._started)
        self._actors.append(actor)
        return actor

    def _train_result(self, ref, run_dir: Optional[str] = None) -> dict:
        """The trainer's result (process 0's for a group, once every process returned), or the error
        saying what died and which checkpoint the same config resumes from (`run_dir`: the policy
        model's, for a job of several)."""
        try:
            return self._group.result() if self._group is not None else ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.OutOfMemoryError,
                TrainerGroupDied) as e:
            if self._lock.lost:  # superseded: the other job's trainer publishes now
                raise RunLockLost(f"{self._lock.lost}; this job stopped: do not run it again while that "
                                  "one runs") from e
            checkpoints = f"{run_dir or self.config.run_dir}/checkpoints"
            raise RuntimeError(trainer_death_message(e, checkpoints)) from e

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.shutdown()
            self._group = None
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self._actors.clear()
        try:  # before disconnecting: the request lives in the cluster, not in this process
            self._autoscaler.clear()
        except Exception as e:  # the cluster is gone: so is its request
            logger.warning("could not withdraw the job's autoscaler request: %s", e)
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self._reaper is not None:  # sweeps what ray.shutdown left (nothing, normally) and exits
            self._reaper.stop()
            self._reaper = None


def stop_trainers(stopping: list[tuple[Any, Any, bool]], timeout: float) -> None:
    """Ctrl-C: each trainer (actor, its `run` ref, whether it has answered a call: its actor is built)
    that is training finishes its step and saves a checkpoint (the job resumes from it), for at most
    `timeout` s (`ray.stop_timeout_s`); a second Ctrl-C gives up waiting. One still starting (its actor being built:
    no answer to `stop` within STOP_ANSWER_S; or loading, compiling, publishing its first weights: False)
    has nothing new to save and is not waited for. A trainer waiting for rollouts stops at once (the
    replay's wait ends on the stop event). `run`'s cleanup follows."""
    print(f"\n[marinrl] interrupted: the trainer checkpoints and stops (up to {timeout:.0f} s; Ctrl-C again "
          "to quit now)", file=sys.stderr, flush=True)
    try:
        answers = [trainer.stop.remote() for trainer, _, _ in stopping]
        answered, _ = ray.wait(answers, num_returns=len(answers), timeout=STOP_ANSWER_S)
        built = [a for a, (_, _, known) in zip(answers, stopping) if known and a not in answered]
        if built:  # an actor that answered before answers this too: a loaded machine is slow, not silent
            answered += ray.wait(built, num_returns=len(built), timeout=timeout)[0]
        training = []
        for answer, (_, ref, _) in zip(answers, stopping):
            try:
                if answer in answered and ray.get(answer):
                    training.append(ref)
                    continue
                print("[marinrl] stopped while the trainer was starting (no step trained: nothing new to "
                      "checkpoint); run the same config again to resume", file=sys.stderr, flush=True)
            except Exception as e:  # the trainer is gone already: nothing more to save
                print(f"[marinrl] the trainer could not checkpoint: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)
        ready, _ = ray.wait(training, num_returns=len(training), timeout=timeout) if training else ([], [])
        for ref in training:
            if ref not in ready:
                print("[marinrl] the trainer did not stop in time; resume starts from its last checkpoint",
                      file=sys.stderr, flush=True)
                continue
            try:
                print(f"[marinrl] {stopped_line(ray.get(ref))}", file=sys.stderr, flush=True)
            except Exception as e:  # it died while stopping
                print(f"[marinrl] the trainer could not checkpoint: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)
    except KeyboardInterrupt:
        print("[marinrl] quitting without a final checkpoint", file=sys.stderr, flush=True)


STOP_ANSWER_S = 2.0
"""Ctrl-C: how long a trainer that has not answered a call yet has to answer its stop (a flag set on an idle
thread of its actor); one that has not is still being built, has trained nothing and is not waited for."""


def main(config: RLJobConfig) -> JobResult:
    return RLJob(config).run()
