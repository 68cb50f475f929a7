"""The cached decoder forward the rollout sampler runs (`sampler.py`): a Levanter model's own modules (embedding,
norms, rotary embeddings, QK norms, activation, LM head) around its projections packed into plain matrices, and
the dense KV cache's layout on a mesh. The in-flight sampler (`inflight.py`) runs the same forward.

With adapters (`models/adapter_stack.py`: one base, K LoRA slots) each adapted projection adds its rows' own
low-rank term, unmerged (`adapter_rows.py`); without them nothing of it is traced."""

from __future__ import annotations

import math
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from marinrl.inference.adapter_rows import adapter_delta
from marinrl.inference.sampler_families import sampler_family
from marinrl.inference.sharding import DATA, MODEL


def _named(x, *axes):
    return hax.named(x, axes)


class PackedLayer(eqx.Module):
    """One layer's projections as plain [in, out] matrices, built once per call before the decode loop.

    Levanter keeps Linear weights out-first with named output axes; used as they are, XLA re-lays out
    every q/k/v/o weight on every decode step. Packed, each step runs four matmuls per layer (q|k|v
    fused, o, gate|up fused, down) on weights already in place. The fused weights keep the axis that
    tensor parallelism splits apart, qkv [embed, kv_head, (group + 2) * head] and gate_up
    [embed, 2, mlp], so that each device's slice holds whole heads and matching gate/up columns."""

    qkv: jax.Array
    qkv_bias: Optional[jax.Array]
    o: jax.Array
    o_bias: Optional[jax.Array]
    gate_up: jax.Array
    gate_up_bias: Optional[jax.Array]
    down: jax.Array
    down_bias: Optional[jax.Array]


def _in_out(linear, in_axes) -> tuple[jax.Array, Optional[jax.Array]]:
    """A haliax Linear's weight as [prod(in), prod(out)] (out axes in their declared order), and its bias."""
    in_names = [a.name for a in linear.weight.axes if a.name in in_axes]
    out_names = [a.name for a in linear.weight.axes if a.name not in in_axes]
    w = linear.weight.rearrange((*in_names, *out_names)).array
    n_in = math.prod(linear.weight.axis_size(n) for n in in_names)
    bias = None if linear.bias is None else linear.bias.rearrange(tuple(out_names)).array.reshape(-1)
    return w.reshape(n_in, -1), bias


def _cat(xs, shape, axis):
    """Each of `xs` reshaped to `shape`, concatenated along `axis`; None if the layer has no bias."""
    if any(x is None for x in xs):
        assert all(x is None for x in xs)
        return None
    return jnp.concatenate([x.reshape(shape) for x in xs], axis=axis)


