"""What a TrainWorker is given: `TrainWorkerConfig` (the rollout files, weight stream, model, Levanter's
`TrainerConfig` and optimizer, loss, replay, batching, checkpoint cadence), derived from a job config by
`marinrl/job_plan.py` inside the trainer's actor, and `cpu_trainer_config` for a trainer on a laptop CPU."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from levanter.optim import OptimizerConfig
from levanter.tracker.json_logger import JsonLoggerConfig
from levanter.trainer import TrainerConfig

from marinrl.config_checks import require_at_least
from marinrl.levanter_configs import to_levanter
from marinrl.lora_config import LoraRLConfig
from marinrl.model_config import ModelConfig
from marinrl.train.batching_config import BatchingConfig
from marinrl.train.loss_config import LossConfig
from marinrl.train.replay_config import ReplayConfig
from marinrl.train.trainer_config import RLAdamConfig
from marinrl.transfer.transfer_config import FilesystemTransferConfig, WeightTransferConfig
from marinrl.types import DEFAULT_POLICY


def cpu_trainer_config(**overrides) -> TrainerConfig:
    """A `TrainerConfig` that works on a laptop CPU: no accelerator required, no Ray of its own,
    offline JSON tracking, no second compile for watch hooks."""
    from levanter.distributed import RayConfig
    from levanter.callbacks.watch import WatchConfig
    import pathlib

    defaults: dict[str, Any] = dict(
        require_accelerator=False,
        ray=RayConfig(auto_start_cluster=False),
        tracker=JsonLoggerConfig(),
        watch=WatchConfig(watch_targets=[]),
        log_dir=pathlib.Path("logs"),
        log_jaxprs=False,
        log_xla_hlo=False,
        num_train_steps=100,
        train_batch_size=64,
    )
    defaults.update(overrides)
    return TrainerConfig(**defaults)


def _default_optimizer() -> OptimizerConfig:
    # BENCHMARK.md's reference: AdamW, lr 1e-4 constant, betas (0.9, 0.999), no weight decay, clip 1.0.
    return to_levanter(RLAdamConfig())


@dataclasses.dataclass
class TrainWorkerConfig:
    rollout_root: str = "runs/default/rollouts"
    """fsspec URL the rollout workers write to and the trainer reads from."""
    weights: WeightTransferConfig = dataclasses.field(
        default_factory=lambda: FilesystemTransferConfig(root="runs/default/weights"))
    """How new weights reach the rollout workers."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=cpu_trainer_config)
    """Levanter's trainer: mesh, batch size (`train_batch_size` rows = groups_per_step × samples
    per prompt), `num_train_steps`, microbatching (`per_device_parallelism`), checkpointer, tracker."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=_default_optimizer)
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
    policy and the lesson (`marinrl/policies.py`)."""
    lora: Optional[LoraRLConfig] = None
    """Train LoRA adapters on the frozen `model` instead of every weight (`marinrl/lora.py`): only the
    adapters get gradients, optimizer state, checkpoints and weight versions. None: full fine-tuning."""
    publish_dtype: Optional[str] = None
    """The dtype weight versions carry: the rollout workers' (`RLJobConfig.rollout_dtype()`). Floating
    weights are cast to it once per publish on the trainer's devices (`transfer.base.cast_for_publish`);
    the master weights and optimizer state stay as trained. None: publish the weights as they are."""
    audit_root: Optional[str] = None
    """Where the trained-groups audit trail goes (`<run_dir>/trained` in a job): per step, the group ids
    trained, written before that step's checkpoint (`marinrl/train/audit.py`). None: no trail."""

    def __post_init__(self):
        if self.lora is not None:
            self.lora.errors("lora")
        if self.publish_dtype is not None and self.publish_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"TrainWorkerConfig.publish_dtype must be float32, bfloat16 or float16 (or None), "
                             f"got {self.publish_dtype!r}")
        require_at_least(self, 1, "groups_per_step", "sync_interval", "checkpoint_keep")
        require_at_least(self, 0, "checkpoint_every", "checkpoint_keep_every")
        if self.sync_interval > 1 + self.replay.sampling.max_staleness:
            raise ValueError(
                f"TrainWorkerConfig.sync_interval={self.sync_interval} publishes weights less often than "
                f"max_staleness={self.replay.sampling.max_staleness} allows rollouts to lag: the trainer would starve")
