"""TrainWorker: streams rollout files through the replay buffer into GRPO-family updates.

Levanter's `Trainer` owns the mesh, the sharded optimizer step and the checkpoint format; this
class owns the RL loop around it — sample a batch of whole groups for the current weight step,
take one update, publish the new weights every `sync_interval` steps, and checkpoint everything a
resumed run needs (model, optimizer, step, the replay buffer's reader cursor and pending groups, the
curriculum's state) so that no rollout file is trained twice or skipped. Resume takes the newest
checkpoint that loads; old checkpoints are deleted per `checkpoint_keep` (`marinrl/train/saved_state.py`,
`checkpoints.py`). With `lora`, only LoRA adapters on the frozen model are trained, checkpointed and published
(`marinrl/models/lora.py`); with `adapters`, K of them stacked on one base, each with its own loss, optimizer state,
replay buffer and weight stream (`marinrl/train/adapter_slots.py`, `adapter_streams.py`): the same loop. What it
trains with besides Levanter's Trainer (the weight server, the replay buffer, the checkpoint writer, the audit trail,
the reference) comes built by the plan as `TrainerParts` (`marinrl/train/parts.py`, `marinrl/job/plan.build_trainer`):
this class is the loop, not the wiring.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import equinox as eqx
import haliax as hax
import levanter
import levanter.tracker
import psutil
from levanter.metrics import Metric, ReductionType
from levanter.trainer import Trainer

from marinrl import multihost, program_audit
from marinrl.config.loss import LossConfig
from marinrl.config.train_worker import TrainWorkerConfig
from marinrl.levanter_configs import cpu_trainer_config, name_the_trainer_log_once, to_levanter
from marinrl.models import lora as lora_rl
from marinrl.startup import StartupClock
from marinrl.train.adapter_slots import per_adapter, per_adapter_loss, per_slot
from marinrl.train.batching import TrainingBatch, row_alignment
from marinrl.train.checkpoints import SIDECAR, StepFolder, bound_restore_memory, release_host_memory
from marinrl.train.cohort_batch import next_batch
from marinrl.train.initial_weights import CheckpointWeights
from marinrl.train.losses import describe, rl_loss, token_logprobs
from marinrl.train.parts import TrainerParts
from marinrl.train.saved_state import initial_state
from marinrl.transfer.base import cast_for_publish

if TYPE_CHECKING:
    from marinrl.train.replay.buffer import ReplayBuffer
    from marinrl.transfer.base import WeightTransferServer

logger = logging.getLogger(__name__)

__all__ = ["SIDECAR", "TrainResult", "TrainWorker"]


class CurriculumHandle(Protocol):
    """What the trainer needs of the curriculum: its clock and its checkpointed state."""

    def set_step(self, step: int) -> None: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def weights(self) -> dict[str, float]: ...


_HISTORY_KEYS = ("batch/reward_mean", "batch/staleness_mean", "batch/staleness_max", "batch/use_mean", "train/step_s",
                 "batch/version_spread_max", "batch/token_staleness_mean",
                 "train/wait_s",
                 "train/update_s", "train/batch_s", "train/publish_s")


def _in_history(key: str) -> bool:
    """A step's metric kept in `TrainResult.history`: the step's own, and each adapter's reward (several)."""
    return key in _HISTORY_KEYS or (key.startswith("policy_model/") and key.endswith("/batch/reward_mean"))


class StepInput(eqx.Module):
    """What one Levanter train step consumes: the batch, plus the frozen reference's logprobs when
    the loss has a KL term (computed outside the differentiated function, once per step)."""

    batch: TrainingBatch
    reference_logprobs: Optional[hax.NamedArray] = None


def _input_loss(model, inp: StepInput, *, config: LossConfig, lm_head_float32: bool = False, key=None):
    return rl_loss(model, inp.batch, config=config, reference_logprobs=inp.reference_logprobs, key=key,
                   lm_head_float32=lm_head_float32)