def constrain(x, mesh: Optional[Mesh], *spec):
    """`x` laid out as PartitionSpec(*spec) on `mesh`; unchanged without a mesh. A mesh axis is dropped
    from the spec where it does not divide the dimension (e.g. 1 prompt row over a data axis of 2)."""
    if mesh is None or x is None:
        return x
    spec = tuple(a if a is None or x.shape[i] % mesh.shape[a] == 0 else None for i, a in enumerate(spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def pack_layer(layer, mesh: Optional[Mesh]) -> PackedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    n_kv = attn.config.KVHeads.size
    (q, qb), (k, kb), (v, vb) = (_in_out(p, ("embed",)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    o, ob = _in_out(attn.o_proj, ("heads", "head_size"))
    (g, gb), (u, ub) = (_in_out(p, ("embed",)) for p in (mlp.gate_proj, mlp.up_proj))
    d, db = _in_out(mlp.down_proj, ("mlp",))
    embed, n_mlp = g.shape
    qkv = _cat((q, k, v), (embed, n_kv, -1), axis=2)
    qkv_bias = _cat((qb, kb, vb), (n_kv, -1), axis=1)
    gate_up = _cat((g, u), (embed, 1, n_mlp), axis=1)
    gate_up_bias = _cat((gb, ub), (1, n_mlp), axis=0)
    return PackedLayer(
        constrain(qkv, mesh, None, MODEL, None), constrain(qkv_bias, mesh, MODEL, None),
        constrain(o, mesh, MODEL, None), ob,
        constrain(gate_up, mesh, None, None, MODEL), constrain(gate_up_bias, mesh, None, MODEL),
        constrain(d, mesh, MODEL, None), db,
    )


def _linear(x, w, b):
    y = jnp.matmul(x, w)
    return y if b is None else y + b


def _scores(q, k, scale, soft_cap, spec):
    """float32 attention scores of `q` against keys `k` by the einsum `spec`, scaled and soft-capped."""
    scores = jnp.einsum(spec, q, k, preferred_element_type=jnp.float32) * scale
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


class DenseAttention(eqx.Module):
    """Attention over one cache per row [B, KV, S, D]: the new keys and values are written at slot `write_at`,
    and each query attends to the slots `key_ok` [B, Q, S] allows. The prompts' prefill and the in-flight
    sampler's recompute run this."""

    write_at: jax.Array
    key_ok: jax.Array

    def __call__(self, q, k, v, cache, scale, soft_cap):
        """q [B, KV, G, Q, D]; k, v [B, KV, Q, D]; cache (keys, values) -> ([B, Q, KV*G*D], cache)."""
        k_cache = jax.lax.dynamic_update_slice_in_dim(cache[0], k, self.write_at, axis=2)
        v_cache = jax.lax.dynamic_update_slice_in_dim(cache[1], v, self.write_at, axis=2)
        scores = _scores(q, k_cache, scale, soft_cap, "bkgqd,bksd->bkgqs")
        scores = jnp.where(self.key_ok[:, None, None, :, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
        out = jnp.einsum("bkgqs,bksd->bqkgd", probs, v_cache)
        b, nq = out.shape[:2]
        return out.reshape(b, nq, -1), (k_cache, v_cache)


class GroupedDecodeAttention(eqx.Module):
    """One decode step of R = P × n rows, row i * n + j being sample j of prompt i, over a cache in two parts:
    each prompt's keys and values once [P, KV, S_p, D] (left-padded), and each row's generated ones in blocks
    [R, KV, T_b, D] (`scan_plan.decode_blocks`). The step's key and value go to generated slot `write_at`, which
    lies in block `block`; the query attends to its prompt's slots from its padding on (`prompt_ok` [R, S_p])
    and to the generated slots of blocks 0..`block` up to `write_at`. One softmax over every part, as over one
    cache (their shared max, then each part's exponentials against its values, normalized once in float32): a
    prompt's keys and values are read once for its n rows (one [n × G, D] query matrix per prompt and KV head),
    and a block no row has reached is not read. The blocks are whole arrays, never slices of one: a slice of
    the slot axis is a copy of what it keeps at every step (measured on an H200: a step of 256 rows took
    11.8 ms with a sliced window, where the bytes read allow 3.3 ms). No concatenation of the parts either: on
    a CPU that copy cost more than the sharing saved at the reference shape."""

    write_at: jax.Array
    prompt_ok: jax.Array
    block: int = eqx.field(static=True)
    block_starts: tuple[int, ...] = eqx.field(static=True)

    def __call__(self, q, k, v, cache, scale, soft_cap):
        """q [R, KV, G, 1, D]; k, v [R, KV, 1, D]; cache (prompt keys, prompt values, then each generated block's
        keys and values) -> ([R, 1, KV*G*D], cache)."""
        kp, vp, gen = write_generated_kv(cache, k, v, self.block, self.block_starts, self.write_at)
        b = self.block
        n_prompts, n_kv, s_p, _ = kp.shape
        rows, _, group, _, head = q.shape
        n = rows // n_prompts
        q = q[:, :, :, 0]  # [R, KV, G, D]
        # a prompt's n × G queries of each KV head as one matrix: [P, KV, n * G, D]
        grouped = q.reshape(n_prompts, n, n_kv, group, head).transpose(0, 2, 1, 3, 4).reshape(
            n_prompts, n_kv, n * group, head)
        s_prompt = _scores(grouped, kp, scale, soft_cap, "pkmd,pksd->pkms").reshape(
            n_prompts, n_kv, n, group, s_p).transpose(0, 2, 1, 3, 4).reshape(rows, n_kv, group, s_p)
        s_prompt = jnp.where(self.prompt_ok[:, None, None, :], s_prompt, -jnp.inf)
        s_gen = [_scores(q, gen[2 * i], scale, soft_cap, "rkgd,rksd->rkgs") for i in range(b + 1)]
        # earlier blocks are full: every slot holds a token
        slots = self.block_starts[b] + jnp.arange(gen[2 * b].shape[2])
        s_gen[b] = jnp.where(slots[None, None, None, :] <= self.write_at, s_gen[b], -jnp.inf)
        # one softmax over every part: their shared max, then each part's exponentials and sum
        top = s_prompt.max(-1, keepdims=True)
        for s_i in s_gen:
            top = jnp.maximum(top, s_i.max(-1, keepdims=True))
        e_prompt, e_gen = jnp.exp(s_prompt - top), [jnp.exp(s_i - top) for s_i in s_gen]
        total = e_prompt.sum(-1) + sum(e.sum(-1) for e in e_gen)  # [R, KV, G]
        dtype = vp.dtype
        e_prompt = e_prompt.astype(dtype).reshape(n_prompts, n, n_kv, group, s_p).transpose(0, 2, 1, 3, 4).reshape(
            n_prompts, n_kv, n * group, s_p)
        out = jnp.einsum("pkms,pksd->pkmd", e_prompt, vp, preferred_element_type=jnp.float32).reshape(
            n_prompts, n_kv, n, group, head).transpose(0, 2, 1, 3, 4).reshape(rows, n_kv, group, head)
        for i, e in enumerate(e_gen):
            out = out + jnp.einsum("rkgs,rksd->rkgd", e.astype(dtype), gen[2 * i + 1],
                                   preferred_element_type=jnp.float32)
        out = (out / total[..., None]).reshape(rows, n_kv * group * head)
        return out[:, None, :].astype(dtype), (kp, vp, *gen)


def _layer(layer, packed: PackedLayer, x, pos, cache, attention, adapters=None):
    """One decoder layer on x (batch, position, embed) at absolute positions `pos` (batch, position), attending
    with `attention` (`DenseAttention`, `GroupedDecodeAttention`) over this layer's `cache`, which it returns
    updated. Norms, rotary embeddings, QK norms and the activation are the layer's own modules. `adapters`:
    (this layer's `PackedAdapters`, the rows' mask [B, K·r]) or None."""
    lora, mask = (None, None) if adapters is None else adapters
    attn = layer.self_attn
    cfg = attn.config
    n_kv, group, head = cfg.KVHeads.size, cfg.QHeadsPerGroup.size, cfg.HeadSize.size
    residual = x
    h = layer.input_layernorm(x)
    qkv = jnp.einsum("bne,ekf->bnkf", h.array, packed.qkv)
    delta = None if lora is None else lora.qkv(h.array, mask, n_kv, (group * head, head, head))
    if delta is not None:
        qkv = qkv + delta
    if packed.qkv_bias is not None:
        qkv = qkv + packed.qkv_bias
    b, n = qkv.shape[:2]
    q_end, k_end = group * head, (group + 1) * head
    q = _named(qkv[..., :q_end].reshape(b, n, n_kv, group, head),
               "batch", "position", "kv_head", "q_heads_per_group", "head_size")
    k = _named(qkv[..., q_end:k_end], "batch", "position", "kv_head", "head_size")
    v = qkv[..., k_end:]
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.rot_embs is not None:
        q, k = attn.rot_embs(q, pos).astype(q.dtype), attn.rot_embs(k, pos).astype(k.dtype)
    cache_dtype = cache[0].dtype
    q = q.rearrange(("batch", "kv_head", "q_heads_per_group", "position", "head_size")).array
    k = k.rearrange(("batch", "kv_head", "position", "head_size")).array.astype(cache_dtype)
    v = jnp.transpose(v, (0, 2, 1, 3)).astype(cache_dtype)
    scale = cfg.scaling_factor if cfg.scaling_factor is not None else 1.0 / math.sqrt(head)
    out, cache = attention(q, k, v, cache, scale, cfg.logits_soft_cap)
    o = _linear(out.astype(x.dtype), packed.o, packed.o_bias)
    if lora is not None and lora.o is not None:
        o = o + adapter_delta(out.astype(x.dtype), lora.o, mask)
    attn_out = _named(o, "batch", "position", "embed")
    if getattr(layer, "post_attn_layernorm", None) is not None:  # Llama's hybrid_norm only
        attn_out = layer.post_attn_layernorm(attn_out)
    x = residual + attn_out
    residual = x
    h = layer.post_attention_layernorm(x).array
    gate_up = jnp.einsum("bne,etf->bntf", h, packed.gate_up)
    delta = None if lora is None else lora.gate_up(h, mask, gate_up.shape[-1])
    if delta is not None:
        gate_up = gate_up + delta
    if packed.gate_up_bias is not None:
        gate_up = gate_up + packed.gate_up_bias
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    act = layer.mlp.act(gate) * up
    down = _linear(act, packed.down, packed.down_bias)
    if lora is not None and lora.down is not None:
        down = down + adapter_delta(act, lora.down, mask)
    mlp_out = _named(down, "batch", "position", "embed")
    if getattr(layer, "post_mlp_layernorm", None) is not None:
        mlp_out = layer.post_mlp_layernorm(mlp_out)
    return residual + mlp_out, cache


def head_logits(h, lm_head, lm_head_float32: bool = False):
    """float32 logits h [B, E] · lm_head [E, V]. By default in the weights' dtype, the logits then cast (in a
    bfloat16 model: bfloat16 logits, ~3 significant digits); `lm_head_float32`: the same operands multiplied
    with float32 sums into float32 logits (products of bfloat16 values are exact in float32; `HIGHEST` keeps
    an accelerator from rounding float32 operands to bfloat16 passes)."""
    if not lm_head_float32:
        return jnp.matmul(h, lm_head).astype(jnp.float32)
    return jnp.matmul(h, lm_head, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def forward(model, layers, packed, lm_head, ids, pos, caches, attention, lm_head_float32: bool = False,
            adapters=None):
    """Embed `ids` (batch, position), run every layer with its cache and `attention`, return last-position
    logits [B, V] (float32; the head itself in float32 with `lm_head_float32`, `head_logits`) and the caches.
    `adapters` (`adapter_rows.RowAdapters`): each row's own LoRA adapter on top of the base, unmerged."""
    x = model.embeddings.embed(_named(ids, "batch", "position"))
    if sampler_family(model).embed_scale:  # Gemma: as its `activations` does, the factor in the embeddings' dtype
        x = x * jnp.sqrt(model.config.hidden_dim).astype(x.dtype)
    pos = _named(pos, "batch", "position")
    new_caches = []
    for i, (layer, p, cache) in enumerate(zip(layers, packed, caches)):
        x, cache = _layer(layer, p, x, pos, cache, attention,
                          None if adapters is None else (adapters.layers[i], adapters.mask))
        new_caches.append(cache)
    x = model.transformer.norm(x["position", -1])
    h = x.rearrange(("batch", "embed")).array
    logits = head_logits(h, lm_head, lm_head_float32)
    if adapters is not None and adapters.head is not None:
        logits = logits + adapters.head_logits(h, lm_head_float32)
    return logits, new_caches


def cache_layout(caches, mesh):
    """KV caches [rows, kv_head, slot, head] (per layer a tuple of them: prompt and generated keys and values, or
    one cache's): heads over the model axis, rows (or prompts) over the data axis."""
    return [tuple(constrain(c, mesh, DATA, MODEL, None, None) for c in cache) for cache in caches]


def write_generated_kv(cache, k, v, block: int, block_starts, write_at):
    """(prompt keys, prompt values, the generated blocks with this step's k, v written into block `block` at
    `write_at`): the cache write both decode attentions (XLA, decode_kernel.py) make first."""
    kp, vp, *gen = cache
    start = block_starts[block]
    gen[2 * block] = jax.lax.dynamic_update_slice_in_dim(gen[2 * block], k, write_at - start, axis=2)
    gen[2 * block + 1] = jax.lax.dynamic_update_slice_in_dim(gen[2 * block + 1], v, write_at - start, axis=2)
    return kp, vp, gen
