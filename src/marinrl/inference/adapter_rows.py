"""Each row's own LoRA adapter in the scan sampler's forward (`decoder.py`), unmerged: one base, K adapter slots
(`models/adapter_stack.py`), one batch that mixes rows of every slot.

Row i routed to slot k computes, in every adapted projection, `x·W + s_k·((x·A_k)·B_k)` with the base's W
and the slot's A [in, r], B [r, out] and scale s_k = alpha / r; a row of slot -1, or of an empty slot (zeros),
gets an exact zero term: the base alone. Without adapters none of this is traced (`decoder.forward`'s default).

How the K slots are applied: as one adapter of rank K·r whose columns outside a row's slot are multiplied by
0 (`row_mask`). Each adapted projection is two plain matmuls, x [rows, in] · A [in, K·r] then · B [K·r, out],
and every slot's weights are read once per decode step, as the base's are. The alternative, gathering each
row's own A and B (an einsum with a gathered [rows, in, r]), moves rows × (in + out) × r values per projection
and step, more than the whole stack holds once rows exceed K; the masked product instead spends
K·r·(in + out) multiply-adds per row where one adapter needs r·(in + out), small next to the base's in·out
while K·r stays well under the model's width (e.g. 16 slots of rank 8 on a 4096-wide model: 3% more than the
base's). Many more slots than that would want a grouped (segment) matmul instead.
"""

from __future__ import annotations

import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from levanter.lora import LORA_R, LoraLinear


class PackedAdapters(eqx.Module):
    """One layer's K adapters, per projection (a [in, K·r], b [K·r, out]) in its packed matrix's layout (the
    input and output flattened as `_in_out` flattens the base weight's), None where it has no adapter."""

    q: Optional[tuple]
    k: Optional[tuple]
    v: Optional[tuple]
    o: Optional[tuple]
    gate: Optional[tuple]
    up: Optional[tuple]
    down: Optional[tuple]

    def qkv(self, h, mask, n_kv: int, widths: tuple[int, int, int]):
        """The q|k|v term [B, N, KV, (G + 2)·D] of h [B, N, E] as the fused projection lays it out; None without
        an adapter on any of the three."""
        if self.q is None and self.k is None and self.v is None:
            return None
        b, n = h.shape[:2]
        return jnp.concatenate([jnp.zeros((b, n, n_kv, w), h.dtype) if p is None else
                                adapter_delta(h, p, mask).reshape(b, n, n_kv, w)
                                for p, w in zip((self.q, self.k, self.v), widths)], axis=-1)

    def gate_up(self, h, mask, n_mlp: int):
        """The gate|up term [B, N, 2, M] of h [B, N, E]; None without an adapter on either."""
        if self.gate is None and self.up is None:
            return None
        zero = jnp.zeros((*h.shape[:2], n_mlp), h.dtype)
        return jnp.stack([zero if p is None else adapter_delta(h, p, mask) for p in (self.gate, self.up)], axis=2)


class RowAdapters(eqx.Module):
    """The adapters of one forward's rows: every layer's `PackedAdapters`, the LM head's (a, b) or None, and
    `mask` [B, K·r], row b's slot scale on its slot's r columns and 0 on every other (`row_mask`)."""

    layers: list
    head: Optional[tuple]
    mask: jax.Array

    def head_logits(self, h, lm_head_float32: bool = False):
        """The head's term, float32 [B, V], of h [B, E]: like `decoder.head_logits`, in the weights' dtype then
        cast, or with float32 sums (`lm_head_float32`)."""
        if not lm_head_float32:
            return adapter_delta(h, self.head, self.mask).astype(jnp.float32)
        return adapter_delta(h, self.head, self.mask, jax.lax.Precision.HIGHEST, jnp.float32)


