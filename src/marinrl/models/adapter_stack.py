"""Many agents, one base: K LoRA adapters held next to one frozen base, never merged into it.

`AdapterStack` holds the served base (a plain model, as loaded) and `StackedAdapters`: for every adapted
`Linear`, the K slots' A matrices stacked along a leading `adapter` axis ([K, (layer,) r, in] in Levanter's
names) and their B matrices likewise ([K, (layer,) out, r]), with one scale alpha / r per slot (`scales`
[K]). The structure is Levanter's own adapter tree (`lora.adapter_only` of the base with `lora.add_adapters`),
so a weight version of a `lora` policy model's stream (the adapter arrays alone, `lora.adapter_client`) goes into
a slot as it arrives: a rollout worker serves its `lora` policy models so (`rollout/shared_base.py`). All slots
share the stack's `LoraRLConfig` (its targets and rank: the arrays' shapes); a slot's scale is its own.

- **One slot at a time.** `with_adapter(k, adapter)` writes slot k's A and B and scale in one jitted update
  whose stacked inputs are donated (in place where the backend allows it): the base and the other slots are
  untouched, nothing is merged. The stack it was called on is consumed (its adapter arrays are donated).
- **No adapter.** An empty slot (`empty`, `without_adapter`) holds zeros and scale 0; a row routed to it, or
  to index -1, runs the base alone.
- **Sampling.** The scan sampler takes the stack's `adapters` and one slot index per prompt
  (`inference/sampler.py`, `adapter_index`) and applies each row's adapter unmerged in every adapted layer:
  `x·W + s_i·((x·A_i)·B_i)` (`inference/decoder.py`, `PackedAdapters`), so one batch mixes rows of every
  adapter on one copy of the base.
- **The trainer's layout** (`stacked_adapters`): the base with Levanter's LoraLinear modules whose A and B
  carry the same leading `adapter` axis, trained by one trainer (`train/adapter_slots.py`); `slot_adapters`
  takes slot k out of it, as its weight stream and a PEFT export carry it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax.util import is_named_array
from levanter.lora import LORA_R, LoraLinear, is_lora_param

from marinrl.config.lora import LoraRLConfig
from marinrl.models.lora import adapter_only, add_adapters
from marinrl.transfer.base import floating_dtypes

ADAPTER = "adapter"
"""The name of the stacked adapters' leading axis: one entry per slot."""

__all__ = ["ADAPTER", "AdapterStack", "StackedAdapters", "stacked_adapters", "slot_adapters", "adapted_model"]


