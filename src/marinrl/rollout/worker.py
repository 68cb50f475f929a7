"""RolloutWorker: the coordinating half of the rollout side (docs/architecture.md).

It receives weights, asks the stateless RolloutManager for batches, writes them as rollout files,
feeds training stats to the curriculum, runs evaluations on their cadence and logs metrics. It owns
no model logic. It paces itself by the trainer: a batch meant for trainer step `t` is generated only
with weights `w >= t - max_staleness`, so `max_staleness = 0` is exact on-policy (wait for the next
weights) and `1` overlaps generation of batch N with training on batch N-1.

A failing environment neither spins nor floods: consecutive failures back off (0.1 s doubling to
5 s), each distinct error is logged once with its traceback and then as counts, and a lesson whose
environment fails `max_consecutive_env_failures` calls in a row raises `EnvironmentFailedError`,
which ends the job (restarting the worker would only repeat the failure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Optional, Protocol

import numpy as np

from marinrl.config.rollout_worker import RolloutWorkerConfig
from marinrl.envs.base import COUNTERS
from marinrl.logs import ENV_ERRORS
from marinrl.rollout.errors import EnvironmentFailedError
from marinrl.rollout.policy_router import split_by_model
from marinrl.rollout.warmup import warm_up_sampler
from marinrl.startup import StartupClock
from marinrl.storage.fs import RolloutStorageError
from marinrl.storage.rollouts import RolloutWriter
from marinrl.transfer.base import PollBackoff, WeightTransferClient, WeightWaitTimeout
from marinrl.types import RolloutBatch, version_spread_metrics

logger = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.1
"""Wait after the first of consecutive failed environment calls; it doubles with each further one..."""
BACKOFF_MAX_S = 5.0
"""...up to this. `stop()` interrupts the wait."""


class LessonSource(Protocol):
    """What the worker asks of the curriculum (the manager holds the actor's handle)."""

    def sample_lesson(self, seed: int) -> str: ...


class Tracker(Protocol):
    def log(self, metrics: dict, *, step: Optional[int], commit: Optional[bool] = None) -> None: ...


@dataclasses.dataclass
class _Counters:
    batches_written: int = 0
    rollouts_written: int = 0
    empty_batches: int = 0
    write_failures: int = 0
    sample_failures: int = 0
    eval_failures: int = 0
    weight_updates: int = 0
    inflight_swaps: int = 0
    trainer_restarts: int = 0
    """Weights of a newer trainer epoch received (docs/weight_transfer.md, "Restarts")."""
    batches_dropped_restart: int = 0
    """Batches generated for a trainer that restarted meanwhile: dropped, never written."""


class RolloutWorker:
    """One rollout worker. `run()` loops until the trainer's final weights arrive or `stop()`."""

    def __init__(self, config: RolloutWorkerConfig, manager, lessons: LessonSource, *,
                 clients: dict[str, WeightTransferClient], worker_id: str, tracker: Tracker | None = None,
                 startup: StartupClock | None = None, min_epoch: int | None = None):
        """`clients`: a weight client per stream of `config` (`marinrl.job.plan.build_rollout_host` builds
        them, each filling the model its stream's server holds). `min_epoch`: weights of an older trainer
        epoch (`transfer.base.VersionId.epoch`, the trainer's
        start in ns) belong to a previous job on this run: never generated for, never taken as final.
        The job passes its own start time."""
        self.config = config
        self._min_epoch = min_epoch
        self.startup = startup or StartupClock()
        """Its `startup:` log line (docs/performance.md, "First step")."""
        self.manager = manager
        self.lessons = lessons
        self.worker_id = worker_id
        self.tracker = tracker
        self.counters = _Counters()
        streams = config.streams
        self.weight_steps: dict[str, int | None] = {s.name: None for s in streams}
        """Each policy model's weight step now (one model: `policy`)."""
        self._epochs: dict[str, int | None] = {s.name: None for s in streams}
        """The trainer epoch (`transfer.base.VersionId`) of each model's weights held now."""
        self.eval_history: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._writers = {s.name: RolloutWriter(s.rollout_root, storage_options=config.storage_options)
                         for s in streams}
        missing = sorted({s.name for s in streams} - set(clients))
        if missing:
            raise ValueError(f"RolloutWorker: no weight client for the streams {missing}")
        self._clients = {s.name: clients[s.name] for s in streams}
        self._model_of = {p: s.name for s in streams for p in s.policies}
        self._several = len(streams) > 1
        self._rng = np.random.default_rng([config.seed, abs(hash(worker_id)) % (2**31)])
        self._backoff = PollBackoff(config.fleet_size, config.pointer_reads_per_s, seed=[config.seed, 7])
        """While waiting for weights: this host's share of the fleet's pointer reads, jittered."""
        self._env_totals: dict[str, float] = {}  # "<lesson>/<counter>" -> running total
        self._failure_streak = 0  # failed calls in a row, any lesson: paces the backoff
        self._lesson_streaks: dict[str, int] = {}  # failed calls in a row per lesson: the budget

    @property
    def weight_step(self) -> int | None:
        """The oldest weight step the worker serves (None before every model's first weights): it paces
        the worker and labels its metrics and evaluations."""
        steps = self.weight_steps.values()
        return None if any(s is None for s in steps) else min(steps)

    def stop(self) -> None:
        self._stop.set()

    @property
    def finished(self) -> bool:
        step = self.weight_step
        return step is not None and step >= self.config.final_step

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        cfg = self.config
        clock = self.startup
        if cfg.warm_up_sampler:
            self.warm_up()
            clock.mark("warm_up")
        for name, client in self._clients.items():
            self._receive(name, self._wait_for_this_jobs_trainer(client))
        clock.mark("wait_weights")
        target = self.weight_step  # the trainer step the next batch is for
        seen_restarts = self.counters.trainer_restarts
        batches = 0
        self._evaluate(full=True)
        clock.mark("first_eval")
        last_eval_step = self.weight_step
        waiting_since = None  # waiting for weights the next batch needs
        while not self._stop.is_set() and not self.finished:
            for name, client in self._clients.items():  # every version a client takes is noted here: a
                update = client.poll()                  # restart's lower step included
                if update is not None:
                    waited = 0.0 if waiting_since is None else time.perf_counter() - waiting_since
                    self._receive(name, update, waited_s=waited)
            if self.finished:  # the trainer's last weights: no step will train another batch
                break
            # A newer trainer epoch (a restart, possibly from an older checkpoint) starts the count again from
            # its weights: the steps of the epoch before it will never be published again.
            restarts = self.counters.trainer_restarts
            target = self.weight_step if restarts != seen_restarts else max(target, self.weight_step)
            seen_restarts = restarts
            behind = [n for n, step in self.weight_steps.items() if step < target - cfg.max_staleness]
            if behind:
                if waiting_since is None:
                    waiting_since = time.perf_counter()
                    self._backoff.reset()
                # storage: backs off to the fleet's cap; a relay: answers when it has a newer version.
                # stop() ends the wait at once.
                self._clients[behind[0]].wait_for_news(self._stop, self._backoff)
                continue
            waiting_since = None
            if self._generate_and_write(target):
                target += 1
                batches += 1
                if batches == 1:
                    clock.mark("first_batch")
                    clock.log(logger, self.worker_id)
            if cfg.micro_eval_every and batches % cfg.micro_eval_every == 0:
                self._evaluate(full=False)
            if cfg.eval_every and self.weight_step - last_eval_step >= cfg.eval_every:
                self._evaluate(full=True)
                last_eval_step = self.weight_step
        if self.finished and last_eval_step != self.weight_step:
            self._evaluate(full=True)
        return {"worker_id": self.worker_id, "weight_step": self.weight_step, **dataclasses.asdict(self.counters),
                "evals": self.eval_history, "weights": self._weight_metrics()}

    def _weight_metrics(self) -> dict:
        """The weight client's counters (deltas applied, snapshots loaded, ...); per policy model when several."""
        if not self._several:
            return dict(next(iter(self._clients.values())).metrics)
        return {name: dict(client.metrics) for name, client in self._clients.items()}

    def warm_up(self) -> dict[str, float]:
        """Compile the sampler for the calls the worker makes first: a train batch, a full eval and (if
        configured) a micro eval of every lesson; seconds per call (`marinrl/rollout/warmup.py`)."""
        cfg = self.config
        calls = [("train", cfg.groups_per_batch, cfg.n_generations), ("eval", cfg.eval_examples, 1)]
        if cfg.micro_eval_every:
            calls.append(("eval", cfg.micro_eval_examples, 1))
        return warm_up_sampler(self.manager, calls)

    def _receive(self, name: str, update, waited_s: float = 0.0) -> None:
        self.manager.update_model(update.model, update.weight_step, name if self._several else None)
        self._note_version(name, update)
        self.counters.weight_updates += 1
        prefix = f"weights/{name}/" if self._several else "weights/"
        metrics = {f"{prefix}{k}": v for k, v in self._clients[name].metrics.items()}
        metrics["rollout/weight_wait_s"] = waited_s
        self._log(metrics)

    def _wait_for_this_jobs_trainer(self, client):
        """The first weights of this job's trainer: a previous job's newest version (a higher step, say,
        than the checkpoint this job's trainer resumed from) is skipped, so the worker neither stops at a
        final step nor waits for a step that the trainer now running will not publish."""
        deadline = time.monotonic() + self.config.weight_timeout_s
        update = client.wait_for(0, self.config.weight_timeout_s, self._backoff)
        while self._min_epoch is not None and client.version.epoch < self._min_epoch:
            if time.monotonic() > deadline:
                raise WeightWaitTimeout(
                    f"no weights from this job's trainer after {self.config.weight_timeout_s:.0f} s (holding "
                    f"{client.version}, published before this job started)")
            time.sleep(0.1)
            update = client.poll() or update
        return update

    def _note_version(self, name: str, update) -> None:
        """Record `update` as model `name`'s weights; a newer trainer epoch than the one held is a restart."""
        self.weight_steps[name] = update.weight_step
        version = getattr(self._clients[name], "version", None)
        epoch = None if version is None else version.epoch
        held = self._epochs[name]
        if held is not None and epoch is not None and epoch > held:
            self.counters.trainer_restarts += 1
            logger.warning("%s: the trainer restarted (weights of epoch %d at step %d after epoch %d): following it",
                           self.worker_id, epoch, update.weight_step, held)
        self._epochs[name] = epoch

    def _newer_epoch_waiting(self) -> bool:
        """Whether a restarted trainer's weights are waiting (received now if so): the batch just generated
        for the previous trainer is then never written, since the new one counts its steps afresh."""
        restarts = self.counters.trainer_restarts
        for name, client in self._clients.items():
            update = client.poll()
            if update is not None:
                self._receive(name, update)
        return self.counters.trainer_restarts != restarts

    def _inflight_updates(self):
        """While a training batch is generated: the server swaps in weights that arrive meanwhile
        (`inflight`), and this worker follows (its weight step, its counters). The batch stays stamped
        with the step it began with; its tokens carry the steps that sampled them."""
        if not self.config.inflight.enabled:
            return contextlib.nullcontext()

        (name, client), = self._clients.items()  # one model (checked in the config)

        def poll():
            update = client.poll()
            if update is not None:
                self._note_version(name, update)
                self.counters.weight_updates += 1
                self.counters.inflight_swaps += 1
            return update

        return self.manager.server.inflight_updates(poll, self.config.inflight)

    def _generate_and_write(self, target: int) -> bool:
        cfg = self.config
        lesson_id = self.lessons.sample_lesson(int(self._rng.integers(2**31)))
        started = time.perf_counter()
        restarts_before = self.counters.trainer_restarts
        ENV_ERRORS.forget_last()
        try:
            with self._inflight_updates():
                batch, metrics = self.manager.sample_batch(
                    lesson_id, cfg.groups_per_batch, cfg.n_generations, "train", self._rng,
                    weight_step=self.weight_step, worker_id=self.worker_id)
        except Exception as e:  # the manager isolates env failures; anything else is counted too
            ENV_ERRORS.report(logger, f"sample_batch of lesson {lesson_id!r} failed", e)
            self.counters.sample_failures += 1
            self._log(self._failure_metrics({}))
            self._failed(lesson_id, ENV_ERRORS.last())
            return False
        gen_s = time.perf_counter() - started
        if batch is None:
            self.counters.empty_batches += 1
            self._log(self._failure_metrics(metrics))
            dropped = ", ".join(f"{k.split('/', 1)[1]}={v:g}" for k, v in metrics.items()
                                if k.split("/", 1)[1] in COUNTERS and v)
            self._failed(lesson_id, ENV_ERRORS.last() or f"it returned no usable group ({dropped or 'no groups'})")
            return False
        self._failure_streak = self._lesson_streaks[lesson_id] = 0
        if self.counters.trainer_restarts != restarts_before or self._newer_epoch_waiting():
            self.counters.batches_dropped_restart += 1
            logger.warning("%s: dropped a batch of %d rollouts generated for the trainer before its restart",
                           self.worker_id, len(batch.rollouts))
            return False
        parts = (split_by_model(batch, self._model_of, self.weight_steps) if self._several
                 else [(next(iter(self._writers)), batch)])
        if not all([self._write(name, part) for name, part in parts]):
            return False
        self.manager.update_training_stats(lesson_id, batch, self.weight_step)
        n_tokens = sum(r.response_tokens.size for r in batch.rollouts)
        rewards = np.array([r.episode_reward for r in batch.rollouts])
        lengths = np.array([r.response_tokens.size for r in batch.rollouts])
        finish = [r.finish_reason for r in batch.rollouts]
        self._log({
            "rollout/reward_mean": float(rewards.mean()),
            f"rollout/reward/{lesson_id}": float(rewards.mean()),
            "rollout/response_length_mean": float(lengths.mean()),
            "rollout/finish_stop_frac": finish.count("stop") / len(finish),
            "rollout/staleness_at_write": float(target - self.weight_step),
            "rollout/generation_s": gen_s,
            "rollout/gen_tokens_per_s": n_tokens / max(gen_s, 1e-9),
            **version_spread_metrics(batch.rollouts, "rollout"),
            "rollout/inflight_swaps": self.counters.inflight_swaps,
            "rollout/batches_written": self.counters.batches_written,
            "rollout/write_failures": self.counters.write_failures,
            **self._failure_metrics(metrics),
        })
        return True

    def _failure_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """`metrics` of one call with its failure counters replaced by running totals, plus the worker's."""
        out = {}
        for key, value in metrics.items():
            if key.split("/", 1)[-1] in COUNTERS:
                value = self._env_totals[key] = self._env_totals.get(key, 0.0) + value
            out[f"env/{key}"] = value
        return {**out, "rollout/sample_failures": self.counters.sample_failures,
                "rollout/empty_batches": self.counters.empty_batches}

    def _failed(self, lesson_id: str, error: Optional[str]) -> None:
        """One more failed call of `lesson_id`: back off, or raise once the lesson is out of budget."""
        budget = self.config.max_consecutive_env_failures
        self._failure_streak += 1
        streak = self._lesson_streaks[lesson_id] = self._lesson_streaks.get(lesson_id, 0) + 1
        if streak >= budget:
            ENV_ERRORS.log_summary(logger)
            message = (f"lesson {lesson_id!r}: environment {self.manager.describe_env(lesson_id)} failed {streak} "
                       f"calls in a row (max_consecutive_env_failures={budget}); last error: {error}")
            logger.error("%s; stopping", message)
            raise EnvironmentFailedError(message)
        self._stop.wait(min(BACKOFF_FIRST_S * 2 ** (self._failure_streak - 1), BACKOFF_MAX_S))

    def _write(self, model_name: str, batch: RolloutBatch, attempts: int = 3) -> bool:
        for attempt in range(attempts):
            try:
                self._writers[model_name].write(batch)
                self.counters.batches_written += 1
                self.counters.rollouts_written += len(batch)
                return True
            except (OSError, RolloutStorageError) as e:  # storage is retried inside; count and go on
                self.counters.write_failures += 1
                logger.warning("writing a rollout batch failed (attempt %d/%d): %s", attempt + 1, attempts, e)
                self._stop.wait(0.5 * 2**attempt)
        return False

    def _evaluate(self, full: bool) -> None:
        cfg = self.config
        step = self.weight_step
        kind = "eval" if full else "micro_eval"
        n_examples = cfg.eval_examples if full else cfg.micro_eval_examples
        lesson_ids = (list(self.manager.lessons) if full
                      else [self.lessons.sample_lesson(int(self._rng.integers(2**31)))])
        metrics: dict[str, float] = {}
        reasons: dict[str, str] = {}  # "<kind>/<lesson>/reward_mean" -> why it is nan
        for lesson_id in lesson_ids:
            ENV_ERRORS.forget_last()
            try:
                stats, _ = self.manager.evaluate_lesson(lesson_id, n_examples, kind, self._rng, step=step,
                                                        weight_step=step, worker_id=self.worker_id)
            except Exception as e:
                ENV_ERRORS.report(logger, f"evaluating lesson {lesson_id!r} failed", e)
                self.counters.eval_failures += 1
                stats = {"reward_mean": float("nan"), "n": 0.0, "env_failures": 1.0}
            for k, v in stats.items():
                if isinstance(v, (int, float)):
                    metrics[f"{kind}/{lesson_id}/{k}"] = float(v)
            if not stats.get("n"):
                last = ENV_ERRORS.last()
                reason = (f"environment failed: {last}" if stats.get("env_failures")
                          else f"no usable group: {last or 'the environment returned none'}")
                reasons[f"{kind}/{lesson_id}/reward_mean"] = reason
                logger.warning("%s of lesson %r at weight step %s has no rewards: %s", kind, lesson_id, step, reason)
        self.eval_history.append({"kind": kind, "weight_step": step, "metrics": metrics, "reasons": reasons})
        self._log(metrics)

    def _log(self, metrics: dict) -> None:
        if self.tracker is not None and metrics:
            self.tracker.log(metrics, step=self.weight_step)
