"""RolloutWorkerConfig and the policy models it samples (`ModelStream`): the config layer of the rollout worker
(docs/architecture.md, "Layers"), importing no JAX, Ray or inference code."""

from __future__ import annotations

import dataclasses
from typing import Optional

from marinrl.config.checks import require_at_least
from marinrl.config.inflight import InflightConfig
from marinrl.config.lora import LoraRLConfig
from marinrl.config.transfer import FilesystemTransferConfig, WeightTransferConfig


@dataclasses.dataclass(frozen=True)
class ModelStream:
    """One policy model a worker samples: where its weights come from and its rollout files go
    (docs/policies.md for a job of several)."""

    name: str
    policies: tuple[str, ...]
    """The policies this model plays: their turns are sampled by its server and written to its files (empty:
    every policy, for a job of one model)."""
    rollout_root: str
    weights: WeightTransferConfig
    lora: Optional[LoraRLConfig] = None
    """The job's `LoraRLConfig` when it trains LoRA adapters: versions then carry the adapters only, and the
    worker writes each into this model's slot of the one base its lora policies share (`marinrl/rollout/shared_base.py`;
    merged into the base only with the engine backend or in-flight updates, `marinrl/models/lora.py`)."""


def _default_streams() -> tuple[ModelStream, ...]:
    return (ModelStream("policy", (), "runs/default/rollouts", FilesystemTransferConfig(root="runs/default/weights")),)


@dataclasses.dataclass
class RolloutWorkerConfig:
    streams: tuple[ModelStream, ...] = dataclasses.field(default_factory=_default_streams)
    """The policy models this worker samples: each one's weights (and adapters), rollout files and the
    policies it plays. One for most jobs; several (docs/policies.md) make the manager's server a
    `PolicyRouter` with a server per model."""
    groups_per_batch: int = 8
    """Prompts per batch this worker writes (the trainer's groups_per_step divided among workers)."""
    n_generations: int = 8
    """Samples per prompt: the group size."""
    max_staleness: int = 1
    """The trainer's staleness window; it decides how far ahead of the trainer this worker runs."""
    final_step: int = 100
    """The trainer's last weight step: the worker stops once it holds these weights."""
    micro_eval_every: int = 0
    """Run a micro-eval (small, not fed to the curriculum) every this many batches; 0 = never."""
    micro_eval_examples: int = 8
    eval_every: int = 0
    """Run a full eval of every lesson (fed to the curriculum) every this many weight steps; 0 = only
    at the start and the end."""
    eval_examples: int = 32
    weight_timeout_s: float = 600.0
    fleet_size: int = 1
    """The rollout workers of the job (the plan sets it): a waiting worker's share of `pointer_reads_per_s`."""
    pointer_reads_per_s: float = 200.0
    """The weight-pointer reads per second all waiting rollout workers may make together: each backs off
    to `fleet_size / pointer_reads_per_s` seconds between reads (at least 50 ms), jittered
    (`transfer.base.PollBackoff`)."""
    """How long to wait for weights the trainer owes us before giving up."""
    max_consecutive_env_failures: int = 5
    """A lesson whose environment fails this many calls in a row (it raises, fails to construct, or
    yields no usable group) raises `EnvironmentFailedError`; a good batch of the lesson resets its count."""
    warm_up_sampler: bool = True
    """Before weight step 0 arrives, compile the sampler for the first eval's and the first batch's
    shapes with the initial weights (each lesson's environment runs once per kind of call against a dry
    run that generates nothing: `marinrl/rollout/warmup.py`), while the trainer initializes. Off: for
    environments with side effects per call; the first eval and batch then compile after step 0."""
    inflight: InflightConfig = dataclasses.field(default_factory=InflightConfig)
    """Take newer weights while a training batch is generated (between chunks of decode steps), not only
    between batches. Evaluations never swap."""
    seed: int = 0
    storage_options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.streams:
            raise ValueError("RolloutWorkerConfig.streams: a worker samples at least one policy model")
        require_at_least(self, 1, "groups_per_batch", "n_generations", "eval_examples", "micro_eval_examples",
                         "max_consecutive_env_failures", "fleet_size")
        if not self.pointer_reads_per_s > 0:
            raise ValueError(f"RolloutWorkerConfig.pointer_reads_per_s must be > 0, got {self.pointer_reads_per_s}")
        require_at_least(self, 0, "max_staleness", "micro_eval_every", "eval_every", "final_step")
        if self.inflight.enabled and len(self.streams) > 1:
            raise ValueError("inflight.enabled with several policy models is not supported")
        if self.inflight.enabled and self.max_staleness == 0:
            raise ValueError("inflight.enabled with max_staleness 0: on-policy never mixes weight versions inside "
                             "a rollout; turn inflight off or allow max_staleness >= 1")
