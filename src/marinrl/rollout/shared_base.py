"""A rollout worker's `lora` policy models on one base: one server, one `AdapterStack`, a slot per policy model
(docs/policies.md, "One base, K adapters, one batch").

- **Who shares.** The `lora` policy models whose `model` config is the same, and whose adapters have the same
  rank and `target_modules` (the stack's array shapes), share one server (`serving_groups`); slot k is the k-th
  of them in the job's order, and its scale is its own alpha / rank. A `full` or `shared` policy model keeps a
  server of its own, and so does every `lora` one where the stack cannot serve: the engine backend
  (`inference.backend` or an HTTP endpoint's `http_backend`), or in-flight weight swaps (`inflight.enabled`).
  There each version is merged into the base (`lora.AdapterMergingClient`).
- **The server.** `SharedBaseServer` is an `InferenceServer` whose scan sampler calls carry the stack's adapters
  and each request's slot (`TokenRequest.adapter`; None: the slot of its first policy model, which the HTTP
  endpoint serves when the server holds the job's first model). Requests of several slots in one call are
  sampled together (`InferenceServer.generate_requests` groups requests by their sampling settings, never by
  slot); each environment call is one sampler call, so concurrent calls of different policies are not
  coalesced across calls.
- **A policy's view.** `PolicySlot` is the InferenceContext a policy's environments see (`PolicyRouter`):
  `generate` stamps its slot; `reload(adapter, weight_step)` writes a weight version (adapter arrays only) into
  its slot (`AdapterStack.with_adapter`: in place, the base and the other slots untouched) and records that
  slot's weight step.
- **Writes wait for running calls.** A slot is written in place (its arrays donated), so a write waits until no
  sampler call holds the adapters; calls that start meanwhile wait for the write.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

from marinrl.config.lora import LoraRLConfig
from marinrl.inference.context import Generation, SamplingParams
from marinrl.inference.generate_queue import TokenRequest
from marinrl.inference.server import InferenceServer
from marinrl.models.adapter_stack import AdapterStack

logger = logging.getLogger(__name__)

__all__ = ["SharedBaseServer", "PolicySlot", "serving_groups", "stack_serves"]


def stack_serves(inference, inflight_enabled: bool) -> bool:
    """Whether an adapter stack can serve this rollout worker: the scan sampler for `generate` and the HTTP
    endpoint, no in-flight weight swaps (they run the plain model)."""
    http = inference.http_backend or inference.backend
    return inference.backend == "scan" and (not inference.serve_http or http == "scan") and not inflight_enabled


def serving_groups(models: Sequence, inference, inflight_enabled: bool = False) -> list[tuple[int, ...]]:
    """The job's policy models (each with `model` and `lora`) as the servers that hold them: indices into
    `models`, each group in the job's order and the groups in the order of their first model. `lora` models of
    one base and one adapter shape form one group when a stack can serve them (`stack_serves`); every other
    model is a group of its own."""
    stack = stack_serves(inference, inflight_enabled)
    groups: list[list[int]] = []
    for i, m in enumerate(models):
        if stack and m.lora is not None:
            for g in groups:
                first = models[g[0]]
                if (first.lora is not None and first.model == m.model and first.lora.rank == m.lora.rank
                        and first.lora.target_modules == m.lora.target_modules):
                    g.append(i)
                    break
            else:
                groups.append([i])
        else:
            groups.append([i])
    return [tuple(g) for g in groups]


class SharedBaseServer(InferenceServer):
    """An `InferenceServer` holding one base and an `AdapterStack` of one slot per adapter config in `loras`
    (module doc). `reload` is refused: versions go into slots (`write_slot`, `slot(k).reload`)."""

    def __init__(self, config, model, tokenizer, loras: Sequence[LoraRLConfig], *, default_slot: int = 0):
        if not stack_serves(config, False):
            raise ValueError("a shared-base server runs the scan sampler only (inference.backend and http_backend: "
                             "scan)")
        super().__init__(config, model, tokenizer)
        self._stack = _on_mesh(AdapterStack.empty(self.model, loras[0], len(loras)), self.mesh)
        self._scales = [lora.scale for lora in loras]
        self._steps = [0] * len(loras)
        self._default = int(default_slot)
        self._readers = 0
        self._idle = threading.Condition()
        logger.info("one base, %d adapter slot(s) (rank %d): a shared-base server", len(loras), loras[0].rank)

    @property
    def stack(self) -> AdapterStack:
        """The base and its slots as served now."""
        return self._stack

    def slot(self, k: int) -> PolicySlot:
        """The InferenceContext of slot k's policy model."""
        self._stack._check_slot(k)
        return PolicySlot(self, k)

    def slot_weight_step(self, k: int) -> int:
        return self._steps[k]

    def write_slot(self, k: int, adapter, weight_step: int) -> None:
        """Slot k holds `adapter` (an adapter-only weight version) from now on, as `weight_step`; the base and the
        other slots are untouched. Waits for the sampler calls holding the adapters to finish."""
        with self._idle:
            while self._readers:
                self._idle.wait()
            self._stack = self._stack.with_adapter(k, adapter, self._scales[k])
            self._steps[k] = int(weight_step)
            if k == self._default:
                with self._lock:
                    self._weight_step = int(weight_step)

    def reload(self, model, weight_step: int) -> None:
        raise ValueError("a shared-base server never reloads its base: write a policy's adapters into its slot "
                         "(write_slot)")

    def inflight_updates(self, poll, config):
        raise ValueError("in-flight weight updates run the plain model: not with adapters on a shared base")

    def _adapter_args(self, requests) -> dict:
        return {"adapters": self._stack.adapters,
                "adapter_index": [self._default if r.adapter is None else int(r.adapter) for r in requests]}

    def _generate_scan(self, *args, **kwargs):
        """The base class's sampler call, counted as a reader of the slots: `write_slot` waits for it to end
        (the stack's update is in place) and a call that starts during a write waits for the write."""
        with self._idle:
            self._readers += 1
        try:
            return (yield from super()._generate_scan(*args, **kwargs))
        finally:
            with self._idle:
                self._readers -= 1
                self._idle.notify_all()


