"""The job's Levanter knobs, `trainer:` and `optimizer:` of a job config, as plain dataclasses: mirrors of
Levanter's `TrainerConfig`, its trackers and its AdamW with the same field names and Levanter's defaults
except where marked, so a config parses and is checked without importing Levanter (seconds and hundreds
of MB). `levanter_configs.to_levanter` makes Levanter's objects when the trainer starts;
tests/test_layers.py checks every mirrored field against Levanter's class.

- `JobTrainerConfig` exposes the mesh, microbatching, mixed precision, profiler, tracker and compile
  cache knobs. The fields the job derives (`num_train_steps`, `train_batch_size`, `id`, `seed`,
  `log_dir`, the checkpointer) are not here: the job sets them (`levanter_configs.levanter_trainer`; the
  error for a config that sets one names the source, `config/job.DERIVED_FIELDS`).
- `RLAdamConfig` (`type: rl_adam`, what an `optimizer:` block without `type:` is) is Levanter's AdamW with
  marinrl's defaults: lr 1e-4 constant, no warmup, no weight decay, betas (0.9, 0.999), clip 1.0;
  `type: adam` is the same optimizer with Levanter's defaults. Python may pass any Levanter
  `OptimizerConfig` (Lion, Muon, …) as `optimizer`; it is used as it is.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Union

import draccus

from marinrl.config.errors import ConfigError

MP_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "float16": "float16", "full": "float32",
             "f32": "float32", "float32": "float32", "f64": "float64", "float64": "float64"}
"""jmp's dtype names (`half` is refused: it means bfloat16 on a TPU and float16 elsewhere)."""


def parse_mp(mp: str) -> dict[str, str]:
    """`{"params", "compute", "output"}` dtype names of a mixed-precision string as jmp reads it
    (`p=f32,c=bfloat16`: compute follows params and output follows compute unless named; `bf16` alone:
    all three). ValueError naming the part it cannot read."""
    def dtype(name: str) -> str:
        if name not in MP_DTYPES:
            raise ValueError(f"unknown dtype {name!r} in {mp!r}: use one of {', '.join(sorted(MP_DTYPES))}")
        return MP_DTYPES[name]

    if "=" not in mp:
        d = dtype(mp)
        return {"params": d, "compute": d, "output": d}
    got: dict[str, Optional[str]] = {"params": "float32", "compute": None, "output": None}
    named: set[str] = set()
    for part in mp.split(","):
        key, _, value = part.partition("=")
        full = {"p": "params", "c": "compute", "o": "output"}.get(key, key)
        if full not in got:
            raise ValueError(f"unknown key {key!r} in {mp!r}: use p/params, c/compute, o/output")
        if full in named:  # jmp would keep the last without a word
            raise ValueError(f"{full} is given twice in {mp!r}: give each of p/params, c/compute, o/output once")
        named.add(full)
        got[full] = dtype(value)
    got["compute"] = got["compute"] or got["params"]
    got["output"] = got["output"] or got["compute"]
    return got  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------ trackers


@dataclasses.dataclass(frozen=True)
class JobTrackerConfig(draccus.ChoiceRegistry):
    """Where the trainer's metrics go, by `type:` (Levanter's trackers). To add one: register a frozen
    dataclass below with Levanter's field names and defaults and `LEVANTER = "module:Class"` naming the config
    it becomes (`levanter_configs.to_levanter` builds it when the trainer starts), and add it to
    tests/test_layers.py's MIRRORS, which checks the fields against Levanter's class."""

    LEVANTER: ClassVar[str] = ""


@JobTrackerConfig.register_subclass("json_logger")
@dataclasses.dataclass(frozen=True)
class JsonLoggerTracker(JobTrackerConfig):
    """JSON lines through Python logging (read by `marinrl report`)."""

    LEVANTER: ClassVar[str] = "levanter.tracker.json_logger:JsonLoggerConfig"
    logger_name: str = "levanter.json_logger"
    level: int = 20


@JobTrackerConfig.register_subclass("tensorboard")
@dataclasses.dataclass(frozen=True)
class TensorboardTracker(JobTrackerConfig):
    """TensorBoard event files; left at `tblogs`, the job writes them to `<run_dir>/tensorboard/trainer`."""

    LEVANTER: ClassVar[str] = "levanter.tracker.tensorboard:TensorboardConfig"
    logdir: str = "tblogs"
    comment: Optional[str] = ""
    purge_step: Optional[int] = None
    max_queue: Optional[int] = 10
    flush_secs: Optional[int] = 120
    filename_suffix: Optional[str] = ""
    write_to_disk: Optional[bool] = True