def adapter_delta(x, adapter, mask, precision=None, dtype=None):
    """s·((x·A)·B) of each row's slot, in x's dtype (or `dtype`, the products' accumulation type): x [B, ..., in],
    adapter (A [in, K·r], B [K·r, out]), mask [B, K·r] (`row_mask`)."""
    a, b = adapter
    z = jnp.matmul(x, a, precision=precision, preferred_element_type=dtype)
    z = z * mask.reshape(mask.shape[0], *(1,) * (x.ndim - 2), -1).astype(z.dtype)
    out = jnp.matmul(z, b, precision=precision, preferred_element_type=dtype)
    return out.astype(x.dtype if dtype is None else dtype)


def row_mask(scales, index, rank: int):
    """[B, K·r]: for row b, `scales[index[b]]` on the r columns of slot index[b] and 0 elsewhere (index -1: all
    0, the base alone), in the (slot, r) order of the packed A's columns."""
    slots = scales.shape[0]
    per_slot = jnp.where(index[:, None] == jnp.arange(slots)[None, :], scales[None, :], 0.0)
    return jnp.repeat(per_slot, rank, axis=1)


def _adapter_in_out(node, base, in_axes):
    """A LoraLinear's stacked A and B as (A [in, K·r], B [K·r, out]): in and out flattened in the order
    `_in_out` gives the base weight `base`'s, the columns of A (rows of B) slot-major."""
    in_names = [a.name for a in base.weight.axes if a.name in in_axes]
    out_names = [a.name for a in base.weight.axes if a.name not in in_axes]
    slot = node.lora.lora_A.weight.axes[0].name  # the stack's slot axis leads (`adapter_stack.ADAPTER`)
    a = node.lora.lora_A.weight.rearrange((*in_names, slot, LORA_R)).array
    b = node.lora.lora_B.weight.rearrange((slot, LORA_R, *out_names)).array
    n_in = math.prod(base.weight.axis_size(n) for n in in_names)
    return a.reshape(n_in, -1), b.reshape(a.shape[-2] * a.shape[-1], -1)


_PROJECTIONS = (("q", "self_attn", "q_proj", ("embed",)), ("k", "self_attn", "k_proj", ("embed",)),
                ("v", "self_attn", "v_proj", ("embed",)), ("o", "self_attn", "o_proj", ("heads", "head_size")),
                ("gate", "mlp", "gate_proj", ("embed",)), ("up", "mlp", "up_proj", ("embed",)),
                ("down", "mlp", "down_proj", ("mlp",)))


def _is_lora(x) -> bool:
    return isinstance(x, LoraLinear)


def pack_adapters(adapters, model, layers, index) -> RowAdapters:
    """The stacked adapters (`adapter_stack.StackedAdapters`) of `model` (its unstacked `layers`) packed for
    `forward`'s rows, row b routed to slot index[b] (-1: none). NotImplementedError for an adapted module the
    sampler does not apply (every Linear of the sampler's families is one of q/k/v/o, gate/up/down, the head)."""
    lora_layers = adapters.lora.transformer.layers.unstacked()
    packed = []
    for layer, lora in zip(layers, lora_layers):
        found = {}
        for name, module, proj, in_axes in _PROJECTIONS:
            node = getattr(getattr(lora, module), proj)
            if isinstance(node, LoraLinear):
                found[name] = _adapter_in_out(node, getattr(getattr(layer, module), proj), in_axes)
        every = [x for x in jax.tree.leaves(lora, is_leaf=_is_lora) if _is_lora(x)]
        if len(every) != len(found):
            raise NotImplementedError(f"the scan sampler applies adapters on q/k/v/o and gate/up/down projections; "
                                      f"this layer has {len(every)} adapted modules, {len(found)} of them those")
        packed.append(PackedAdapters(**{name: found.get(name) for name, *_ in _PROJECTIONS}))
    head_node = getattr(adapters.lora, "lm_head", None)
    head = _adapter_in_out(head_node, model.lm_head, ("embed",)) if isinstance(head_node, LoraLinear) else None
    return RowAdapters(packed, head, row_mask(adapters.scales, index, adapters.rank))
