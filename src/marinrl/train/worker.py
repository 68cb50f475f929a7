"""TrainWorker: streams rollout files through the replay buffer into GRPO-family updates.

Levanter's `Trainer` owns the mesh, the sharded optimizer step and the checkpoint format; this
class owns the RL loop around it — sample a batch of whole groups for the current weight step,
take one update, publish the new weights every `sync_interval` steps, and checkpoint everything a
resumed run needs (model, optimizer, step, the replay buffer's reader cursor and pending groups, the
curriculum's state) so that no rollout file is trained twice or skipped. Resume takes the newest
checkpoint that loads; old checkpoints are deleted per `checkpoint_keep` (`marinrl/train/checkpoints.py`).
With `lora`, only LoRA adapters on the frozen model are trained, checkpointed and published (`marinrl/models/lora.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from typing import Any, Callable, Optional, Protocol

import equinox as eqx
import fsspec
import haliax as hax
import jax
import levanter
import levanter.tracker
import psutil
from levanter.metrics import Metric, ReductionType
from levanter.trainer import Trainer

from marinrl import multihost, program_audit
from marinrl.config.loss import LossConfig
from marinrl.config.replay import overlong_reward_fn
from marinrl.config.train_worker import TrainWorkerConfig
from marinrl.levanter_configs import cpu_trainer_config, name_the_trainer_log_once, to_levanter
from marinrl.models import lora as lora_rl
from marinrl.startup import StartupClock
from marinrl.storage.rollouts import RolloutReader
from marinrl.train.audit import AuditTrail, new_trainer_id
from marinrl.train.batching import TrainingBatch, row_alignment
from marinrl.train.checkpoints import (
    SIDECAR,
    StepFolder,
    apply_retention,
    bound_restore_memory,
    load_newest,
    read_sidecar,
    release_host_memory,
    remove_folder,
    write_digest,
)
from marinrl.train.cohort_batch import next_batch
from marinrl.train.initial_weights import (
    CheckpointWeights,
    build_reference,
    fresh_model_init,
    is_initial_policy,
    resume_model_init,
)
from marinrl.train.losses import describe, rl_loss, token_logprobs
from marinrl.train.replay.buffer import ReplayBuffer
from marinrl.transfer.base import cast_for_publish
from marinrl.transfer.endpoints import build_server

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


class StepInput(eqx.Module):
    """What one Levanter train step consumes: the batch, plus the frozen reference's logprobs when
    the loss has a KL term (computed outside the differentiated function, once per step)."""

    batch: TrainingBatch
    reference_logprobs: Optional[hax.NamedArray] = None


def _step_loss(model, inp: StepInput, *, config: LossConfig, lm_head_float32: bool = False, key=None):
    loss, metrics = rl_loss(model, inp.batch, config=config, reference_logprobs=inp.reference_logprobs, key=key,
                            lm_head_float32=lm_head_float32)
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


class TrainWorker:
    """One trainer: `run()` until `trainer.num_train_steps` or `stop()`; resumable from its checkpoints."""

    def __init__(self, config: TrainWorkerConfig, *, curriculum: CurriculumHandle | None = None,
                 on_step: Callable[[int, dict], None] | None = None, startup: StartupClock | None = None,
                 update: Callable[[Trainer, Any, StepInput], Any] | None = None):
        """`update(trainer, state, step_input) -> StepInfo` takes the optimizer step; None: Levanter's
        `trainer.train_step`. `bench/fleet.py` passes a model of time there (an update of a 256-host batch
        would take minutes on a CPU); everything around it (ingest, replay, batching, checkpoints,
        publishing, the audit trail) is this class's own."""
        self.config = config
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
        self._parent: str | None = None  # the incarnation that wrote the checkpoint resumed from
        self.trainer_id = new_trainer_id()
        """This incarnation's name in the audit trail and in the sidecars of its checkpoints."""
        self._checkpoints_deleted = 0
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
        clock = self._startup
        name_the_trainer_log_once()
        levanter.initialize(trainer_cfg)
        bound_restore_memory()  # a restore holds the state, not twice the state
        clock.mark("init")
        num_steps = trainer_cfg.num_train_steps
        optimizer = to_levanter(cfg.optimizer).build(num_steps)
        header = describe(cfg.loss)
        logger.info("loss: %s", header)
        print(f"[marinrl] {header}", flush=True)

        cohort = multihost.current_cohort()  # several processes: only process 0 reads, clocks, writes the sidecar
        if not cohort.is_leader:
            self._curriculum = None
        step_loss = functools.partial(_step_loss, config=cfg.loss, lm_head_float32=cfg.model.lm_head_float32)
        with Trainer(trainer_cfg, optimizer, step_loss, add_default_hooks=False) as trainer:
            cohort.set_resume_hint(functools.partial(_resume_hint, trainer.checkpoint_path))
            rss_before_model = psutil.Process().memory_info().rss
            source = CheckpointWeights(cfg.model, trainer)  # read at most once in this process
            state, replay, skipped = self._initial_state(trainer, source)
            release_host_memory()  # what the checkpoint's reads left in the C heap
            clock.mark("state")
            cfg = dataclasses.replace(
                cfg, batching=cfg.batching.for_model(getattr(state.model.config, "hidden_dim", None)))
            first_step = self.step = int(state.step)
            if self._curriculum is not None:
                self._curriculum.set_step(first_step)
            trail = None
            if cfg.audit_root is not None and cohort.is_leader:
                trail = AuditTrail(cfg.audit_root, self.trainer_id, cfg.storage_options)
                trail.start(first_step, self._resumed_from.path if self._resumed_from else None, self._parent)

            reference = None
            if cfg.loss.uses_reference and cfg.lora is None:  # with LoRA: the base, `_reference_of(state)`
                fresh = is_initial_policy(cfg.model, trainer, state, resumed=self._resumed_from is not None)
                reference = build_reference(source, trainer, initial_policy=state.model if fresh else None)
            source.release()
            clock.mark("reference")
            ref_fn = hax.named_jit(functools.partial(token_logprobs, lm_head_float32=cfg.model.lm_head_float32),
                                   axis_resources=trainer.compute_axis_mapping)
            server = build_server(cfg.weights)
            if cfg.lora is not None:
                print(f"[marinrl] {lora_rl.describe(state.model, cfg.lora)}", flush=True)
            server.publish(self._published(state.model), first_step)  # the weights rollouts for `first_step` need
            clock.mark("publish")
            checkpointer = trainer_cfg.checkpointer.create(trainer.run_id)
            batch_size = trainer_cfg.train_batch_size
            last_ckpt = None
            info = None
            program_constants = None
            if replay is not None:
                replay.start()
            self.training = True  # before the loop's first look at the stop event (`stop()`)
            try:
                # several: stop is shared
                while self.step < num_steps and (cohort.multiprocess or not self._stop.is_set()):
                    t0 = time.perf_counter()
                    if cohort.multiprocess:
                        got = next_batch(cohort, replay, self.step, cfg, self._stop, trainer)
                        if got is None:
                            break
                        sample, batch, group_ids = got
                        t1 = time.perf_counter()
                    else:
                        sample = replay.sample(self.step, cfg.groups_per_step, stop=self._stop)
                        if sample is None:  # asked to stop while waiting for rollouts
                            break
                        t1 = time.perf_counter()
                        group_ids = [g.group.group_id for g in sample.groups]
                        batch = sample.training_batch(batch_size=batch_size, config=cfg.batching,
                                                      **row_alignment(trainer.config))
                        batch = hax.shard(batch, trainer.compute_axis_mapping)
                    ref_model = self._reference_of(state, reference)
                    ref = ref_fn(ref_model, batch) if ref_model is not None else None
                    if ref is not None:
                        ref.array.block_until_ready()
                    t2 = time.perf_counter()
                    if self.step == first_step and program_audit.auditing():  # traced before the step donates `state`
                        program_constants = self._program_constants(trainer, state, StepInput(batch, ref), ref_fn,
                                                                    ref_model)
                    try:
                        info = (self._update(trainer, state, StepInput(batch, ref)) if self._update is not None
                                else trainer.train_step(state, StepInput(batch, ref)))
                    except RuntimeError as e:  # Levanter's "Loss is NaN" / "Loss is Inf"
                        if self.step == first_step and self._resumed_from is not None and "Loss is" in str(e):
                            raise RuntimeError(f"{e} at the first step after resuming from {self._resumed_from.path}:"
                                               " that checkpoint's state is probably broken") from e
                        raise
                    state = info.state
                    t3 = time.perf_counter()
                    self.step = int(state.step)
                    if self._curriculum is not None:
                        self._curriculum.set_step(self.step)
                    published = self.step % cfg.sync_interval == 0 or self.step >= num_steps
                    if published:
                        server.publish(self._published(state.model), self.step)
                    t4 = time.perf_counter()
                    if self.step == first_step + 1:  # the first step's parts, compiles included
                        for phase, seconds in (("first_wait", t1 - t0), ("first_batch", t2 - t1),
                                               ("first_update", t3 - t2), ("first_publish", t4 - t3)):
                            clock.mark(phase, seconds)
                        clock.log(logger, "trainer")
                    if trail is not None and sample is not None:  # before the step's checkpoint commits
                        trail.record(self.step, [(g.group.group_id, g.weight_step) for g in sample.groups])
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        last_ckpt = self._checkpoint(checkpointer, info, replay)
                    metrics = {
                        "train/step_s": t4 - t0, "train/wait_s": t1 - t0, "train/batch_s": t2 - t1,
                        "train/update_s": t3 - t2, "train/publish_s": t4 - t3 if published else 0.0,
                        "batch/rows": float(batch.Batch.size), "batch/row_length": float(batch.Pos.size),
                        **{f"weights/{k}": v for k, v in server.metrics.items()}, **self._checkpoint_metrics(skipped),
                    }
                    if sample is not None:  # process 0 (or the only one)
                        metrics.update({**sample.metrics(), **replay.metrics()})
                    if self._curriculum is not None:
                        metrics.update({f"curriculum/{k}/weight": v for k, v in self._curriculum.weights().items()})
                    if cohort.is_leader:
                        levanter.tracker.log(metrics, step=info.step)  # Levanter's x-axis: the update just taken
                    self.history.append({"step": self.step, "loss": float(info.loss),
                                         **{k: float(v) for k, v in metrics.items() if k in _HISTORY_KEYS}})
                    self.trained_groups.append(group_ids)
                    if self._on_step is not None and sample is not None:
                        trained = [(g.group.group_id, g.weight_step) for g in sample.groups]
                        self._on_step(self.step, {"loss": info.loss, "groups": trained, **metrics})
                if info is not None and last_ckpt != self._ckpt_dir(checkpointer, info):
                    last_ckpt = self._checkpoint(checkpointer, info, replay)
            finally:
                if replay is not None:
                    replay.stop()
                server.close()
                checkpointer.wait_until_finished()
                self.model = state.model
            levanter.tracker.current_tracker().finish()
            metrics = {**(replay.metrics() if replay is not None else {}), **self._checkpoint_metrics(skipped)}
            return TrainResult(first_step, self.step, last_ckpt, metrics, self.history, self.trained_groups,
                               resumed_from=self._resumed_from.path if self._resumed_from else None,
                               skipped_checkpoints=skipped,
                               process=program_audit.process_stats(rss_before_model, program_constants))

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

    def _trainable(self, model_init):
        """Levanter's `is_trainable`: with LoRA only the adapters (and only they are checkpointed: the
        base is rebuilt from `model` on resume), else everything."""
        if self.config.lora is None:
            return True
        return lora_rl.trainable_filter(eqx.filter_eval_shape(model_init))

    # ------------------------------------------------------------------ resume

    def _initial_state(self, trainer: Trainer, source: CheckpointWeights):
        """(state, replay buffer, skipped checkpoints): from the newest checkpoint whose model, optimizer,
        sidecar and curriculum state all load — all from that one checkpoint, or the rollout stream
        would not match the weights — else freshly initialized (docs/models.md, "Loading")."""
        cfg = self.config
        key = jax.random.PRNGKey(trainer.config.seed)

        def load(folder: StepFolder):
            sidecar = read_sidecar(folder.path)
            model_init = resume_model_init(source, cfg.lora)
            state = self._load_state(trainer, folder.path, key, model_init, self._trainable(model_init))
            if int(sidecar["step"]) != int(state.step):
                raise ValueError(f"{SIDECAR} is for step {sidecar['step']}, the saved state for step {int(state.step)}")
            replay = self._build_replay(int(state.step))
            if replay is not None:
                replay.load_state_dict(sidecar["replay"])
            if self._curriculum is not None and sidecar.get("curriculum"):
                self._curriculum.load(sidecar["curriculum"])
            self._parent = sidecar.get("trainer")
            return state, replay

        resumed = load_newest(trainer.checkpoint_path, load) if trainer.config.load_checkpoint is not False else None
        if resumed is not None:
            self._resumed_from = resumed.folder
            for line in resumed.skipped:
                print(f"[marinrl] skipped checkpoint {line}", flush=True)
            if resumed.skipped:
                print(f"[marinrl] resumed from the previous checkpoint {resumed.folder.path}", flush=True)
            return (*resumed.loaded, resumed.skipped)
        model_init = fresh_model_init(source, cfg.lora)
        # Levanter's rules: initialize_from, load_checkpoint
        state = trainer.initial_state(key, model_init=model_init, is_trainable=self._trainable(model_init))
        source.release()  # the state's model took the loaded buffers over (donated)
        if int(state.step) > 0:
            loaded_from = trainer.config.initialize_from or trainer.checkpoint_path
            raise RuntimeError(f"the checkpoint Levanter loaded from {loaded_from} (step {int(state.step)}) has no "
                               f"{SIDECAR}: cannot resume the rollout stream exactly")
        return state, self._build_replay(0), []

    @staticmethod
    def _load_state(trainer: Trainer, folder: str, key, model_init, trainable):
        """Levanter's `initial_state` from one given checkpoint folder (it otherwise loads only the latest).
        `load_checkpoint=True` makes a missing checkpoint an error instead of a silent fresh start."""
        base = trainer.config
        trainer.config = dataclasses.replace(base, load_checkpoint=True, load_checkpoint_path=folder)
        try:
            return trainer.initial_state(key, model_init=model_init, is_trainable=trainable)
        finally:
            trainer.config = base

    def _build_replay(self, start_step: int):
        """The replay buffer; None on processes other than 0 (process 0 reads and broadcasts)."""
        cfg = self.config
        if not multihost.current_cohort().is_leader:
            return None
        reader = RolloutReader(cfg.rollout_root, storage_options=cfg.storage_options)
        return ReplayBuffer(cfg.replay.for_loss(cfg.loss), reader, start_step=start_step, advantage=cfg.loss.advantage,
                            reward_fn=overlong_reward_fn(cfg.loss), max_tokens=cfg.batching.max_length,
                            policies=cfg.policies)

    def _checkpoint_metrics(self, skipped: list[str]) -> dict[str, float]:
        return {"checkpoint/skipped_on_resume": float(len(skipped)),
                "checkpoint/deleted": float(self._checkpoints_deleted)}

    # ------------------------------------------------------------------ checkpoints

    @staticmethod
    def _ckpt_dir(checkpointer, info) -> str:
        return f"{checkpointer.base_path}/step-{info.step}"

    def _checkpoint(self, checkpointer, info, replay) -> str:
        """Sidecar first, then Levanter's tensorstore save, whose metadata.json commits both; then
        retention. A folder of that name left by an older lineage (a checkpoint skipped on resume, a save
        that never finished) is deleted first: written over, its stale commit marker and files would
        make a half-written folder look complete."""
        folder = self._ckpt_dir(checkpointer, info)
        cohort = multihost.current_cohort()
        if cohort.is_leader:  # one author for the folder's reset and the sidecar; every process saves its shards
            fs, path = fsspec.core.url_to_fs(folder)
            if fs.exists(path):
                remove_folder(folder, "replaced by a new checkpoint of the same step")
            fs.makedirs(path, exist_ok=True)
            sidecar: dict[str, Any] = {"step": info.next_step, "replay": replay.state_dict(next_step=info.next_step),
                                       "trainer": self.trainer_id, "digest": True}
            if self._curriculum is not None:
                target = f"{folder}/curriculum.json"
                self._curriculum.save(target)
                sidecar["curriculum"] = target
            fs.pipe_file(f"{path}/{SIDECAR}", json.dumps(sidecar).encode())
        cohort.barrier(f"checkpoint-{info.step}")
        checkpointer.on_step(info, force=True)
        checkpointer.wait_until_finished()
        cohort.barrier(f"checkpoint-{info.step}-saved")  # every process's shards are in before they are summed
        if not cohort.is_leader:
            return folder
        write_digest(folder)
        logger.info("checkpoint at step %d: %s", info.next_step, folder)
        protect = [self._resumed_from.path] if self._resumed_from is not None else []
        deleted = apply_retention(checkpointer.base_path, keep=self.config.checkpoint_keep,
                                  keep_every=self.config.checkpoint_keep_every, protect=protect)
        self._checkpoints_deleted += len(deleted)
        return folder


def _resume_hint(checkpoint_root: str) -> str:
    """Which checkpoint a rerun resumes from, for the message of a trainer that loses a peer process."""
    from marinrl.train.checkpoints import newest_loadable

    newest = newest_loadable(checkpoint_root)
    if newest is None:
        return f"no intact checkpoint is committed under {checkpoint_root} yet: the rerun starts from weight step 0"
    return f"it resumes from {newest.path} (weight step {newest.step + 1})"