def _weights(tree) -> list[hax.NamedArray]:
    """The adapter tree's A and B weights (NamedArrays), in tree order; every other leaf is left out."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_named_array) if is_named_array(x)]


def _only_weights(tree):
    """`tree` with every leaf that is not a NamedArray (e.g. a Dropout's flag) replaced by None."""
    return jax.tree.map(lambda x: x if is_named_array(x) else None, tree, is_leaf=is_named_array)


class StackedAdapters(eqx.Module):
    """K adapters of one shape, as the sampler reads them: `lora`, an adapter tree (`lora.adapter_only`'s
    structure, LoraLinear nodes whose base weights are None) whose A and B carry a leading `adapter` axis, and
    `scales`, float32 [K], slot k's alpha / r (0 for an empty slot). The LoraLinear nodes' own static `scale`
    is the stack config's and is not read: `scales` is."""

    lora: Any
    scales: jax.Array

    @property
    def slots(self) -> int:
        return int(self.scales.shape[0])

    @property
    def rank(self) -> int:
        return _weights(self.lora)[0].axis_size(LORA_R)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _set_slot(stacked: list, scales, new: list, scale, k):
    """Slot k of each stacked array set to the matching new one (same axis order after the slot axis)."""
    return [s.at[k].set(x.astype(s.dtype)) for s, x in zip(stacked, new)], scales.at[k].set(scale)


class AdapterStack(eqx.Module):
    """One base and K adapter slots (`StackedAdapters`), never merged. Immutable like any equinox module:
    `with_adapter` and `without_adapter` return the new stack (module doc)."""

    base: Any
    """The served model, as loaded: no adapter in it, never copied."""
    adapters: StackedAdapters
    config: LoraRLConfig = eqx.field(static=True)

    @classmethod
    def empty(cls, base, config: LoraRLConfig, slots: int) -> AdapterStack:
        """`slots` empty slots (zeros, scale 0) for adapters of `config` on `base`, in the base's dtype (a base
        of mixed floating dtypes: float32)."""
        if slots < 1:
            raise ValueError(f"an adapter stack needs at least one slot, got {slots}")
        config.errors()
        shape = eqx.filter_eval_shape(lambda: _only_weights(adapter_only(add_adapters(base, config))))
        dtypes = floating_dtypes(base)
        dtype = jnp.dtype(dtypes[0]) if len(dtypes) == 1 else jnp.float32
        slot = hax.Axis(ADAPTER, slots)
        lora = jax.tree.map(lambda w: hax.zeros((slot, *w.axes), dtype), shape, is_leaf=is_named_array)
        if not _weights(lora):
            raise ValueError(f"lora.target_modules {config.target_modules!r} adapts no linear module of the base")
        return cls(base, StackedAdapters(lora, jnp.zeros((slots,), jnp.float32)), config)

    @property
    def slots(self) -> int:
        return self.adapters.slots

    def with_adapter(self, k: int, adapter, scale: Optional[float] = None) -> AdapterStack:
        """The stack with slot k holding `adapter` (an adapter tree of this stack's config: `lora.adapter_only`
        of an adapted model, what an adapter-only weight version carries) and `scale` (default: the config's
        alpha / r). Only slot k changes; this stack's adapter arrays are donated to the new one."""
        self._check_slot(k)
        new = _weights(adapter)
        stacked = _weights(self.adapters.lora)
        if len(new) != len(stacked) or any(set(w.axes) != set(s.axes[1:]) for w, s in zip(new, stacked)):
            raise ValueError(f"the adapter for slot {k} does not have this stack's shapes (rank {self.config.rank}, "
                             f"target_modules {self.config.target_modules!r}): {len(new)} arrays, "
                             f"{[tuple(a.name for a in w.axes) for w in new][:2]}...")
        scale = self.config.scale if scale is None else float(scale)
        return self._set(k, [w.rearrange(s.axes[1:]).array for w, s in zip(new, stacked)], scale)

    def without_adapter(self, k: int) -> AdapterStack:
        """The stack with slot k empty: rows routed to it run the base alone."""
        self._check_slot(k)
        return self._set(k, [jnp.zeros(s.array.shape[1:], s.dtype) for s in _weights(self.adapters.lora)], 0.0)

    def adapter(self, k: int):
        """Slot k's adapter tree (`lora.adapter_only`'s structure, the slot axis taken out)."""
        self._check_slot(k)
        return jax.tree.map(lambda s: s[ADAPTER, k], self.adapters.lora, is_leaf=is_named_array)

    def adapted(self, k: int):
        """The base with slot k's adapter as Levanter's LoraLinear modules (unmerged; Levanter's own forward
        applies it): the model a row routed to k samples from. For checks and references."""
        adapted = eqx.combine(_only_weights(self.adapter(k)), add_adapters(self.base, self.config))
        scale = float(self.adapters.scales[k])
        return jax.tree.map(lambda x: _rescaled(x, scale) if isinstance(x, LoraLinear) else x, adapted,
                            is_leaf=lambda x: isinstance(x, LoraLinear))

    def _set(self, k: int, arrays: list, scale: float) -> AdapterStack:
        stacked = _weights(self.adapters.lora)
        arrays = [jnp.asarray(a) for a in arrays]
        out, scales = _set_slot([s.array for s in stacked], self.adapters.scales, arrays, jnp.float32(scale),
                                jnp.int32(k))
        new = iter(hax.NamedArray(a, s.axes) for a, s in zip(out, stacked))
        lora = jax.tree.map(lambda s: next(new), self.adapters.lora, is_leaf=is_named_array)
        return AdapterStack(self.base, StackedAdapters(lora, scales), self.config)

    def _check_slot(self, k: int) -> None:
        if not 0 <= k < self.slots:
            raise IndexError(f"slot {k} is not one of this stack's {self.slots} (0..{self.slots - 1})")


def _rescaled(node: LoraLinear, scale: float) -> LoraLinear:
    return eqx.tree_at(lambda n: n.lora, node, type(node.lora)(node.lora.lora_A, node.lora.lora_B,
                                                               node.lora.dropout, scale))


# ------------------------------------------------------------------------------- the trainer's layout


def _stack_leaf(*xs):
    return hax.stack(ADAPTER, xs) if is_named_array(xs[0]) else xs[0]


def stacked_adapters(base, configs: Sequence[LoraRLConfig]):
    """`base` with K adapters stacked on the `adapter` axis, slot k as `add_adapters(base, configs[k])` makes it
    (its own seed's A, B zero): weight step 0 of every slot is the base. The configs differ in `seed` only."""
    shapes = {(c.rank, c.alpha, c.target_modules) for c in configs}
    if len(shapes) != 1:
        raise ValueError(f"the adapters of one base must share rank, alpha and target_modules, got {sorted(shapes)}")
    adapted = [add_adapters(base, c) for c in configs]
    lora = jax.tree.map(_stack_leaf, *[adapter_only(m) for m in adapted], is_leaf=is_named_array)
    return eqx.combine(lora, adapted[0], is_leaf=is_lora_param)


def slot_adapters(adapters, k: int):
    """Slot k's adapter tree (`lora.adapter_only`'s structure without the `adapter` axis) of a stacked one."""
    return jax.tree.map(lambda x: x[ADAPTER, k] if is_named_array(x) and x.array is not None else x, adapters,
                        is_leaf=is_named_array)


def adapted_model(model, adapters: LoraRLConfig | Sequence[LoraRLConfig] | None):
    """`model` as a trainer trains it: unchanged (None: every weight), with one adapter (`lora.add_adapters`), or
    with several stacked on one base (`stacked_adapters`, one config each)."""
    if adapters is None:
        return model
    if isinstance(adapters, LoraRLConfig):
        return add_adapters(model, adapters)
    return stacked_adapters(model, adapters)