@JobTrackerConfig.register_subclass("wandb")
@dataclasses.dataclass(frozen=True)
class WandbTracker(JobTrackerConfig):
    """Weights & Biases: online unless `mode: offline` or `WANDB_MODE` says otherwise."""

    LEVANTER: ClassVar[str] = "levanter.tracker.wandb:WandbConfig"
    entity: Optional[str] = None
    project: Optional[str] = "levanter"
    name: Optional[str] = None
    tags: list[str] = dataclasses.field(default_factory=list)
    id: Optional[str] = None
    group: Optional[str] = None
    mode: Optional[str] = None
    resume: Optional[Union[bool, str]] = "allow"
    save_code: Union[bool, str] = True
    save_xla_dumps: bool = False


@JobTrackerConfig.register_subclass("noop")
@dataclasses.dataclass(frozen=True)
class NoopTracker(JobTrackerConfig):
    """No metrics."""

    LEVANTER: ClassVar[str] = "levanter.tracker:NoopConfig"


# ------------------------------------------------------------------------------------------ trainer


@dataclasses.dataclass
class JobTrainerConfig:
    """Levanter's `TrainerConfig` knobs a job sets (Levanter's defaults unless marked): the mesh
    (`model_axis_size`, `replica_ici_axis_size`, `tensor_parallel_axes`, `fsdp_axis`, `axis_resources`),
    `per_device_parallelism` (gradient accumulation), `mp` (e.g. `p=f32,c=bfloat16`), `tracker`,
    `jax_compilation_cache_dir`, the profiler."""

    LEVANTER: ClassVar[str] = "levanter.trainer:TrainerConfig"

    mp: str = "f32"
    """Mixed precision as jmp reads it: `p=f32,c=bfloat16` keeps float32 masters and computes in bfloat16."""
    tracker: Union[JobTrackerConfig, tuple[JobTrackerConfig, ...]] = dataclasses.field(
        default_factory=lambda: (JsonLoggerTracker(), TensorboardTracker()))
    """marinrl: JSON (read by `marinrl report`) and TensorBoard under `<run_dir>/tensorboard/trainer`. Add
    `{type: wandb, project: …}` for Weights & Biases."""
    profiler: bool = False
    """Write a `jax.profiler` trace of steps `profiler_start_step` .. + `profiler_num_steps`."""
    profiler_start_step: int = 5
    profiler_num_steps: int = 100
    profiler_perfetto_link: bool = False
    log_jaxprs: bool = False
    """marinrl: off (Levanter: on)."""
    log_xla_hlo: bool = False
    """marinrl: off (Levanter: on)."""
    crash_on_nan: bool = True
    crash_on_inf: bool = True
    batch_axis: str = "batch"
    fsdp_axis: Optional[Union[str, list[str]]] = "embed"
    tensor_parallel_axes: Optional[list[str]] = None
    axis_resources: dict[str, Union[str, list[str]]] = dataclasses.field(default_factory=dict)
    parameter_axis_resources: dict[str, Union[str, list[str]]] = dataclasses.field(default_factory=dict)
    replica_ici_axis_size: int = 1
    model_axis_size: int = 1
    replica_dcn_axis_size: int = 1
    per_device_parallelism: Union[int, str] = -1
    """Rows per device per microbatch; -1: the whole batch at once (no gradient accumulation); `auto`: the largest
    microbatch whose update fits the trainer's device, chosen with `model.model.gradient_checkpointing`
    (docs/training.md, "Memory of the update")."""
    per_device_eval_parallelism: int = -1
    allow_nondivisible_batch_size: bool = False
    jax_config: dict[str, Union[str, int, float, bool, None]] = dataclasses.field(
        default_factory=lambda: {"jax_threefry_partitionable": True, "jax_softmax_custom_jvp": True})
    jax_compilation_cache_dir: Optional[str] = None
    require_accelerator: Optional[bool] = None
    """marinrl: None means required exactly when `ray.trainer` asks for GPUs or a TPU (a JAX that falls back
    to the CPU there fails instead of training slowly)."""


MARINRL_TRAINER_DEFAULTS = ("tracker", "log_jaxprs", "log_xla_hlo")
"""The fields whose defaults are marinrl's, not Levanter's (tests/test_layers.py checks the others)."""


# ------------------------------------------------------------------------------------------ optimizer


