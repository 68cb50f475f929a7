"""The job's Levanter knobs: `RLJobConfig.trainer` is Levanter's `TrainerConfig` and
`RLJobConfig.optimizer` its `OptimizerConfig`, with marinrl's defaults and one place per knob.

draccus builds a nested config that a YAML file or a flag touches from its *class* defaults (a
field's `default_factory` is then ignored), so the defaults live on classes:

- `JobTrainerConfig` is `TrainerConfig` with the CPU defaults of `cpu_trainer_config` (no accelerator
  required unless the trainer's placement asks for one, JSON + TensorBoard trackers, no Ray of
  Levanter's own, no jaxpr/HLO logging, no watch hooks) and the fields the job derives left empty:
  `num_train_steps`, `train_batch_size`, `id`, `seed`, `log_dir`, the checkpointer's path. The job
  fills them; a value a user sets that disagrees is refused naming both fields.
- `RLAdamConfig` (`type: rl_adam`, what an `optimizer:` block without `type:` is) is Levanter's AdamW
  with marinrl's defaults: lr 1e-4 constant, no warmup, no weight decay, betas (0.9, 0.999), clip 1.0.
  Any Levanter optimizer works by its `type:` (`adam`, `lion`, …) with Levanter's own defaults.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional, Tuple, Union

import draccus
from levanter.callbacks.watch import WatchConfig
from levanter.checkpoint import CheckpointerConfig
from levanter.distributed import RayConfig
from levanter.optim import AdamConfig, OptimizerConfig
from levanter.optim.config import LrSchedule
from levanter.tracker import TrackerConfig
from levanter.tracker.json_logger import JsonLoggerConfig
from levanter.tracker.tensorboard import TensorboardConfig
from levanter.trainer import TrainerConfig

from marinrl.config_errors import ConfigError

_LEVANTER_CHECKPOINTER = CheckpointerConfig()
_LEVANTER_TENSORBOARD_LOGDIR = TensorboardConfig().logdir


@dataclasses.dataclass
class JobTrainerConfig(TrainerConfig):
    """Levanter's `TrainerConfig` with marinrl's CPU defaults; the fields the job derives are None
    (filled by `derive_trainer_config`). Every other Levanter knob works as in Levanter: the mesh
    (`model_axis_size`, `replica_ici_axis_size`, `tensor_parallel_axes`, `fsdp_axis`, `axis_resources`),
    `per_device_parallelism` (gradient accumulation), `mp` (e.g. `p=f32,c=bf16`), `tracker`,
    `jax_compilation_cache_dir`, `checkpointer` (its path is the job's)."""

    seed: Optional[int] = None  # type: ignore[assignment]
    """Derived: the job's `seed`."""
    log_dir: Optional[pathlib.Path] = None  # type: ignore[assignment]
    """Derived: `<run_dir>/logs`."""
    tracker: Union[TrackerConfig, Tuple[TrackerConfig, ...]] = dataclasses.field(
        default_factory=lambda: (JsonLoggerConfig(), TensorboardConfig()))
    """JSON (read by `marinrl report`) and TensorBoard under `<run_dir>/tensorboard/trainer` (a
    TensorBoard tracker left at Levanter's default logdir gets that one). Add `{type: wandb, project: …}`
    for Weights & Biases: online unless `mode: offline` or `WANDB_MODE` says otherwise."""
    watch: WatchConfig = dataclasses.field(default_factory=lambda: WatchConfig(watch_targets=[]))
    """No watch hooks: they compile a second train step."""
    log_jaxprs: bool = False
    log_xla_hlo: bool = False
    train_batch_size: Optional[int] = None  # type: ignore[assignment]
    """Derived: `groups_per_step × n_generations` rows (the batch is whole groups)."""
    num_train_steps: Optional[int] = None  # type: ignore[assignment]
    """Derived: the job's `num_train_steps`."""
    ray: RayConfig = dataclasses.field(default_factory=lambda: RayConfig(auto_start_cluster=False))
    """marinrl owns Ray: Levanter starts none of its own."""
    require_accelerator: Optional[bool] = None
    """None: required exactly when `ray.trainer` asks for GPUs or a TPU (a JAX that falls back to the CPU
    there fails instead of training slowly)."""


@OptimizerConfig.register_subclass("rl_adam")
@dataclasses.dataclass(frozen=True)
class RLAdamConfig(AdamConfig):
    """Levanter's AdamW (`type: adam`) with marinrl's defaults (BENCHMARK.md's reference)."""

    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    warmup: Union[int, float] = 0.0
    """Fraction of the steps (< 1) or number of steps of linear warmup."""
    lr_schedule: Union[LrSchedule, str] = "constant"
    """`constant`, `cosine`, `linear`, `inv_sqrt`, … (Levanter's schedules), after the warmup."""
    beta2: float = 0.999


class JobOptimizerConfig(OptimizerConfig, draccus.ChoiceRegistry):
    """The declared type of `RLJobConfig.optimizer`: any registered Levanter optimizer by `type:`;
    without `type:`, `rl_adam`. (draccus treats a class as a choice type only when `ChoiceRegistry` is
    among its direct bases; the registry itself is OptimizerConfig's.)"""

    @classmethod
    def default_choice_name(cls) -> Optional[str]:
        return "rl_adam"


@dataclasses.dataclass(frozen=True)
class DerivedTrainerFields:
    """What the job sets in the TrainerConfig, and the job fields they come from."""

    num_train_steps: int
    train_batch_size: int
    batch_source: str
    """How `train_batch_size` is derived, for the error message."""
    run_id: str
    seed: int
    run_dir: str
    require_accelerator: bool


def derive_trainer_config(trainer: TrainerConfig, d: DerivedTrainerFields) -> TrainerConfig:
    """`trainer` with the job's fields filled in. A field the user set to another value than the job's
    raises ConfigError naming both; Levanter's own defaults count as unset."""

    def agree(field: str, value, derived, source: str, shown: str):
        if value is not None and value != derived:
            raise ConfigError(f"trainer.{field}", f"{value!r} disagrees with RLJobConfig.{shown}: the job sets "
                                                  f"trainer.{field} from {source}; set only {source} (or both to the "
                                                  "same value)")

    agree("num_train_steps", trainer.num_train_steps, d.num_train_steps, "num_train_steps",
          f"num_train_steps={d.num_train_steps}")
    agree("train_batch_size", trainer.train_batch_size, d.train_batch_size, "groups_per_step and n_generations",
          d.batch_source)
    agree("id", trainer.id, d.run_id, "run_id", f"run_id={d.run_id!r}")
    agree("seed", trainer.seed, d.seed, "seed", f"seed={d.seed}")
    log_dir = pathlib.Path(d.run_dir) / "logs"
    agree("log_dir", None if trainer.log_dir is None else str(pathlib.Path(trainer.log_dir)), str(log_dir),
          "run_root and run_id",
          f"run_root/run_id (logs go to {log_dir})")
    checkpoints = f"{d.run_dir}/checkpoints"
    cp = trainer.checkpointer
    agree("checkpointer.base_path",
          None if cp.base_path == _LEVANTER_CHECKPOINTER.base_path else str(cp.base_path).rstrip("/"), checkpoints,
          "run_root and run_id", f"run_root/run_id (checkpoints go to {checkpoints})")
    if cp.keep != _LEVANTER_CHECKPOINTER.keep or cp.save_interval != _LEVANTER_CHECKPOINTER.save_interval:
        raise ConfigError("trainer.checkpointer", "the job decides when to checkpoint (RLJobConfig.checkpoint_every) "
                                                  "and what to keep (checkpoint_keep, checkpoint_keep_every); "
                                                  "trainer.checkpointer.keep and save_interval would not be used")
    trackers = trainer.tracker if isinstance(trainer.tracker, (tuple, list)) else (trainer.tracker,)
    trackers = tuple(dataclasses.replace(t, logdir=f"{d.run_dir}/tensorboard/trainer")
                     if isinstance(t, TensorboardConfig) and t.logdir == _LEVANTER_TENSORBOARD_LOGDIR else t
                     for t in trackers)
    return dataclasses.replace(
        trainer, num_train_steps=d.num_train_steps, train_batch_size=d.train_batch_size, id=d.run_id, seed=d.seed,
        log_dir=log_dir, tracker=trackers if len(trackers) != 1 else trackers[0],
        checkpointer=dataclasses.replace(cp, base_path=checkpoints, append_run_id_to_base_path=False),
        require_accelerator=(d.require_accelerator if trainer.require_accelerator is None
                             else trainer.require_accelerator))


def check_trainer_ranges(trainer: TrainerConfig, batch_rows: int, batch_source: str,
                         devices: Optional[int], devices_source: str) -> None:
    """The mesh and microbatch knobs: ranges, and divisibility where the trainer's device count is known
    from its placement (`devices`, None on the CPU)."""
    for name in ("model_axis_size", "replica_ici_axis_size", "replica_dcn_axis_size"):
        if getattr(trainer, name) < 1:
            raise ConfigError(f"trainer.{name}", f"must be >= 1, got {getattr(trainer, name)}")
    for name in ("per_device_parallelism", "per_device_eval_parallelism"):
        value = getattr(trainer, name)
        if value != -1 and value < 1:
            raise ConfigError(f"trainer.{name}", f"must be -1 (the whole batch at once) or >= 1, got {value}")
    pdp = trainer.per_device_parallelism
    if pdp > 0 and batch_rows % pdp:
        raise ConfigError("trainer.per_device_parallelism", f"{pdp} rows per device do not divide the batch of "
                                                            f"{batch_source}")
    if devices is None:
        return
    per_slice = trainer.model_axis_size * trainer.replica_ici_axis_size
    if devices % per_slice:
        raise ConfigError("trainer.model_axis_size", f"model_axis_size={trainer.model_axis_size} × "
                                                     f"replica_ici_axis_size={trainer.replica_ici_axis_size} does not "
                                                     f"divide the trainer's {devices} devices ({devices_source})")
    data = devices // trainer.model_axis_size
    if batch_rows % data and not trainer.allow_nondivisible_batch_size:
        raise ConfigError("groups_per_step", f"the batch of {batch_source} does not divide among the trainer's "
                                             f"{data} data-parallel devices ({devices_source}, model_axis_size="
                                             f"{trainer.model_axis_size})")
    if pdp > 0 and batch_rows % (pdp * data):
        raise ConfigError("trainer.per_device_parallelism",
                          f"microbatches of {pdp} rows × {data} data-parallel devices do not divide the batch of "
                          f"{batch_source}")


def check_optimizer_ranges(optimizer: OptimizerConfig) -> None:
    """The learning rate and the common knobs' ranges; `preflight` then builds the optimizer once."""
    import math

    lr = optimizer.learning_rate
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ConfigError("optimizer.learning_rate", f"must be finite and > 0, got {lr} (a negative rate trains by "
                                                     "gradient ascent)")
    if not optimizer.weight_decay >= 0:
        raise ConfigError("optimizer.weight_decay", f"must be >= 0, got {optimizer.weight_decay}")
    if not 0 <= optimizer.min_lr_ratio <= 1:
        raise ConfigError("optimizer.min_lr_ratio", f"must be in [0, 1], got {optimizer.min_lr_ratio}")
    if not optimizer.warmup >= 0:
        raise ConfigError("optimizer.warmup", f"must be >= 0 (a fraction of the steps or a number of steps), got "
                                              f"{optimizer.warmup}")
    if optimizer.decay is not None and not optimizer.decay >= 0:
        raise ConfigError("optimizer.decay", f"must be >= 0 or null, got {optimizer.decay}")
    clip = getattr(optimizer, "max_grad_norm", None)
    if clip is not None and not clip > 0:
        raise ConfigError("optimizer.max_grad_norm", f"must be > 0 or null (no clipping), got {clip}")
    for name in ("beta1", "beta2"):
        beta = getattr(optimizer, name, None)
        if beta is not None and not 0 <= beta < 1:
            raise ConfigError(f"optimizer.{name}", f"must be in [0, 1), got {beta}")
