"""Policies: which models a job trains, by the policy names rollouts carry (`Rollout.policy_name`).

`policies:` in a job config maps each policy name to its model, optimizer, loss and specialization
(docs/policies.md). The design has three levels: `shared` (L1: every shared policy's turns train the
job's one model; agents differ by their prompts), `lora` (L2: an adapter per policy on one frozen
base) and `full` (L3: a model per policy). What runs today is one trained model: any number of
`shared` policies, or exactly one policy of any specialization (`lora`: LoRA RL, `full`: full
fine-tuning of that policy's model). Several `lora` or `full` policies need a trainer or an adapter
per policy, which are not built: such a config is refused before anything starts, as is an
environment that maps an agent to a policy the job does not define. A rollout of an undefined policy
that still reaches the trainer stops it at ingestion (`UnknownPolicyError`), naming the policy and the
lesson: it is never trained into another policy's model.

No `policies:` (the default) is one shared policy named `policy` (`DEFAULT_POLICY`), the name every
environment uses unless told otherwise: today's configs are unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from marinrl.lora import LoraRLConfig
from marinrl.models import ModelConfig
from marinrl.preflight import ConfigError
from marinrl.train.losses import LossConfig
from marinrl.train.replay import UnknownPolicyError  # noqa: F401  (raised at ingestion)
from marinrl.train.trainer_config import JobOptimizerConfig
from marinrl.types import DEFAULT_POLICY

if TYPE_CHECKING:
    from marinrl.job_config import RLJobConfig

SPECIALIZATIONS = ("shared", "lora", "full")


@dataclasses.dataclass
class PolicyConfig:
    """One policy of `policies:`; an unset model, optimizer or loss is the job's top-level one."""

    specialization: str = "shared"
    """`shared` (its turns train the job's one model), `lora` (an adapter on a frozen base) or `full`
    (a model of its own). Several policies must all be `shared` today."""
    model: Optional[ModelConfig] = None
    """The policy's model; None: the job's `model`. Only for a job's single policy today."""
    optimizer: Optional[JobOptimizerConfig] = None
    """The policy's optimizer; None: the job's `optimizer`. Only for a job's single policy today."""
    loss: Optional[LossConfig] = None
    """The policy's loss; None: the job's `loss`. Only for a job's single policy today."""
    lora: Optional[LoraRLConfig] = None
    """The adapters of a `lora` policy (rank, alpha, target_modules); None: `LoraRLConfig()`'s defaults."""

    def own_fields(self) -> list[str]:
        return [f for f in ("model", "optimizer", "loss") if getattr(self, f) is not None]


def policy_names(job: "RLJobConfig") -> tuple[str, ...]:
    """The policies the job trains: the keys of `policies`, or the one default policy."""
    return tuple(job.policies) if job.policies else (DEFAULT_POLICY,)


def check_policies(job: "RLJobConfig") -> None:
    """Raises ConfigError naming the first bad `policies.<name>.<field>` (or `lora`)."""
    policies = job.policies
    if not policies:
        return
    (only,) = policies.values() if len(policies) == 1 else (None,)
    resolved = only is not None and only.specialization == "lora" and job.lora == (only.lora or LoraRLConfig())
    if job.lora is not None and not resolved:  # (`resolve_policies` lifts a single policy's adapters to `lora`)
        raise ConfigError("lora", "with `policies:` each policy says its own specialization: use "
                                  "`policies.<name>: {specialization: lora, lora: {...}}` instead of a top-level `lora`")
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
    if len(policies) == 1:
        return
    for name, policy in policies.items():
        if policy.specialization != "shared":
            raise ConfigError(f"policies.{name}.specialization",
                              f"{policy.specialization!r} with {len(policies)} policies needs "
                              f"{'an adapter' if policy.specialization == 'lora' else 'a trainer'} per policy, "
                              "which is not built yet (issue 13, L2/L3): with several policies every one must be "
                              "`shared` (their turns all train the job's one model), or train one policy per job")
        own = policy.own_fields()
        if own:
            raise ConfigError(f"policies.{name}.{own[0]}",
                              f"a shared policy trains the job's one model with the job's optimizer and loss; with "
                              f"{len(policies)} policies set `{own[0]}` at the top level, not per policy")


def resolve_policies(job: "RLJobConfig") -> "RLJobConfig":
    """The job with its single policy's model, optimizer, loss and adapters as the job's own (what the
    trainer and the rollout workers read); unchanged without `policies:` or with several (shared)."""
    check_policies(job)
    if len(job.policies) != 1:
        return job
    (policy,) = job.policies.values()
    lora = (policy.lora or LoraRLConfig()) if policy.specialization == "lora" else None
    return dataclasses.replace(job, model=policy.model or job.model, optimizer=policy.optimizer or job.optimizer,
                               loss=policy.loss or job.loss, lora=lora if job.lora is None else job.lora)


def env_policy_names(env) -> set[str]:
    """The policy names an environment's rollouts carry, as far as it declares them: its agents'
    (multi-agent), else its `policy_name`; empty for one that does not say (checked at ingestion)."""
    agents = getattr(env, "agents", None)
    if agents:
        return {a.policy for a in agents if isinstance(getattr(a, "policy", None), str)}
    name = getattr(env, "policy_name", None)
    return {name} if isinstance(name, str) else set()