def _step_loss(model, inp: StepInput, *, config: LossConfig, lm_head_float32: bool = False,
               adapters: tuple[str, ...] = (), key=None):
    """The loss of one model, or with `adapters` (their names) the sum of each adapter's own loss on its own rows
    (`adapter_slots.per_adapter_loss`)."""
    loss_fn = functools.partial(_input_loss, config=config, lm_head_float32=lm_head_float32)
    if adapters:
        loss_fn = per_adapter_loss(loss_fn, adapters)
    loss, metrics = loss_fn(model, inp, key=key)
    return loss, {k: Metric.from_value(v, _reduction(k)) for k, v in metrics.items()}


def _reduction(name: str) -> ReductionType:
    """How a loss metric combines across microbatches (Levanter's naming rule, stated explicitly)."""
    if name.endswith("_max"):
        return ReductionType.MAX
    if name.endswith("_min"):
        return ReductionType.MIN
    if name.startswith("num_"):
        return ReductionType.SUM
    return ReductionType.MEAN


@dataclasses.dataclass
class TrainResult:
    first_step: int
    """The weight step the run started from (0, or the resumed checkpoint's)."""
    final_step: int
    checkpoint: Optional[str]
    metrics: dict[str, float]
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Per step: loss, train reward, staleness and the step-time split (for summaries and plots)."""
    trained_groups: list[list[str]] = dataclasses.field(default_factory=list)
    """Per step (parallel to `history`): the group ids trained on, to audit exactly-once consumption."""
    resumed_from: Optional[str] = None
    """The checkpoint folder the run resumed from (None: a fresh start)."""
    skipped_checkpoints: list[str] = dataclasses.field(default_factory=list)
    """`<folder>: <why>` for each newer checkpoint that did not load on resume."""
    process: dict = dataclasses.field(default_factory=dict)
    """This process's peak RSS, its RSS before the model, checkpoint reads and (when auditing) the largest
    constant bytes of its programs (`marinrl.program_audit.process_stats`)."""


@dataclasses.dataclass
class _Run:
    """One run's state, shared by the loop's steps."""

    config: TrainWorkerConfig
    """The worker's config with the batching its model's size sets (`BatchingConfig.for_model`)."""
    trainer: Trainer
    cohort: multihost.Cohort
    state: Any
    replay: Optional[ReplayBuffer]
    server: WeightTransferServer
    reference: Any
    ref_fn: Callable
    first_step: int
    num_steps: int
    skipped: list[str]
    rss_before_model: int
    last_ckpt: Optional[str] = None
    info: Any = None
    """Levanter's `StepInfo` of the last update (None: none taken yet)."""
    program_constants: Optional[int] = None


