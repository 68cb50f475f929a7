"""RLJob: one config → a TrainWorker, N RolloutWorkers and the curriculum actor, on Ray.

With no cluster address the job starts a local Ray sized for this machine (the default); with an
address it joins that cluster and places the trainer and the rollout workers by resources. A rollout
worker that dies is restarted; a trainer that dies ends the job with its error and the checkpoint to
resume from; normal completion and Ctrl-C leave no actor behind, nor does the driver's death on a local Ray
(`kill -9` included: marinrl/job/reaper.py). A trainer that spans several hosts
(`ray.trainer.num_hosts`, or a multi-host `ray.trainer.tpu` slice) is a `TrainerGroup`: one actor per
host in one placement group, one JAX process group (marinrl/job/trainer_group.py, docs/multihost.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import sys
import time
from typing import Any, Optional

import ray

from marinrl.config.errors import ConfigError  # noqa: F401  (raised by RLJob(config))
from marinrl.config.job import RayJobConfig, RLJobConfig  # noqa: F401  (RayJobConfig: part of this module's API)
from marinrl.config.policies import policy_models, resolve_policies
from marinrl.curriculum.actor import CurriculumClient, curriculum_actor
from marinrl.job.actors import RolloutActor, TrainerActor, actor_env, compilation_cache_dir
from marinrl.job.placement import AutoscalerRequest, actor_options, check_cluster, cpus
from marinrl.job.plan import train_worker_config
from marinrl.job.preflight import check_job
from marinrl.job.reaper import Reaper
from marinrl.job.run_lock import RunLock, RunLockHeld, RunLockLost  # noqa: F401  (RunLockHeld: raised by run())
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
            trainers = sum(cpus(m.job.ray.trainer) for m in policy_models(self.config))
            asked = trainers + self.config.n_rollout_workers * cpus(cfg.rollout)
            num_cpus = cfg.num_cpus or (math.ceil(asked) + 1)
            self._reaper = Reaper()  # the driver's death (kill -9 included) takes this Ray with it at once
            self._reaper.start()
            try:
                with self._reaper.marked():
                    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,  # never join a stranger's
                             namespace=f"marinrl-{self.config.run_id}",
                             object_store_memory=512 * 1024 * 1024,
                             runtime_env={"env_vars": actor_env(compilation_cache_dir(self.config))},
                             log_to_driver=False,  # actors log to <run_dir>/logs; errors still reach ray.get
                             logging_level=logging.ERROR)  # Ray's own startup lines would bury a one-line error
            except BaseException:
                self._reaper.stop()  # what Ray started before it failed
                self._reaper = None
                raise
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
            models = policy_models(cfg)
            placements = [m.job.ray.trainer for m in models]
            for placement in [p for i, p in enumerate(placements) if p not in placements[:i]]:  # each model's trainer
                check_cluster(placement, cfg.ray.rollout, cfg.n_rollout_workers,
                              wait_s=cfg.ray.placement_timeout_s if on_cluster else 0.0,
                              spread=group is not None and group.strategy == "STRICT_SPREAD",
                              autoscaler=self._autoscaler)
            curriculum_name = self._start_curriculum(namespace)
            curriculum_log = ray.get_actor(curriculum_name, namespace=namespace).__ray_call__.remote(
                log_actor_to_file, self._log_dir, "curriculum")  # awaited once the other actors are started
            if group is None:  # one trainer per policy model; the first keeps the curriculum's clock
                trainers = []
                for k, m in enumerate(models):
                    trainers.append(TrainerActor.options(**actor_options(m.job.ray.trainer, k)).remote(
                        functools.partial(train_worker_config, m.job, m.policies),
                        curriculum_name if k == 0 else None, namespace, self._log_dir,
                        started, "trainer" if len(models) == 1 else f"trainer-{m.name}", m.job.ray.trainer))
                self._actors.extend(trainers)
                train_refs = [t.run.remote() for t in trainers]
            else:
                self._group = group
                group.start(functools.partial(train_worker_config, cfg), curriculum_name, namespace,
                            placement_timeout_s=cfg.ray.placement_timeout_s)
                trainers, train_refs = [group.leader], group.refs
            self._n_trainers = len(trainers)  # the rollout workers' slots follow the trainers'
            trainer = trainers[0]
            waited = dict(zip(train_refs, range(len(trainers))))  # a trainer's result ref -> its index
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
            bar = _ProgressBar(cfg.num_train_steps)
            stalls = _StallNotices()
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
                                results[waited[ref]] = self._train_result(ref, models[waited[ref]].job.run_dir)
                    if len(results) == len(trainers):
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
                                raise RuntimeError(f"rollout worker {i} keeps dying: {_first_line(e)}"
                                                   + (f"\n{MEMORY_ADVICE}" if _killed_for_memory(e) else
                                                      f"\nits log: {self._log_dir}/rollout-{i}.log")) from e
                            restarts += 1
                            logger.warning("rollout worker %d died (%s); restarting it", i, type(e).__name__)
                            rollouts[i] = self._rollout_actor(i, curriculum_name, namespace, restart=True)
                            pending[rollouts[i].run.remote()] = i
            except KeyboardInterrupt:
                bar.close()
                self._stop_trainers([(trainers[k], ref, k == 0 and bar.answered) for ref, k in waited.items()
                                     if k not in results])
                raise
            for ref, i in list(pending.items()):  # workers stop on their own once the final weights arrive
                try:
                    summaries[i] = ray.get(ref, timeout=120)
                except Exception as e:  # a worker that cannot finish is stopped below
                    logger.warning("rollout worker %d did not finish cleanly: %s", i, e)
            bar.close()
            curriculum_step = CurriculumClient(ray.get_actor(curriculum_name, namespace=namespace)).step()
            per_model = {m.name: results[k] for k, m in enumerate(models)} if len(models) > 1 else {}
            return JobResult(results[0], summaries, restarts, time.time() - started, curriculum_step, per_model)
        finally:
            self.shutdown()

    def _stop_trainers(self, stopping: list[tuple[Any, Any, bool]]) -> None:
        """Ctrl-C: each trainer (actor, its `run` ref, whether it has answered a call: its actor is built)
        that is training finishes its step and saves a checkpoint (the job resumes from it), for at most
        `ray.stop_timeout_s`; a second Ctrl-C gives up waiting. One still starting (its actor being built:
        no answer to `stop` within STOP_ANSWER_S; or loading, compiling, publishing its first weights: False)
        has nothing new to save and is not waited for. A trainer waiting for rollouts stops at once (the
        replay's wait ends on the stop event). `run`'s cleanup follows."""
        timeout = self.config.ray.stop_timeout_s
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
                    print(f"[marinrl] {_stopped_line(ray.get(ref))}", file=sys.stderr, flush=True)
                except Exception as e:  # it died while stopping
                    print(f"[marinrl] the trainer could not checkpoint: {type(e).__name__}: {e}", file=sys.stderr,
                          flush=True)
        except KeyboardInterrupt:
            print("[marinrl] quitting without a final checkpoint", file=sys.stderr, flush=True)

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
            raise RuntimeError(_trainer_death_message(e, checkpoints)) from e

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


STOP_ANSWER_S = 2.0
"""Ctrl-C: how long a trainer that has not answered a call yet has to answer its stop (a flag set on an idle
thread of its actor); one that has not is still being built, has trained nothing and is not waited for."""


def _stopped_line(result: dict) -> str:
    """What a trainer stopped by Ctrl-C left: the checkpoint a rerun resumes from."""
    if result.get("checkpoint"):
        return (f"stopped at step {result['final_step']}; checkpoint {result['checkpoint']}; run the same config "
                "again to resume")
    if result.get("resumed_from"):  # stopped before its first step: the checkpoint it started from still holds
        return (f"stopped at step {result['final_step']} before training a step (nothing new to checkpoint); run "
                f"the same config again to resume from {result['resumed_from']}")
    return (f"stopped at step {result['final_step']} before training a step: no checkpoint yet, running the config "
            "again starts from step 0")


# Errors a rerun with the same config repeats: the config or an input it names must change first.
_INPUT_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, NotADirectoryError, PermissionError)


def _trainer_death_message(error: Exception, checkpoints: str) -> str:
    """What the trainer died of and what to do: fix an input error; resume from a checkpoint that
    exists (named); or know that a rerun starts from step 0."""
    cause = getattr(error, "cause", None)  # RayTaskError: the trainer's own exception
    if isinstance(error, TrainerGroupDied):  # which process died, and what the others said (several lines)
        what = str(error)
    else:
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(error)
        what = what.strip().splitlines()[0] if what.strip() else type(error).__name__
    latest = _latest_checkpoint(checkpoints)
    after_resume = re.search(r"after resuming from (\S+?):", what)
    if _killed_for_memory(error):
        what = "Ray killed it for memory (the node's memory use passed Ray's limit)"
        advice = MEMORY_ADVICE + (f"; then run the same config again (it resumes from {latest})" if latest else "")
    elif after_resume:  # a rerun would load the same state and fail the same way
        advice = (f"move {after_resume.group(1)} out of {checkpoints} and run the same config again (it resumes "
                  "from the checkpoint before it); if the loss is still NaN, lower optimizer.learning_rate")
    elif "Loss is NaN" in what or "Loss is Inf" in what:
        advice = ("the loss diverged: lower optimizer.learning_rate (or check the loss settings), then run the "
                  "config again" + (f" (it resumes from {latest})" if latest else ""))
    elif "superseded" in what:  # a newer trainer publishes to this run's weights: a rerun would fight it
        advice = ("another job's trainer publishes to this run now: do not run this config again while it runs "
                  "(`python -m marinrl.job.run_lock show <run_dir>` names the job holding the run)")
    elif _is_disk_full(cause if isinstance(cause, BaseException) else error, what):
        advice = (f"no space left on the device of {checkpoints}: free space there (or move run_root), then run "
                  "the same config again" + (f" (it resumes from {latest})" if latest else ""))
    elif isinstance(cause, _INPUT_ERRORS):
        advice = ("this is a config or input error: fix it, then run the config again"
                  + (f" (it resumes from {latest})" if latest else ""))
    elif latest:
        advice = f"run the same config again to resume from its last checkpoint, {latest}"
    else:
        advice = (f"no checkpoint was written under {checkpoints} (checkpoint_every sets how often): "
                  "running the config again starts from step 0")
    return f"the trainer died: {what}\n{advice}"


MEMORY_ADVICE = ("give the trainer and rollout workers more memory: fewer n_rollout_workers per node, a smaller "
                 "trainer.train_batch_size or batching.max_length, a smaller model, or a machine with more memory "
                 "(Ray kills a process once the node's memory use passes RAY_memory_usage_threshold, 0.95)")


def _killed_for_memory(error: BaseException) -> bool:
    """Ray's memory monitor killed the process (an OutOfMemoryError, or an actor death that says so)."""
    return (isinstance(error, ray.exceptions.OutOfMemoryError)
            or isinstance(getattr(error, "cause", None), ray.exceptions.OutOfMemoryError)
            or "memory pressure" in str(error) or "killed due to memory" in str(error).lower())


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _is_disk_full(error: BaseException, what: str) -> bool:
    """ENOSPC anywhere in the exception's chain, or in the message of one that carries no errno
    (tensorstore reports a full disk as a ValueError naming the OS error)."""
    import errno

    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return "no space left on device" in what.lower()


def _latest_checkpoint(checkpoints: str) -> Optional[str]:
    """The checkpoint a rerun resumes from: the newest whose files match their digest (never a damaged one)."""
    from marinrl.train.checkpoints import newest_loadable

    try:
        newest = newest_loadable(checkpoints)
    except Exception:  # unreadable storage: say nothing rather than something wrong
        return None
    return newest.path if newest is not None else None


STALL_NOTICE_S = 15.0
"""A rollout worker's wait on an environment server (a session, a step) is printed once it is this old."""


class _StallNotices:
    """The rollout workers' overdue waits on environment servers (`RolloutActor.waits`), printed on the
    terminal: a server that accepts and never answers is seen in seconds, not after minutes of retries
    in a log file. Each wait once, then once a minute while it lasts. Polls without blocking the job."""

    def __init__(self, every_s: float = 5.0, repeat_s: float = 60.0):
        self._every_s, self._repeat_s = every_s, repeat_s
        self._asked = -math.inf
        self._pending: dict[Any, int] = {}  # a `waits` call in flight -> its worker's index
        self._shown: dict[str, float] = {}

    def poll(self, rollouts: list) -> None:
        done = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)[0] if self._pending else []
        for ref in done:
            i = self._pending.pop(ref)
            try:
                overdue = ray.get(ref)
            except Exception:  # a worker that died: the job restarts it and says so
                continue
            for line in self.lines(i, overdue, time.monotonic()):
                _ProgressBar.write(line)
        now = time.monotonic()
        if now - self._asked >= self._every_s:
            self._asked = now
            busy = set(self._pending.values())
            for i, actor in enumerate(rollouts):
                if i not in busy:  # one call at a time per worker: one still starting does not pile them up
                    self._pending[actor.waits.remote(STALL_NOTICE_S)] = i

    def lines(self, worker: int, overdue: list[str], now: float) -> list[str]:
        out = []
        for what in overdue:
            key = f"{worker}:{what.split(': no answer for ')[0]}"
            if now - self._shown.get(key, -math.inf) >= self._repeat_s:
                self._shown[key] = now
                out.append(f"[marinrl] rollout worker {worker} is waiting: {what} (its log: logs/rollout-{worker}.log)")
        return out


class _ProgressBar:
    """The trainer's step, train reward and step time, polled from its actor."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
        self.answered = False
        """Whether the trainer has answered: its actor is built (Ctrl-C waits for its answer to `stop`)."""

    def update(self, trainer) -> None:
        try:
            p = ray.get(trainer.progress.remote(), timeout=2.0)
        except Exception:  # compiling, or gone: the main loop notices the latter
            return
        self.answered = True
        self._bar.update(p["step"] - self._bar.n)
        if "batch/reward_mean" in p:
            self._bar.set_postfix(reward=f"{p['batch/reward_mean']:.2f}", step_s=f"{p['train/step_s']:.2f}",
                                  stale=f"{p['batch/staleness_mean']:.1f}", refresh=False)

    def close(self) -> None:
        self._bar.close()

    @staticmethod
    def write(line: str) -> None:
        """A line on stderr above the bar."""
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)


def main(config: RLJobConfig) -> JobResult:
    return RLJob(config).run()
