"""A rollout worker's policy models behind one InferenceContext (docs/policies.md).

A job of several policy models (`marinrl/config/policies.py`: a `full` or `lora` policy each, the shared ones
together) gives every rollout worker one server per `full` or shared model, each loaded with that model's
current weights, and one server per base for its `lora` models, a slot each (`shared_base.PolicySlot`, the
model's view of that server). Environments reach them through `policy_context(ctx, policy)`
(inference/context.py): a multi-agent environment asks for each agent's policy before its turn, a multi-turn
one for its `policy_name`. Everything else (the tokenizer, `generate` of an environment that names no policy,
the OpenAI endpoint) is the first model's: the one holding the shared policies, or the first policy defined.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from marinrl.inference.context import Generation, SamplingParams
from marinrl.types import RolloutBatch, RolloutGroup


class PolicyRouter:
    """An InferenceContext over each policy model's server or slot (name -> server, in the job's order) and the
    policies each model plays (policy -> model name). A policy no model plays is sampled by the first
    model: its rollouts then reach the first model's trainer, which refuses them at ingestion naming the
    policy (`UnknownPolicyError`), as a job of one model does."""

    def __init__(self, servers: Mapping[str, object], model_of: Mapping[str, str]):
        if not servers:
            raise ValueError("PolicyRouter needs at least one server")
        unknown = sorted(set(model_of.values()) - set(servers))
        if unknown:
            raise ValueError(f"policies map to models without a server: {unknown}; servers: {sorted(servers)}")
        self.servers = dict(servers)
        self.model_of = dict(model_of)
        self._first = next(iter(self.servers.values()))

    def for_policy(self, policy: str):
        return self.servers[self.model_of.get(policy, next(iter(self.servers)))]

    # --- the InferenceContext of the first model (environments that name no policy)

    @property
    def tokenizer(self):
        return self._first.tokenizer

    @property
    def url(self) -> str:
        return self._first.url

    @property
    def api_key(self) -> str:
        return self._first.api_key

    @property
    def model(self):
        return self._first.model

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                 seed: int) -> list[list[Generation]]:
        return self._first.generate(prompts, n, sampling, seed)

    def generate_dry(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                     seed: int) -> list[list[Generation]]:
        return self._first.generate_dry(prompts, n, sampling, seed)

    def reload(self, model, weight_step: int, model_name: str | None = None) -> None:
        """New weights for one model (the first model's when unnamed): its server's, or its slot's adapters."""
        (self._first if model_name is None else self.servers[model_name]).reload(model, weight_step)

    def shutdown(self) -> None:
        for server in self.servers.values():
            server.shutdown()


def split_by_model(batch: RolloutBatch, model_of: Mapping[str, str], weight_steps: Mapping[str, int]
                   ) -> list[tuple[str, RolloutBatch]]:
    """One batch per policy model, in the models' order: each group goes to the model of its first
    rollout's policy (a policy no model plays: the first model, whose trainer refuses it by name), stamped
    with the weight step that model's server held when the batch began (what its trainer's staleness
    window counts). Models without a group get no batch."""
    first = next(iter(weight_steps))
    by_model: dict[str, list[RolloutGroup]] = {name: [] for name in weight_steps}
    for g in batch.groups:
        by_model[model_of.get(g.rollouts[0].policy_name, first)].append(g)
    out = []
    for name, groups in by_model.items():
        if not groups:
            continue
        metadata = dataclasses.replace(batch.metadata, weight_step=int(weight_steps[name]))
        restamped = tuple(RolloutGroup(tuple(dataclasses.replace(r, metadata=metadata) for r in g.rollouts))
                          for g in groups)
        out.append((name, RolloutBatch(restamped, metadata)))
    return out
