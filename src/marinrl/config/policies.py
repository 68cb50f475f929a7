"""Policies: which models a job trains, by the policy names rollouts carry (`Rollout.policy_name`).

`policies:` in a job config maps each policy name to its model, optimizer, loss and specialization
(docs/policies.md). The design has three levels: `shared` (L1: every shared policy's turns train the
job's one model; agents differ by their prompts), `lora` (L2: an adapter of its own on a frozen base)
and `full` (L3: a model of its own). Each `lora` or `full` policy, and the shared policies together,
are one *policy model* (`PolicyModel`): its own trainer, replay buffer, optimizer, checkpoints, weight
stream and rollout files. Rollout workers hold every policy model's current weights and route each
agent's generate calls to its policy's model (`marinrl/rollout/policy_router.py`). One policy model
(the default, and any job whose policies are all shared) is today's single-trainer job, unchanged.

An environment that maps an agent to a policy the job does not define is refused before anything
starts. A rollout of an undefined policy that still reaches a trainer stops it at ingestion
(`UnknownPolicyError`), naming the policy and the lesson: it is never trained into another policy's model.

No `policies:` (the default) is one shared policy named `policy` (`DEFAULT_POLICY`), the name every
environment uses unless told otherwise: today's configs are unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from marinrl.config.errors import ConfigError
from marinrl.config.lora import LoraRLConfig
from marinrl.config.loss import LossConfig
from marinrl.config.model import ModelConfig
from marinrl.config.placement import PlacementConfig
from marinrl.config.trainer import JobOptimizerConfig
from marinrl.config.transfer import WeightTransferConfig, stream_weights
from marinrl.types import DEFAULT_POLICY

if TYPE_CHECKING:
    from marinrl.config.job import RLJobConfig

SPECIALIZATIONS = ("shared", "lora", "full")


@dataclasses.dataclass
class PolicyConfig:
    """One policy of `policies:`; an unset model, optimizer or loss is the job's top-level one."""

    specialization: str = "shared"
    """`shared` (its turns train the job's one model), `lora` (an adapter of its own on a frozen base)
    or `full` (a model of its own, with its own trainer)."""
    model: Optional[ModelConfig] = None
    """The policy's model (a `lora` policy's frozen base); None: the job's `model`. Not for a `shared`
    policy next to others (they train the job's one model)."""
    optimizer: Optional[JobOptimizerConfig] = None
    """The policy's optimizer; None: the job's `optimizer`. Not for a `shared` policy next to others."""
    loss: Optional[LossConfig] = None
    """The policy's loss; None: the job's `loss`. Not for a `shared` policy next to others."""
    lora: Optional[LoraRLConfig] = None
    """The adapters of a `lora` policy (rank, alpha, target_modules); None: `LoraRLConfig()`'s defaults."""
    placement: Optional[PlacementConfig] = None
    """What this policy's trainer needs of its host (`num_cpus`, `num_gpus`, `tpu`, `resources`, …, as
    `ray.trainer`); None: `ray.trainer`. One host per trainer when the job has several policy models."""

    def own_fields(self) -> list[str]:
        return [f for f in ("model", "optimizer", "loss", "placement") if getattr(self, f) is not None]


def policy_names(job: RLJobConfig) -> tuple[str, ...]:
    """The policies the job trains: the keys of `policies`, or the one default policy."""
    return tuple(job.policies) if job.policies else (DEFAULT_POLICY,)


