"""LoRA RL: low-rank adapters on a frozen base, trained, checkpointed and published alone.

Built on Levanter's `levanter.lora`: `loraize` wraps each targeted `hnn.Linear` in a `LoraLinear`
(the base layer plus a `LowRankLinear` adapter of rank r, output scaled by alpha / r).

- **Trainer.** The policy is the base with adapters (`add_adapters`); Levanter's `Trainer` gets
  `trainable_filter(policy)` as `is_trainable`, so gradients are taken, optimizer state kept and
  checkpoints written for the adapter arrays only. The base is rebuilt from the model config on resume
  (it never changes). The adapters' B starts at zero, so weight step 0 is the base exactly, and the KL
  reference is the policy with its adapters taken off (`without_adapters`): no second model.
- **Weights.** A version carries the adapter arrays only (`adapter_only`: the policy's pytree with
  every base array left out), through any weight transfer mode.
- **Rollout side.** A rollout worker serves its `lora` policy models of one base from one
  `adapter_stack.AdapterStack`, each version written into its model's slot unmerged (`adapter_client` receives
  it; `rollout/shared_base.py`). Where the stack cannot serve (the engine backend, in-flight weight swaps),
  `AdapterMergingClient` keeps the base the rollout worker loaded at start and, for
  each version it receives, merges `W + (alpha / r)·A·B` into every targeted layer (`merge_adapters`):
  the sampler then runs a plain model (its scan sampler reads each Linear's weight directly). Only the
  targeted weights are new arrays; the rest of the served model is the base's, shared.
"""

from __future__ import annotations

import dataclasses
import time

import equinox as eqx
import haliax as hax
import jax
from levanter.lora import (
    LoraConfig,
    LoraLinear,
    filter_lora_params,
    is_lora_param,
    lora_trainable_params_filter,
    loraize,
)
from levanter.utils.jax_utils import leaf_key_paths

from marinrl.config.errors import ConfigError
from marinrl.config.lora import LoraRLConfig
from marinrl.config.transfer import WeightTransferConfig
from marinrl.transfer.base import WeightUpdate, cast_for_publish, floating_dtypes
from marinrl.transfer.endpoints import build_client

__all__ = ["LoraRLConfig", "AdapterMergingClient", "add_adapters", "adapter_only", "without_adapters",
           "merge_adapters", "published_adapters", "adapter_client", "trainable_filter", "adapted_modules",
           "check_targets", "parameter_counts", "describe"]


def levanter_lora(config: LoraRLConfig) -> LoraConfig:
    """Levanter's config: its `target_modules` regex is matched from the path's start, ours searched."""
    target = None if config.target_modules is None else f".*(?:{config.target_modules})"
    return LoraConfig(target_modules=target, r=config.rank, alpha=float(config.alpha), dropout=0.0)


# ------------------------------------------------------------------------------------ the model


def _is_lora_linear(x) -> bool:
    return isinstance(x, LoraLinear)


def add_adapters(model, config: LoraRLConfig):
    """`model` with an adapter on every targeted linear module: A random (Levanter's init), B zero, so
    the adapted model computes exactly what `model` does until it is trained."""
    adapted = loraize(model, levanter_lora(config), key=jax.random.PRNGKey(config.seed))

    def zero_b(node):
        if not is_lora_param(node):
            return node
        return eqx.tree_at(lambda n: n.lora_B.weight, node, hax.zeros_like(node.lora_B.weight))

    return jax.tree.map(zero_b, adapted, is_leaf=is_lora_param)


def adapted_modules(model) -> list[str]:
    """Dotted paths of the modules that carry an adapter."""
    paths = leaf_key_paths(model, is_leaf=_is_lora_linear)
    return [p for p, x in zip(jax.tree.leaves(paths, is_leaf=_is_lora_linear),
                              jax.tree.leaves(model, is_leaf=_is_lora_linear)) if isinstance(x, LoraLinear)]


def check_targets(lm_config, vocab_size: int, config: LoraRLConfig, field: str = "lora") -> list[str]:
    """The paths `config` adapts in a model of this architecture (shapes only: nothing is allocated).
    ConfigError naming `<field>.target_modules` and the model's linear modules if it adapts none."""
    config.errors(field)
    Vocab = hax.Axis("vocab", vocab_size)
    key = jax.random.PRNGKey(0)
    shaped = eqx.filter_eval_shape(lambda: add_adapters(lm_config.model_type.init(Vocab, lm_config, key=key), config))
    matched = adapted_modules(shaped)
    if not matched:
        every = dataclasses.replace(config, target_modules=None)
        linear = adapted_modules(eqx.filter_eval_shape(
            lambda: add_adapters(lm_config.model_type.init(Vocab, lm_config, key=key), every)))
        names = ", ".join(dict.fromkeys(p.rsplit(".", 1)[-1] for p in linear))
        raise ConfigError(f"{field}.target_modules", f"{config.target_modules!r} matches none of the model's "
                                                     f"{len(linear)} linear modules: nothing would be trained (they "
                                                     f"are {names}; paths like {linear[0]!r})")
    return matched