class PolicySlot:
    """One policy model's InferenceContext on a `SharedBaseServer`: its generate calls sample with slot `slot`,
    its weight versions are written into that slot (module doc)."""

    def __init__(self, server: SharedBaseServer, slot: int):
        self.server = server
        self.slot = int(slot)

    @property
    def tokenizer(self):
        return self.server.tokenizer

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def api_key(self) -> str:
        return self.server.api_key

    @property
    def model(self):
        """The shared base (never copied per policy)."""
        return self.server.model

    @property
    def mesh(self):
        return self.server.mesh

    @property
    def weight_step(self) -> int:
        """The weight step of this slot's adapters."""
        return self.server.slot_weight_step(self.slot)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                 seed: int) -> list[list[Generation]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return self.server.generate_requests(
            [TokenRequest(p, n, sampling, seed, i, adapter=self.slot) for i, p in enumerate(prompts)])

    def generate_dry(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                     seed: int) -> list[list[Generation]]:
        """The server's dry run: every slot runs the same compiled program."""
        return self.server.generate_dry(prompts, n, sampling, seed)

    def generate_chat(self, conversations: Sequence[Sequence[dict]], n: int, sampling: SamplingParams,
                      seed: int) -> tuple[list[list[int]], list[list[Generation]]]:
        prompts = [self.chat_prompt(c) for c in conversations]
        return prompts, self.generate(prompts, n, sampling, seed)

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        return self.server.chat_prompt(messages)

    def text(self, generation: Generation) -> str:
        return self.server.text(generation)

    def reload(self, adapter, weight_step: int) -> None:
        """A weight version of this policy model (its adapter arrays) into its slot."""
        self.server.write_slot(self.slot, adapter, weight_step)

    def inflight_updates(self, poll, config):
        return self.server.inflight_updates(poll, config)

    def shutdown(self) -> None:
        self.server.shutdown()


def _on_mesh(stack: AdapterStack, mesh: Optional[object]) -> AdapterStack:
    """The stack with its slots replicated over the rollout mesh (the base is already placed on it)."""
    if mesh is None:
        return stack
    import equinox as eqx
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh.mesh, PartitionSpec())
    return eqx.tree_at(lambda s: s.adapters, stack, jax.device_put(stack.adapters, replicated))

