"""What a TrainWorker is given: `TrainWorkerConfig` (the rollout files, weight stream, model, Levanter's
`TrainerConfig` and optimizer, loss, replay, batching, checkpoint cadence), derived from a job config by
`marinrl/job/plan.py` inside the trainer's actor. Levanter's objects are held here, never built: the
TrainWorker fills in the trainer's default (`levanter_configs.cpu_trainer_config`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from marinrl.config.batching import BatchingConfig
from marinrl.config.checks import require_at_least
from marinrl.config.lora import LoraRLConfig
from marinrl.config.loss import LossConfig
from marinrl.config.model import ModelConfig
from marinrl.config.replay import ReplayConfig
from marinrl.config.trainer import RLAdamConfig
from marinrl.config.transfer import FilesystemTransferConfig, WeightTransferConfig
from marinrl.types import DEFAULT_POLICY

if TYPE_CHECKING:
    from levanter.trainer import TrainerConfig


@dataclasses.dataclass(frozen=True)
class AdapterSlotConfig:
    """One adapter of a trainer that trains several on one base (`TrainWorkerConfig.adapters`): a `lora`
    policy model's own rollout files, weight stream and adapters (`train/adapter_slots.py`)."""

    name: str
    """The policy model's name: its metrics' prefix and its entry in each checkpoint's replay state."""
    rollout_root: str
    """Its rollout files (`<run_dir>/policies/<name>/rollouts` in a job)."""
    weights: WeightTransferConfig
    """Its weight stream: versions of its adapter alone."""
    policies: tuple[str, ...]
    """The policy names its rollouts carry."""
    lora: LoraRLConfig
    """Its adapters: every slot's rank, alpha and target_modules are the trainer's `lora`; the seed is its own."""


@dataclasses.dataclass
class TrainWorkerConfig:
    rollout_root: str = "runs/default/rollouts"
    """fsspec URL the rollout workers write to and the trainer reads from."""
    weights: WeightTransferConfig = dataclasses.field(
        default_factory=lambda: FilesystemTransferConfig(root="runs/default/weights"))
    """How new weights reach the rollout workers."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    trainer: Optional[TrainerConfig] = None
    """Levanter's trainer (None: `levanter_configs.cpu_trainer_config()`, one for a laptop CPU): mesh, batch size
    (`train_batch_size` rows = groups_per_step × samples per prompt), `num_train_steps`, microbatching
    (`per_device_parallelism`), checkpointer, tracker."""
    optimizer: Any = dataclasses.field(default_factory=RLAdamConfig)
    """Levanter's `OptimizerConfig` or the config layer's mirror of one (`config/trainer.py`). The default is
    the reference of docs/performance.md: AdamW, lr 1e-4 constant, betas (0.9, 0.999), no weight decay, clip 1.0."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    replay: ReplayConfig = dataclasses.field(default_factory=ReplayConfig)
    batching: BatchingConfig = dataclasses.field(default_factory=BatchingConfig)
    groups_per_step: int = 8
    """Prompts (whole groups) per optimizer step."""
    sync_interval: int = 1
    """Publish weights every this many optimizer steps (and always after the last one)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps; 0 saves only at the end (and on `stop()`)."""
    checkpoint_keep: int = 2
    """Keep this many newest checkpoints; older ones are deleted once a newer one is committed (the one
    this run resumed from is kept until the run ends). 2 leaves a fallback if the newest does not load."""
    checkpoint_keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none), e.g. for later evals."""
    storage_options: dict = dataclasses.field(default_factory=dict)
    """fsspec options for `rollout_root` (e.g. {"token": "anon"} for the GCS emulator)."""
    policies: tuple[str, ...] = (DEFAULT_POLICY,)
    """The policy names this trainer trains; a rollout of any other stops it at ingestion, naming the
    policy and the lesson (`marinrl/config/policies.py`)."""
    lora: Optional[LoraRLConfig] = None
    """Train LoRA adapters on the frozen `model` instead of every weight (`marinrl/models/lora.py`): only the
    adapters get gradients, optimizer state, checkpoints and weight versions. None: full fine-tuning."""
    publish_dtype: Optional[str] = None
    """The dtype weight versions carry: the rollout workers' (`RLJobConfig.rollout_dtype()`). Floating
    weights are cast to it once per publish on the trainer's devices (`transfer.base.cast_for_publish`);
    the master weights and optimizer state stay as trained. None: publish the weights as they are."""
    adapters: tuple[AdapterSlotConfig, ...] = ()
    """Several `lora` policy models trained over one copy of `model` (`train/adapter_slots.py`): each its own
    rollout files, replay buffer, weight stream and optimizer state, one trainer, one base, one batch per step.
    Empty (the default): one model, whose files and stream are `rollout_root` and `weights`. Set, `lora` is
    their shared shape and `rollout_root`, `weights` and `policies` are not read."""
    audit_root: Optional[str] = None
    """Where the trained-groups audit trail goes (`<run_dir>/trained` in a job): per step, the group ids
    trained, written before that step's checkpoint (`marinrl/train/audit.py`). None: no trail."""

    @property
    def trained_adapters(self):
        """What `initial_weights.fresh_model_init` adapts the model with: `lora`, each slot's (several), or None."""
        return tuple(a.lora for a in self.adapters) if self.adapters else self.lora

    def __post_init__(self):
        if self.lora is not None:
            self.lora.errors("lora")
        if self.adapters:
            if self.lora is None:
                raise ValueError("TrainWorkerConfig.adapters needs `lora`, the adapters' shared rank and targets")
            shape = lambda c: (c.rank, c.alpha, c.target_modules)  # noqa: E731
            for a in self.adapters:
                if shape(a.lora) != shape(self.lora):
                    raise ValueError(f"TrainWorkerConfig.adapters[{a.name}].lora {shape(a.lora)} differs from the "
                                     f"trainer's lora {shape(self.lora)} (rank, alpha, target_modules)")
        if self.publish_dtype is not None and self.publish_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"TrainWorkerConfig.publish_dtype must be float32, bfloat16 or float16 (or None), "
                             f"got {self.publish_dtype!r}")
        require_at_least(self, 1, "groups_per_step", "sync_interval", "checkpoint_keep")
        require_at_least(self, 0, "checkpoint_every", "checkpoint_keep_every")
        if self.sync_interval > 1 + self.replay.sampling.max_staleness:
            raise ValueError(
                f"TrainWorkerConfig.sync_interval={self.sync_interval} publishes weights less often than "
                f"max_staleness={self.replay.sampling.max_staleness} allows rollouts to lag: the trainer would starve")