def check_policies(job: RLJobConfig) -> None:
    """Raises ConfigError naming the first bad `policies.<name>.<field>` (or `lora`)."""
    policies = job.policies
    if not policies:
        return
    (only,) = policies.values() if len(policies) == 1 else (None,)
    resolved = only is not None and only.specialization == "lora" and job.lora == (only.lora or LoraRLConfig())
    if job.lora is not None and not resolved:  # (`resolve_policies` lifts a single policy's adapters to `lora`)
        raise ConfigError("lora", "with `policies:` each policy says its own specialization: use "
                                  "`policies.<name>: {specialization: lora, lora: {...}}` "
                                  "instead of a top-level `lora`")
    for name, policy in policies.items():
        where = f"policies.{name}"
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError("policies", f"a policy name must be a non-empty string without '/', got {name!r}")
        if not isinstance(policy, PolicyConfig):
            raise ConfigError(where, f"must be a mapping of specialization, model, optimizer, loss, lora; got "
                                     f"{policy!r}")
        if policy.specialization not in SPECIALIZATIONS:
            raise ConfigError(f"{where}.specialization", f"must be one of {list(SPECIALIZATIONS)}, got "
                                                         f"{policy.specialization!r}")
        if policy.lora is not None:
            if policy.specialization != "lora":
                raise ConfigError(f"{where}.lora", f"only a `lora` policy has adapters; this one is "
                                                   f"{policy.specialization!r}")
            policy.lora.errors(f"{where}.lora")
        if policy.placement is not None:
            if not isinstance(policy.placement, PlacementConfig):
                raise ConfigError(f"{where}.placement", f"must be a mapping like ray.trainer, got {policy.placement!r}")
            policy.placement.errors(f"{where}.placement")
    if len(policies) == 1:
        return
    for name, policy in policies.items():
        own = policy.own_fields()
        if own and policy.specialization == "shared":
            raise ConfigError(f"policies.{name}.{own[0]}",
                              f"a shared policy trains the job's one model with the job's optimizer and loss; with "
                              f"{len(policies)} policies set `{'ray.trainer' if own[0] == 'placement' else own[0]}` at "
                              "the top level, or make the policy `full` "
                              "(a model of its own) or `lora` (an adapter of its own)")
    models = policy_models(job)
    if len(models) > 1:
        _check_policy_models(job, models)


def _check_policy_models(job: RLJobConfig, models: tuple[PolicyModel, ...]) -> None:
    """What a job of several policy models cannot do (yet), named before anything starts."""
    first = models[0]
    for m in models[1:]:
        if m.model.tokenizer != first.model.tokenizer:
            raise ConfigError(f"policies.{m.name}.model.tokenizer",
                              f"{m.model.tokenizer!r} differs from policy model {first.name!r}'s "
                              f"{first.model.tokenizer!r}: agents quote each other's exact tokens, so every "
                              "policy's model must use one tokenizer")
    for m in models:
        placement = m.placement
        if placement.hosts() > 1:
            own = job.policies.get(m.name)
            field = f"policies.{m.name}.placement" if own is not None and own.placement is not None else "ray.trainer"
            raise ConfigError(field, f"a trainer over {placement.hosts()} hosts with {len(models)} policy models (one "
                                     "trainer each) is not supported: use one-host trainers")
    if job.inflight.enabled:
        raise ConfigError("inflight.enabled", f"in-flight weight updates with {len(models)} policy models are not "
                                              "supported: turn inflight off")


@dataclasses.dataclass(frozen=True)
class PolicyModel:
    """One model a job trains: the policies whose turns train it and what it has of its own, a view of the
    job for its trainer and its weight stream. Everything else (the curriculum, batching, the trainer's mesh,
    the fleet, the steps) is the job's and is read from the job: a policy model is never a copy of it."""

    name: str
    policies: tuple[str, ...]
    model: ModelConfig
    """Its model (a `lora` policy's frozen base)."""
    optimizer: JobOptimizerConfig
    loss: LossConfig
    lora: Optional[LoraRLConfig]
    """Its adapters (a `lora` policy), else None: every parameter trains."""
    placement: PlacementConfig
    """What its trainer needs of its host."""
    run_id: str
    """Its trainer's run id: the job's for a job of one policy model, else the model's name."""
    run_dir: str
    """Its checkpoints, weights, rollout files and logs: the job's run directory for a job of one policy model,
    else `<run_dir>/policies/<name>`."""
    weights: WeightTransferConfig
    """Its weight stream, `fanout: auto` decided for the job's fleet."""
    adapters: tuple[PolicyModel, ...] = ()
    """A trainer of several `lora` models on one base (`trainers`): those models, one adapter each, whose own
    rollout files and weight streams it reads and writes; its `run_dir` holds the trainer's checkpoints and
    logs. Empty: one model, this one."""

    @property
    def rollout_root(self) -> str:
        return f"{self.run_dir}/rollouts"

    @property
    def models(self) -> tuple[PolicyModel, ...]:
        """The policy models this trainer trains: its adapters', or itself."""
        return self.adapters or (self,)


