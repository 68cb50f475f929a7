"""RLJobConfig: the one config a job runs from and its range checks (`validate`). `marinrl/job/plan.py` builds
each role's parts from it, `marinrl/job/preflight.py` checks what needs files, `marinrl/job/rl_job.py` runs it
on Ray."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, ClassVar, Mapping, Optional

from marinrl.config.batching import BatchingConfig
from marinrl.config.curriculum import CurriculumConfig
from marinrl.config.errors import ConfigError
from marinrl.config.inflight import InflightConfig
from marinrl.config.lora import LoraRLConfig
from marinrl.config.loss import LossConfig
from marinrl.config.model import ModelConfig
from marinrl.config.placement import PlacementConfig
from marinrl.config.policies import PolicyConfig, check_policies
from marinrl.config.replay import OffPolicyConfig, OnPolicyConfig, ReplayConfig, ReplaySamplingConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.config.trainer import (
    JobOptimizerConfig,
    JobTrainerConfig,
    RLAdamConfig,
    check_optimizer_ranges,
    check_trainer_ranges,
    parse_mp,
)
from marinrl.config.trainer_group import TrainerGroupConfig
from marinrl.config.transfer import WeightTransferConfig

logger = logging.getLogger(__name__)


UPPER_BOUNDS = {
    "num_train_steps": (10**9, "the trainer counts steps in a 32-bit integer, and a billion updates cannot be meant"),
    "groups_per_step": (10**6, "each step's batch holds groups_per_step × n_generations rows; a million prompts "
                               "per update cannot be meant"),
    "n_generations": (10**4, "samples per prompt, all in one group of one step's batch"),
}
"""Counts a job cannot mean past these (field -> (most, why)): found before Ray starts, not as a trainer's
TypeError or an allocation that never ends."""


@dataclasses.dataclass(frozen=True)
class DerivedField:
    """A field the job sets itself, from fields of its own: one row of `DERIVED_FIELDS`."""

    source: str
    """What the job derives it from: the fields to set instead."""
    problem: str = ""
    """The one-line refusal; empty: `the job sets <field> from <source>; set that instead`."""

    def refusal(self, field: str) -> str:
        return self.problem or f"the job sets {field} from {self.source}; set that instead"


DERIVED_FIELDS: Mapping[str, DerivedField] = {
    # Levanter's trainer fields: not fields of `trainer:` (JobTrainerConfig), refused as unknown when read.
    "trainer.num_train_steps": DerivedField("num_train_steps"),
    "trainer.train_batch_size": DerivedField("groups_per_step × n_generations"),
    "trainer.id": DerivedField("run_id"),
    "trainer.seed": DerivedField("seed"),
    "trainer.log_dir": DerivedField("run_root and run_id (<run_dir>/logs)"),
    "trainer.checkpointer": DerivedField("run_root, run_id, checkpoint_every, checkpoint_keep and "
                                         "checkpoint_keep_every"),
    "trainer.ray": DerivedField("ray (the job owns Ray)"),
    "trainer.watch": DerivedField("nothing: no watch hooks (they compile a second train step)"),
    # Fields of configs the job embeds (a TrainWorkerConfig's or `marinrl serve`'s own there): refused by
    # `validate` when set to anything but their default.
    "replay.sampling": DerivedField(
        "max_staleness and max_uses",
        "a job's sampling strategy follows from max_staleness and max_uses (on_policy: max_staleness 0; replay: "
        "max_uses > 1; else off_policy with staleness max_staleness), which the rollout workers pace by too: set "
        "those, not replay.sampling"),
    "replay.seed": DerivedField("seed", "a job's replay buffer draws with the job's `seed`: set seed, not replay.seed"),
    "inference.lm_head_float32": DerivedField(
        "model.lm_head_float32",
        "a job's sampler head follows model.lm_head_float32, which sets the trainer's head too (one side alone "
        "widens the sampler/trainer mismatch): set model.lm_head_float32, not inference.lm_head_float32"),
}
"""Every field path (from the job config) the job derives -> what from and the refusal. `validate` refuses a
row's field set to anything but its default; a row that is no field of the job's configs (Levanter's trainer
fields) is refused when the config is read (config/errors.py names the row's source)."""


def _field_default(cls: type, name: str) -> Any:
    (field,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def check_derived_fields(job: RLJobConfig) -> None:
    """Refuses, naming it, the first field of `DERIVED_FIELDS` that a job config sets: the job would replace it."""
    for path, derived in DERIVED_FIELDS.items():
        *parents, name = path.split(".")
        owner = functools.reduce(getattr, parents, job)
        if not (dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}):
            continue  # refused when read
        if getattr(owner, name) != _field_default(type(owner), name):
            raise ConfigError(path, derived.refusal(path))


@dataclasses.dataclass
class RayJobConfig:
    address: Optional[str] = None
    """None: start a local Ray for this job (and stop it after). Else an existing cluster ("auto", ray://…)."""
    num_cpus: Optional[int] = None
    """Logical CPUs of the local Ray; None: what the trainer and the rollout workers ask for, plus one."""
    trainer: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    """What the trainer needs of each of its hosts: `num_cpus`, `num_gpus`, `tpu` (a slice type; a
    multi-host slice makes a trainer of one process per host) or `tpu_chips` (part of one host),
    `memory_fraction`, `accelerator_type`, custom `resources`, `num_hosts` (marinrl/config/placement.py,
    docs/scaling.md, docs/multihost.md)."""
    rollout: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    """What each rollout worker needs of its node (the same fields)."""
    placement_timeout_s: float = 600.0
    """On a cluster (`address` set): how long to wait for the autoscaler to add nodes that hold the
    trainer and the rollout workers before failing. A local Ray is checked at once."""
    max_rollout_restarts: int = 5
    stop_timeout_s: float = 120.0
    """On Ctrl-C, how long the trainer may take to finish its step and save a checkpoint."""


@dataclasses.dataclass
class RLJobConfig:
    DERIVED_FIELDS: ClassVar[Mapping[str, DerivedField]] = DERIVED_FIELDS
    """The fields the job sets itself (config/errors.py reads them here, for any config class that has them)."""

    run_id: str = "run"
    run_root: str = "runs"
    """Everything the job writes goes to `<run_root>/<run_id>/` (an fsspec URL or a local path)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    lora: Optional[LoraRLConfig] = None
    """Train LoRA adapters (`rank`, `alpha`, `target_modules`) on the frozen `model` instead of every
    weight: only the adapters are trained, checkpointed and sent to the rollout workers, which merge them
    into the base they loaded (docs/policies.md). None: full fine-tuning."""
    policies: dict[str, PolicyConfig] = dataclasses.field(default_factory=dict)
    """Policy name -> `specialization` (`shared` | `lora` | `full`) and optionally its own `model`,
    `optimizer`, `loss`, `lora` (docs/policies.md). Empty: one shared policy named `policy`. Rollouts of
    a policy not listed are refused. Each `lora` or `full` policy next to others gets its own trainer,
    weight stream and rollout files under `<run_dir>/policies/<name>/`."""
    curriculum: Optional[CurriculumConfig] = None
    """The lessons (environments, sampling, dependencies) and how they are scheduled."""
    num_train_steps: int = 100
    groups_per_step: int = 8
    """Prompts per optimizer step."""
    n_generations: int = 8
    """Samples per prompt (the group size)."""
    max_staleness: int = 1
    """0: exact on-policy. k ≥ 1: rollouts up to k weight versions old are trained on."""
    max_uses: int = 1
    """> 1: each rollout may be trained on up to this many times (replay)."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optimizer: JobOptimizerConfig = dataclasses.field(default_factory=RLAdamConfig)
    """Levanter's `OptimizerConfig`: without `type:`, AdamW with lr 1e-4 constant, no warmup, no weight
    decay, betas (0.9, 0.999), clip 1.0 (`rl_adam`); any Levanter optimizer by `type:` (`adam`, `lion`, …)
    with its own defaults. Schedule: `lr_schedule`, `warmup`, `decay`, `min_lr_ratio`."""
    trainer: JobTrainerConfig = dataclasses.field(default_factory=JobTrainerConfig)
    """Levanter's `TrainerConfig`: mesh (`model_axis_size`, `tensor_parallel_axes`, …),
    `per_device_parallelism`, `mp`, `tracker`, `jax_compilation_cache_dir`. The job fills
    `num_train_steps`, `train_batch_size`, `id`, `seed`, `log_dir` and the checkpoint path (`DERIVED_FIELDS`)."""
    sync_interval: int = 1
    """Publish weights to the rollout workers every this many optimizer steps (at most max_staleness + 1)."""
    n_rollout_workers: int = 1
    eval_every: int = 10
    """Full evaluation every this many weight steps (and at the start and the end)."""
    eval_examples: int = 32
    micro_eval_every: int = 0
    """A small eval (`micro_eval_examples` prompts per lesson) every this many batches a rollout worker
    writes; 0: none."""
    micro_eval_examples: int = 8
    warm_up_sampler: bool = True
    """Rollout workers compile their sampler for the first eval and the first batch while the trainer
    initializes (each lesson's environment runs once per kind of call against a dry run that generates
    nothing). False: for environments with side effects per call; the first eval and batch then compile
    after weight step 0 arrives."""
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
    """Checkpoints kept: the newest this many (older ones are deleted once a newer one is committed)."""
    checkpoint_keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this; 0: none."""
    inference: InferenceServerConfig = dataclasses.field(default_factory=InferenceServerConfig)
    inflight: InflightConfig = dataclasses.field(default_factory=InflightConfig)
    """In-flight weight updates: rollout workers take newer weights while a batch is generated
    (`enabled`, `swap_every_tokens`, `kv: keep | recompute`; docs/weight_transfer.md). Off by default."""
    weights: Optional[WeightTransferConfig] = None
    """None: files under the run directory."""
    replay: ReplayConfig = dataclasses.field(default_factory=ReplayConfig)
    """Filters, capacity, env weights. Its `sampling` and `seed` are the job's: derived from `max_staleness`,
    `max_uses` and `seed`, so a job config that sets either here is refused (`DERIVED_FIELDS`)."""
    batching: BatchingConfig = dataclasses.field(default_factory=lambda: BatchingConfig(max_length=256, min_bucket=32))
    ray: RayJobConfig = dataclasses.field(default_factory=RayJobConfig)
    trainer_group: TrainerGroupConfig = dataclasses.field(default_factory=TrainerGroupConfig)
    """A trainer over several hosts (`ray.trainer.num_hosts` > 1 or a multi-host `tpu`): placement strategy,
    JAX's timeouts, fake CPU devices for tests (docs/multihost.md). Unused by a one-host trainer."""
    seed: int = 0
    max_consecutive_env_failures: int = 5
    """A lesson whose environment fails this many calls in a row (raises, fails to construct, or yields
    no usable group) stops the job with an error naming the lesson, the environment and its last error."""

    @property
    def run_dir(self) -> str:
        return f"{self.run_root.rstrip('/')}/{self.run_id}"

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field: every range, without touching a file (the
        environments, model and run directory are checked by `marinrl.job.preflight.check_job`)."""
        def bad(field: str, problem: str):
            raise ConfigError(field, problem)

        for name in ("num_train_steps", "groups_per_step", "n_generations", "n_rollout_workers", "eval_examples",
                     "max_uses", "max_consecutive_env_failures", "checkpoint_keep", "sync_interval",
                     "micro_eval_examples"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("max_staleness", "eval_every", "checkpoint_every", "checkpoint_keep_every", "seed",
                     "micro_eval_every"):
            if getattr(self, name) < 0:
                bad(name, f"must be >= 0, got {getattr(self, name)}")
        for name, (most, why) in UPPER_BOUNDS.items():
            if getattr(self, name) > most:
                bad(name, f"must be <= {most:_}, got {getattr(self, name):_}: {why}")
        if self.sync_interval > 1 + self.max_staleness:
            bad("sync_interval", f"weights published every {self.sync_interval} steps leave the trainer without "
                                 f"rollouts it may use: with max_staleness={self.max_staleness} they must be at most "
                                 f"{self.max_staleness + 1} steps apart")
        check_derived_fields(self)
        check_optimizer_ranges(self.optimizer)
        check_policies(self)
        if self.lora is not None:  # its target modules are checked against the architecture in preflight
            self.lora.errors("lora")
        if self.n_generations < 2:  # every advantage kind is relative to the prompt's group
            bad("n_generations", f"{self.n_generations} sample per prompt with loss.advantage="
                                 f"{self.loss.advantage!r} makes every advantage 0 (each sample is compared with "
                                 "the others of its group): nothing would be learned; use n_generations >= 2")
        if self.ray.num_cpus is not None and self.ray.num_cpus < 1:
            bad("ray.num_cpus", f"must be >= 1 or null, got {self.ray.num_cpus}")
        for role in ("trainer", "rollout"):
            getattr(self.ray, role).errors(f"ray.{role}")
        rollout = self.ray.rollout
        if rollout.hosts() > 1:
            bad(f"ray.rollout.{rollout.hosts_field}",
                f"{rollout.hosts_setting!r} spans {rollout.hosts()} hosts, but a rollout worker is one "
                "process on one host: use a single-host slice and n_rollout_workers for more")
        if self.ray.trainer.hosts() > 1:
            self._check_multihost()
        if not self.ray.placement_timeout_s >= 0:
            bad("ray.placement_timeout_s", f"must be >= 0, got {self.ray.placement_timeout_s}")
        if self.ray.max_rollout_restarts < 0:
            bad("ray.max_rollout_restarts", f"must be >= 0, got {self.ray.max_rollout_restarts}")
        if not self.ray.stop_timeout_s > 0:
            bad("ray.stop_timeout_s", f"must be > 0, got {self.ray.stop_timeout_s}")
        if self.groups_per_step % self.n_rollout_workers:
            bad("groups_per_step", f"{self.groups_per_step} prompts per step do not divide among "
                                   f"n_rollout_workers={self.n_rollout_workers}")
        if self.curriculum is None:
            bad("curriculum", "the job needs a curriculum with at least one lesson")
        for lesson in self.curriculum.lessons:  # ids, dependencies and cycles are checked by CurriculumConfig
            if not lesson.temperature > 0:
                bad(f"curriculum.lessons[{lesson.lesson_id}].temperature",
                    "training needs a temperature > 0 (greedy has no logprobs to learn from), "
                    f"got {lesson.temperature}")
            if lesson.max_tokens >= self.batching.max_length:
                bad(f"curriculum.lessons[{lesson.lesson_id}].max_tokens",
                    f"{lesson.max_tokens} new tokens do not fit a training row of batching.max_length="
                    f"{self.batching.max_length} (prompt + response)")
        if self.inflight.enabled and self.max_staleness == 0:
            bad("inflight.enabled", "on-policy (max_staleness 0) never mixes weight versions inside a rollout: "
                                    "turn inflight off, or allow max_staleness >= 1")
        if self.inflight.enabled and self.inference.backend != "scan":
            bad("inflight.enabled", f"needs inference.backend: scan, got {self.inference.backend!r} (the engine "
                                    "backend has no chunk boundaries to swap weights at)")
        if self.max_uses > 1 and self.max_staleness < 1:
            bad("max_uses", "replaying rollouts needs max_staleness >= 1 (a reused rollout is older than the weights)")
        devices = self.ray.trainer.devices()
        if devices is None and self.ray.trainer.hosts() > 1 and self.trainer_group.cpu_devices:
            devices = self.trainer_group.cpu_devices
        devices = devices * self.ray.trainer.hosts() if devices is not None else None
        check_trainer_ranges(self.trainer, self.groups_per_step * self.n_generations, self._batch_source(), devices,
                             f"ray.trainer.{self.ray.trainer.accelerator_field}")

    def _check_multihost(self) -> None:
        """What a trainer of several processes cannot do yet, named before anything starts."""
        hosts = self.ray.trainer.hosts()
        self.trainer_group.errors("trainer_group")
        from marinrl.config.transfer import RayTransferConfig

        if isinstance(self.weights, RayTransferConfig):
            raise ConfigError("weights", f"the Ray object-store transfer needs a model one process holds whole; a "
                                         f"trainer over {hosts} hosts publishes per-process shards: use "
                                         "{type: filesystem} (the default)")

    # ------------------------------------------------------------------ derived configs

    def rollout_dtype(self) -> str:
        """The dtype rollout workers sample in and the trainer publishes weights in: `inference.dtype`, else
        the trainer's compute dtype (docs/models.md, "Dtypes")."""
        if self.inference.dtype is not None:
            return self.inference.dtype
        return parse_mp(self.trainer.mp)["compute"]

    def sampling(self):
        if self.max_uses > 1:
            return ReplaySamplingConfig(staleness=self.max_staleness, uses=self.max_uses)
        if self.max_staleness == 0:
            return OnPolicyConfig()
        return OffPolicyConfig(staleness=self.max_staleness)

    def weights_config(self) -> WeightTransferConfig:
        """The weight stream, with `fanout: auto` decided for this job's `n_rollout_workers`."""
        from marinrl.config.transfer import stream_weights

        return stream_weights(self.weights, self.run_dir, self.n_rollout_workers)

    def _batch_source(self) -> str:
        return (f"groups_per_step × n_generations = {self.groups_per_step} × {self.n_generations} = "
                f"{self.groups_per_step * self.n_generations} rows")