def trainable_filter(model):
    """Levanter's `is_trainable` filter tree: True on adapters, False on every base array."""
    return lora_trainable_params_filter(model)


def adapter_only(model):
    """The adapter arrays of an adapted model (every base array None): what a weight version carries."""
    return filter_lora_params(model)


def without_adapters(model):
    """The base of an adapted model (each LoraLinear replaced by the layer it wraps): no copy."""
    return jax.tree.map(lambda x: x.wrapped if isinstance(x, LoraLinear) else x, model, is_leaf=_is_lora_linear)


@eqx.filter_jit
def _merged_weights(nodes: list[LoraLinear]) -> list[hax.NamedArray]:
    out = []
    for node in nodes:
        weight = node.wrapped.weight
        delta = hax.dot(node.lora.lora_A.weight, node.lora.lora_B.weight, axis=node.lora.lora_A.Out) * node.lora.scale
        out.append((weight + delta.astype(weight.dtype)).rearrange(weight.axes))  # the base's layout
    return out


def merge_adapters(model):
    """A plain model: every LoraLinear replaced by its wrapped layer with weight `W + scale·A·B`, in W's
    dtype and axis order. Only those weights are computed (one jit); every other array is shared."""
    nodes = [x for x in jax.tree.leaves(model, is_leaf=_is_lora_linear) if isinstance(x, LoraLinear)]
    merged = iter(_merged_weights(nodes))
    return jax.tree.map(lambda x: dataclasses.replace(x.wrapped, weight=next(merged)) if isinstance(x, LoraLinear)
                        else x, model, is_leaf=_is_lora_linear)


def parameter_counts(model) -> tuple[int, int]:
    """(adapter parameters, all parameters) of an adapted model."""
    def count(tree):
        return int(sum(x.size for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))))

    return count(adapter_only(model)), count(model)


def describe(model, config: LoraRLConfig) -> str:
    adapter, total = parameter_counts(model)
    return (f"lora: rank {config.rank}, alpha {config.alpha:g}, {len(adapted_modules(model))} modules adapted, "
            f"{adapter:,} of {total:,} parameters trained ({100 * adapter / max(total, 1):.2f}%)")


# ------------------------------------------------------------------------------------ rollout side


def published_adapters(base, config: LoraRLConfig):
    """`base` with adapters of `config`, in the dtype a trainer publishes them to this rollout side: the base's
    own when it has one floating dtype (docs/weight_transfer.md). A weight client's skeleton is its
    `adapter_only`."""
    adapted = add_adapters(base, config)
    dtypes = floating_dtypes(base)
    return cast_for_publish(adapted, dtypes[0]) if len(dtypes) == 1 else adapted


def adapter_client(weights: WeightTransferConfig, config: LoraRLConfig, base):
    """A weight client of adapter-only versions for adapters of `config` on `base`: its `model` is the version's
    adapter tree (`adapter_only`), as `adapter_stack.AdapterStack.with_adapter` takes it."""
    return build_client(weights, adapter_only(published_adapters(base, config)))


class AdapterMergingClient:
    """A weight-transfer client for adapter-only versions: holds the base the rollout worker loaded at
    start and returns each version merged into it (`model`: the merged model). Same interface as
    `WeightTransferClient` (poll, wait_for, wait_for_news, model, weight_step, version, metrics, close)."""

    def __init__(self, weights: WeightTransferConfig, config: LoraRLConfig, base):
        self._adapted = published_adapters(base, config)
        self._inner = build_client(weights, adapter_only(self._adapted))
        self.location = self._inner.location
        self.model = None
        self._merged_version = None
        self.last_merge_s = 0.0

    def _merged(self) -> WeightUpdate:
        if self._merged_version != self._inner.version:
            started = time.perf_counter()
            model = merge_adapters(eqx.combine(self._inner.model, self._adapted, is_leaf=is_lora_param))
            jax.block_until_ready(model)
            self.last_merge_s = time.perf_counter() - started
            self.model, self._merged_version = model, self._inner.version
        return WeightUpdate(self.model, self._inner.weight_step)

    def poll(self) -> WeightUpdate | None:
        return None if self._inner.poll() is None else self._merged()

    def wait_for(self, min_step: int, timeout_s: float, backoff=None) -> WeightUpdate:
        self._inner.wait_for(min_step, timeout_s, backoff)
        return self._merged()

    def wait_for_news(self, stop, backoff, max_s: float = float("inf")) -> None:
        self._inner.wait_for_news(stop, backoff, max_s)

    @property
    def adapter(self):
        """The adapter arrays of the version held (None before the first)."""
        return self._inner.model

    @property
    def weight_step(self) -> int | None:
        return self._inner.weight_step

    @property
    def version(self):
        return self._inner.version

    @property
    def failures(self) -> int:
        return self._inner.failures

    @property
    def metrics(self) -> dict[str, float]:
        return {**self._inner.metrics, "merge_s": self.last_merge_s}

    def close(self) -> None:
        self._inner.close()