def policy_models(job: RLJobConfig) -> tuple[PolicyModel, ...]:
    """The models the job trains, the first one holding the shared policies (if any) and the curriculum's
    clock: one for a job without `policies:`, one policy, or only shared policies (the job itself); else
    one for the shared policies together and one per `lora` or `full` policy."""
    names = policy_names(job)
    policies = job.policies
    own = [n for n, p in policies.items() if p.specialization != "shared"] if len(policies) > 1 else []
    if not own:
        job = _resolved(job)
        return (PolicyModel(names[0], names, job.model, job.optimizer, job.loss, job.lora, job.ray.trainer,
                            job.run_id, job.run_dir, job.weights_config()),)
    shared = tuple(n for n in names if n not in own)
    groups = ([(shared[0], shared, PolicyConfig())] if shared else []) + [(n, (n,), policies[n]) for n in own]
    return tuple(_policy_model(job, name, members, policy) for name, members, policy in groups)


def trainers(job: RLJobConfig) -> tuple[PolicyModel, ...]:
    """What each of the job's trainers trains, in `policy_models` order (the first keeps the curriculum's clock):
    `lora` models that share one base (the same `model`, `optimizer` and `loss`, adapters of one rank, alpha and
    target_modules, and no `placement` of their own) are one trainer of several adapters on one copy of that
    base (`PolicyModel.adapters`, docs/policies.md); every other model is a trainer of its own."""
    models = policy_models(job)
    groups: list[tuple[Optional[tuple], list[PolicyModel]]] = []
    for m in models:
        own = job.policies.get(m.name)
        shares = m.lora is not None and len(models) > 1 and (own is None or own.placement is None)
        base = (m.model, m.optimizer, m.loss, m.lora.rank, m.lora.alpha, m.lora.target_modules) if shares else None
        group = next((g for key, g in groups if base is not None and key == base), None)
        if group is None:
            groups.append((base, [m]))
        else:
            group.append(m)
    return tuple(g[0] if len(g) == 1 else _shared_base(job, tuple(g)) for _, g in groups)


def _shared_base(job: RLJobConfig, models: tuple[PolicyModel, ...]) -> PolicyModel:
    """The trainer of `models`' adapters on their one base: named by its models, its own run directory
    `<run_dir>/trainers/<name>` (checkpoints, logs, the audit trail); rollout files and weight streams are the
    models' own."""
    first = models[0]
    name = "+".join(m.name for m in models)
    return dataclasses.replace(first, name=name, policies=tuple(p for m in models for p in m.policies),
                               run_id=name, run_dir=f"{job.run_dir}/trainers/{name}", adapters=models)


def _policy_model(job: RLJobConfig, name: str, members: tuple[str, ...], policy: PolicyConfig) -> PolicyModel:
    run_dir = f"{job.run_dir}/policies/{name}"
    weights = job.weights.for_policy(name) if job.weights is not None else None
    return PolicyModel(name, members, model=policy.model or job.model, optimizer=policy.optimizer or job.optimizer,
                       loss=policy.loss or job.loss,
                       lora=(policy.lora or LoraRLConfig()) if policy.specialization == "lora" else None,
                       placement=policy.placement or job.ray.trainer, run_id=name, run_dir=run_dir,
                       weights=stream_weights(weights, run_dir, job.n_rollout_workers))


def resolve_policies(job: RLJobConfig) -> RLJobConfig:
    """The job with its single policy's model, optimizer, loss and adapters as the job's own (what the
    trainer and the rollout workers read); unchanged without `policies:` or with several (shared)."""
    check_policies(job)
    return _resolved(job)


def _resolved(job: RLJobConfig) -> RLJobConfig:
    if len(job.policies) != 1:
        return job
    (policy,) = job.policies.values()
    lora = (policy.lora or LoraRLConfig()) if policy.specialization == "lora" else None
    ray = dataclasses.replace(job.ray, trainer=policy.placement) if policy.placement is not None else job.ray
    return dataclasses.replace(job, model=policy.model or job.model, optimizer=policy.optimizer or job.optimizer,
                               loss=policy.loss or job.loss, lora=lora if job.lora is None else job.lora, ray=ray)


def env_policy_names(env) -> set[str]:
    """The policy names an environment's rollouts carry, as far as it declares them: its agents'
    (multi-agent), else its `policy_name`; empty for one that does not say (checked at ingestion)."""
    agents = getattr(env, "agents", None)
    if agents:
        return {a.policy for a in agents if isinstance(getattr(a, "policy", None), str)}
    name = getattr(env, "policy_name", None)
    return {name} if isinstance(name, str) else set()