class JobOptimizerConfig(draccus.ChoiceRegistry):
    """`optimizer:` of a job config, by `type:`; without `type:`, `rl_adam`."""

    @classmethod
    def default_choice_name(cls) -> Optional[str]:
        return "rl_adam"


@JobOptimizerConfig.register_subclass("adam")
@dataclasses.dataclass(frozen=True)
class JobAdamConfig(JobOptimizerConfig):
    """Levanter's AdamW with Levanter's defaults."""

    LEVANTER: ClassVar[str] = "levanter.optim:AdamConfig"

    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    warmup: Union[int, float] = 0.01
    """Fraction of the steps (< 1) or number of steps of linear warmup."""
    decay: Optional[Union[int, float]] = None
    rewarmup: Union[int, float] = 0.0
    cooldown: Optional[float] = None
    cycle_length: Optional[Union[int, float]] = None
    cycles: Optional[int] = None
    lr_schedule: str = "cosine"
    """`constant`, `cosine`, `linear`, `inv_sqrt`, … (Levanter's schedules), after the warmup."""
    haps: Optional[list[int]] = None
    weight_decay_modules: Optional[Union[list[str], str]] = None
    default_weight_decay_mask: Optional[bool] = None
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    max_grad_norm: Optional[float] = 1.0
    nesterov: bool = False
    update_rms_clipping: Optional[float] = None
    adamc_weight_decay: bool = False


@JobOptimizerConfig.register_subclass("rl_adam")
@dataclasses.dataclass(frozen=True)
class RLAdamConfig(JobAdamConfig):
    """Levanter's AdamW (`type: adam`) with marinrl's defaults (the reference of docs/performance.md)."""

    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    warmup: Union[int, float] = 0.0
    lr_schedule: str = "constant"
    beta2: float = 0.999


# ------------------------------------------------------------------------------------------ checks


def check_trainer_ranges(trainer: JobTrainerConfig, batch_rows: int, batch_source: str,
                         devices: Optional[int], devices_source: str) -> None:
    """The mesh and microbatch knobs: ranges, and divisibility where the trainer's device count is known
    from its placement (`devices`, None on the CPU)."""
    try:
        parse_mp(trainer.mp)
    except ValueError as e:
        raise ConfigError("trainer.mp", str(e)) from None
    for name in ("model_axis_size", "replica_ici_axis_size", "replica_dcn_axis_size"):
        if getattr(trainer, name) < 1:
            raise ConfigError(f"trainer.{name}", f"must be >= 1, got {getattr(trainer, name)}")
    for name in ("per_device_parallelism", "per_device_eval_parallelism"):
        value = getattr(trainer, name)
        if name == "per_device_parallelism" and value == "auto":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or (value != -1 and value < 1):
            auto = ", auto" if name == "per_device_parallelism" else ""
            raise ConfigError(f"trainer.{name}", f"must be -1 (the whole batch at once){auto} or >= 1, got {value!r}")
    pdp = trainer.per_device_parallelism if trainer.per_device_parallelism != "auto" else -1
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


LR_SCHEDULES = ("constant", "cosine", "inv", "inv_sqrt", "linear", "power")
"""Levanter's `lr_schedule` names (tests/test_layers.py checks them against its registry)."""


def check_optimizer_ranges(optimizer) -> None:
    """The learning rate, the common knobs' ranges and, for marinrl's AdamW, what Levanter's schedule
    builder refuses (an unknown schedule, two ways to set cycles, a fraction past 1), so no optimizer needs
    building to check a config; `preflight` builds a Levanter optimizer passed from Python once."""
    import math

    if isinstance(optimizer, JobAdamConfig):
        if optimizer.lr_schedule not in LR_SCHEDULES:
            raise ConfigError("optimizer.lr_schedule", f"unknown schedule {optimizer.lr_schedule!r}: use one of "
                                                       f"{', '.join(LR_SCHEDULES)}")
        if optimizer.cycle_length is not None and (optimizer.cycles is not None or optimizer.haps is not None):
            raise ConfigError("optimizer.cycle_length", "set cycle_length, cycles or haps, not two of them")
        for name in ("warmup", "decay", "rewarmup", "cooldown"):
            value = getattr(optimizer, name)
            if isinstance(value, float) and not value.is_integer() and not 0 <= value <= 1:
                raise ConfigError(f"optimizer.{name}", f"{value} is neither a fraction of the steps in [0, 1] nor a "
                                                       "whole number of steps")

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