class TrainWorker:
    """One trainer: `run()` until `trainer.num_train_steps` or `stop()`; resumable from its checkpoints."""

    def __init__(self, config: TrainWorkerConfig, parts: TrainerParts, *, curriculum: CurriculumHandle | None = None,
                 on_step: Callable[[int, dict], None] | None = None, startup: StartupClock | None = None,
                 update: Callable[[Trainer, Any, StepInput], Any] | None = None):
        """`parts`: what it trains with besides Levanter's Trainer (`marinrl.job.plan.build_trainer` builds
        them from `config`). `update(trainer, state, step_input) -> StepInfo` takes the optimizer step; None:
        Levanter's `trainer.train_step`. `bench/fleet.py` passes a model of time there (an update of a
        256-host batch would take minutes on a CPU); everything around it (ingest, replay, batching,
        checkpoints, publishing, the audit trail) is this class's own."""
        self.config = config
        self.parts = parts
        self._update = update
        self._startup = startup or StartupClock()  # its `startup:` log line: docs/performance.md, "First step"
        self._curriculum = curriculum
        self._on_step = on_step
        self._stop = threading.Event()
        self.training = False
        """True once `run()` has loaded its state, built its reference and published its first weights: a
        stop from then on ends the run with a final checkpoint; before, it has nothing new to save."""
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.trained_groups: list[list[str]] = []
        self._resumed_from: StepFolder | None = None
        self.trainer_id = parts.trainer_id
        """This incarnation's name in the audit trail and in the sidecars of its checkpoints."""
        self.model = None
        """The trained model once `run()` returns (with LoRA: base and adapters)."""

    def stop(self) -> bool:
        """Ends the run after the current step, with a final checkpoint. Returns `training`: False means
        the run is still starting (it stops before its first step, with nothing new to save), so a caller
        that is shutting down need not wait for it."""
        self._stop.set()  # before reading `training`: `run()` sets it before its first look at the event
        return self.training

    # ------------------------------------------------------------------ the loop

    def run(self) -> TrainResult:
        cfg = self.config
        trainer_cfg = multihost.levanter_trainer_config(cfg.trainer or cpu_trainer_config())
        name_the_trainer_log_once()
        levanter.initialize(trainer_cfg)
        bound_restore_memory()  # a restore holds the state, not twice the state
        self._startup.mark("init")
        optimizer = to_levanter(cfg.optimizer).build(trainer_cfg.num_train_steps)
        names = tuple(a.name for a in cfg.adapters)
        if names:  # each adapter its own optimizer state (adapter_slots.per_slot)
            optimizer = per_slot(optimizer, len(names))
        header = describe(cfg.loss)
        logger.info("loss: %s", header)
        print(f"[marinrl] {header}", flush=True)

        cohort = multihost.current_cohort()  # several processes: only process 0 reads, clocks, writes the sidecar
        if not cohort.is_leader:
            self._curriculum = None
        step_loss = functools.partial(_step_loss, config=cfg.loss, lm_head_float32=cfg.model.lm_head_float32,
                                      adapters=names)
        checkpoints = self.parts.checkpoints
        with Trainer(trainer_cfg, optimizer, step_loss, add_default_hooks=False) as trainer:
            cohort.set_resume_hint(functools.partial(_resume_hint, trainer.checkpoint_path))
            run = self._start(trainer, cohort)
            if run.replay is not None:
                run.replay.start()
            self.training = True  # before the loop's first look at the stop event (`stop()`)
            try:
                # several: stop is shared
                while self.step < run.num_steps and (cohort.multiprocess or not self._stop.is_set()):
                    if not self._train_step(run):  # asked to stop while waiting for rollouts
                        break
                if run.info is not None and run.last_ckpt != checkpoints.folder(run.info):
                    run.last_ckpt = checkpoints.write(run.info, run.replay, self._curriculum)
            finally:
                if run.replay is not None:
                    run.replay.stop()
                run.server.close()
                checkpoints.wait()
                self.model = run.state.model
            levanter.tracker.current_tracker().finish()
            metrics = {**(run.replay.metrics() if run.replay is not None else {}), **checkpoints.metrics(run.skipped)}
            return TrainResult(run.first_step, self.step, run.last_ckpt, metrics, self.history, self.trained_groups,
                               resumed_from=self._resumed_from.path if self._resumed_from else None,
                               skipped_checkpoints=run.skipped,
                               process=program_audit.process_stats(run.rss_before_model, run.program_constants))

    def _start(self, trainer: Trainer, cohort: multihost.Cohort) -> _Run:
        """The run's start: its state (resumed or fresh), the audit trail's first record, the reference, and
        the first weights published (those rollouts for the first step need)."""
        cfg, parts, clock = self.config, self.parts, self._startup
        rss_before_model = psutil.Process().memory_info().rss
        source = CheckpointWeights(cfg.model, trainer)  # read at most once in this process
        start = initial_state(cfg, trainer, source, parts.replay, self._curriculum)
        self._resumed_from = start.resumed_from
        resumed_from = start.resumed_from.path if start.resumed_from else None
        release_host_memory()  # what the checkpoint's reads left in the C heap
        clock.mark("state")
        state = start.state
        first_step = self.step = int(state.step)
        if self._curriculum is not None:
            self._curriculum.set_step(first_step)
        if parts.audit is not None:
            parts.audit.start(first_step, resumed_from, start.parent)
        reference = (parts.reference(source, trainer, state, start.resumed_from is not None)
                     if parts.reference is not None else None)
        source.release()
        clock.mark("reference")
        logprobs = functools.partial(token_logprobs, lm_head_float32=cfg.model.lm_head_float32)
        if cfg.adapters:  # the frozen base on each adapter's rows
            logprobs = per_adapter(logprobs, len(cfg.adapters))
        ref_fn = hax.named_jit(logprobs, axis_resources=trainer.compute_axis_mapping)
        server = parts.weight_server()
        if cfg.lora is not None:
            print(f"[marinrl] {lora_rl.describe(state.model, cfg.lora)}"
                  + (f" in {len(cfg.adapters)} adapters on one base ({', '.join(a.name for a in cfg.adapters)})"
                     if cfg.adapters
                     else ""), flush=True)
        server.publish(self._published(state.model), first_step)  # the weights rollouts for `first_step` need
        clock.mark("publish")
        parts.checkpoints.open(trainer.config.checkpointer.create(trainer.run_id), resumed_from)
        return _Run(config=dataclasses.replace(
                        cfg, batching=cfg.batching.for_model(getattr(state.model.config, "hidden_dim", None))),
                    trainer=trainer, cohort=cohort, state=state, replay=start.replay, server=server,
                    reference=reference, ref_fn=ref_fn, first_step=first_step,
                    num_steps=trainer.config.num_train_steps, skipped=start.skipped,
                    rss_before_model=rss_before_model)

    def _train_step(self, run: _Run) -> bool:
        """One update: a batch, the reference's logprobs, the optimizer step, a publish and a checkpoint on
        their cadences, the step's metrics. False: asked to stop while waiting for rollouts."""
        cfg, trainer, clock = run.config, run.trainer, self._startup
        t0 = time.perf_counter()
        if run.cohort.multiprocess:
            got = next_batch(run.cohort, run.replay, self.step, cfg, self._stop, trainer)
            if got is None:
                return False
            sample, batch, group_ids = got
            t1 = time.perf_counter()
        else:
            sample = run.replay.sample(self.step, cfg.groups_per_step, stop=self._stop)
            if sample is None:
                return False
            t1 = time.perf_counter()
            group_ids = [g.group.group_id for g in sample.groups]
            batch = sample.training_batch(batch_size=trainer.config.train_batch_size, config=cfg.batching,
                                          **row_alignment(trainer.config))
            batch = hax.shard(batch, trainer.compute_axis_mapping)
        ref_model = self._reference_of(run.state, run.reference)
        ref = run.ref_fn(ref_model, batch) if ref_model is not None else None
        if ref is not None:
            ref.array.block_until_ready()
        t2 = time.perf_counter()
        if self.step == run.first_step and program_audit.auditing():  # traced before the step donates `state`
            run.program_constants = self._program_constants(trainer, run.state, StepInput(batch, ref), run.ref_fn,
                                                            ref_model)
        try:
            info = (self._update(trainer, run.state, StepInput(batch, ref)) if self._update is not None
                    else trainer.train_step(run.state, StepInput(batch, ref)))
        except RuntimeError as e:  # Levanter's "Loss is NaN" / "Loss is Inf"
            if self.step == run.first_step and self._resumed_from is not None and "Loss is" in str(e):
                raise RuntimeError(f"{e} at the first step after resuming from {self._resumed_from.path}:"
                                   " that checkpoint's state is probably broken") from e
            raise
        run.info, run.state = info, info.state
        t3 = time.perf_counter()
        self.step = int(info.state.step)
        if self._curriculum is not None:
            self._curriculum.set_step(self.step)
        published = self.step % cfg.sync_interval == 0 or self.step >= run.num_steps
        if published:
            run.server.publish(self._published(info.state.model), self.step)
        t4 = time.perf_counter()
        if self.step == run.first_step + 1:  # the first step's parts, compiles included
            for phase, seconds in (("first_wait", t1 - t0), ("first_batch", t2 - t1),
                                   ("first_update", t3 - t2), ("first_publish", t4 - t3)):
                clock.mark(phase, seconds)
            clock.log(logger, "trainer")
        trained = [(g.group.group_id, g.weight_step) for g in sample.groups] if sample is not None else []
        if self.parts.audit is not None and sample is not None:  # before the step's checkpoint commits
            self.parts.audit.record(self.step, trained)
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            run.last_ckpt = self.parts.checkpoints.write(info, run.replay, self._curriculum)
        metrics = {
            "train/step_s": t4 - t0, "train/wait_s": t1 - t0, "train/batch_s": t2 - t1,
            "train/update_s": t3 - t2, "train/publish_s": t4 - t3 if published else 0.0,
            "batch/rows": float(batch.Batch.size), "batch/row_length": float(batch.Pos.size),
            **{f"weights/{k}": v for k, v in run.server.metrics.items()},
            **self.parts.checkpoints.metrics(run.skipped),
        }
        if sample is not None:  # process 0 (or the only one)
            metrics.update({**sample.metrics(), **run.replay.metrics()})
        if self._curriculum is not None:
            metrics.update({f"curriculum/{k}/weight": v for k, v in self._curriculum.weights().items()})
        if run.cohort.is_leader:
            levanter.tracker.log(metrics, step=info.step)  # Levanter's x-axis: the update just taken
        self.history.append({"step": self.step, "loss": float(info.loss),
                             **{k: float(v) for k, v in metrics.items() if _in_history(k)}})
        self.trained_groups.append(group_ids)
        if self._on_step is not None and sample is not None:
            self._on_step(self.step, {"loss": info.loss, "groups": trained, **metrics})
        return True

    @staticmethod
    def _program_constants(trainer: Trainer, state, step_input, ref_fn, ref_model) -> int:
        """The largest constant bytes of this trainer's programs: the train step and the reference's
        logprobs (docs/models.md, "Loading": weights are arguments, never constants)."""
        step = trainer._jit_train_step_fn_no_hook  # what `trainer.train_step` runs without hooks
        sizes = [program_audit.constant_bytes(step, state, (step_input,), {})]
        if ref_model is not None:
            sizes.append(program_audit.constant_bytes(ref_fn, ref_model, step_input.batch))
        return max(sizes)

    def _published(self, model):
        """What a weight version carries: the adapters alone with LoRA, else the whole model; in
        `publish_dtype` (one jitted cast, each array sharded as the parameter it comes from)."""
        published = lora_rl.adapter_only(model) if self.config.lora is not None else model
        if self.config.publish_dtype is None:
            return published
        return cast_for_publish(published, self.config.publish_dtype)

    def _reference_of(self, state, reference):
        """The KL reference: with LoRA the policy's own frozen base (its adapters taken off; taken from
        each step's state, whose buffers the train step donates), else the separately built `reference`."""
        if not self.config.loss.uses_reference:
            return None
        return lora_rl.without_adapters(state.model) if self.config.lora is not None else reference


def _resume_hint(checkpoint_root: str) -> str:
    """Which checkpoint a rerun resumes from, for the message of a trainer that loses a peer process."""
    from marinrl.train.checkpoints import newest_loadable

    newest = newest_loadable(checkpoint_root)
    if newest is None:
        return f"no intact checkpoint is committed under {checkpoint_root} yet: the rerun starts from weight step 0"
    return f"it resumes from {newest.path} (weight step {newest.step + 1})"
