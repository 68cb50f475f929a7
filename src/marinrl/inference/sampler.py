"""A lean batch sampler for rollouts: one jitted program per shape bucket that prefills left-padded
prompts once, copies their KV cache to the `n` samples of each prompt, and decodes all rows in a
`lax.while_loop` over a dense KV cache until every row has stopped.

It runs a Levanter Llama-family model's own modules (embedding, norms, `Attention._compute_qkv` for
the projections and rotary embeddings, `o_proj`, MLP, LM head); only the cached attention is written
here. Logprobs are those of the sampled token under the temperature-scaled distribution,
log softmax(logits / T), in float32: the same numbers a full forward pass gives (tests check this).
At temperature 0 the token is the argmax and its logprob is taken at T = 1, as Levanter's sampler does.

Why not Levanter's `InferenceEngine` for rollouts: at the reference shape of BENCHMARK.md (64
sequences of 16 + 32 tokens on 2 CPU cores) the engine's paged scheduler spends most of its time in
per-token bookkeeping (queues, page tables, host round trips between rounds), about 3-5k tokens/s,
while a dense cache sized for the batch needs none of it. docs/inference.md has the measurements.
The engine still serves the OpenAI-compatible endpoint, where requests arrive one by one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.models.llama import LlamaLMHeadModel

STOP_PAD = -1
"""Left padding of a stop sequence: matches anything."""
TOKEN_PAD = -2
"""Filler of the output buffer before the first generated token and after a row stops."""


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Host arrays for R = len(prompts) * n rows, row i * n + j being sample j of prompt i."""

    tokens: np.ndarray
    """int32 [R, T] generated tokens; only the first `lengths[r]` of each row are meaningful."""
    logprobs: np.ndarray
    """float32 [R, T]."""
    lengths: np.ndarray
    """int32 [R] number of generated tokens, the stopping token or sequence included."""
    stopped: np.ndarray
    """bool [R] True where a stop sequence (EOS included) ended the row, False where the budget did."""


def check_supported(model) -> None:
    """Raise a clear error if `model` is not one this sampler runs exactly."""
    if not isinstance(model, LlamaLMHeadModel):
        raise NotImplementedError(
            f"the scan sampler runs Llama-family models, got {type(model).__name__}; use backend='engine'"
        )
    if getattr(model.config, "sliding_window", None) is not None:
        raise NotImplementedError("the scan sampler has no sliding-window attention; use backend='engine'")


def bucket(x: int, minimum: int = 1) -> int:
    """Shape bucket: the next power of two up to 64, then the next multiple of 64. Few distinct shapes
    means few compiles; the padding costs at most a factor 2 on tiny batches and 1.5% at large ones."""
    x = max(x, minimum)
    if x <= 64:
        return 1 << (x - 1).bit_length()
    return 64 * math.ceil(x / 64)


def sample(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    stop_sequences: Sequence[Sequence[int]],
    seed: int,
) -> SampleOutput:
    """`n` samples of each prompt, all in one device call. A row ends at the first occurrence of any of
    `stop_sequences` inside its generated tokens (which it includes), or after `max_tokens` tokens.

    Sample j of prompt i depends only on (seed, i, j), the prompt and the model, not on the other
    prompts of the call."""
    n_prompts = len(prompts)
    if n_prompts == 0:
        return SampleOutput(
            np.zeros((0, max_tokens), np.int32), np.zeros((0, max_tokens), np.float32),
            np.zeros((0,), np.int32), np.zeros((0,), bool),
        )
    lens = np.array([len(p) for p in prompts], dtype=np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    b_prompts = bucket(n_prompts)
    p_len = bucket(int(lens.max()), 16)
    t_len = bucket(max_tokens, 16)
    ids = np.zeros((b_prompts, p_len), dtype=np.int32)
    for i, p in enumerate(prompts):
        ids[i, p_len - len(p):] = np.asarray(p, dtype=np.int32)
    all_lens = np.ones((b_prompts,), dtype=np.int32)
    all_lens[:n_prompts] = lens
    active = np.arange(b_prompts) < n_prompts

    s_max = max((len(s) for s in stop_sequences), default=1)
    stops = np.full((bucket(max(len(stop_sequences), 1)), bucket(s_max)), STOP_PAD, dtype=np.int32)
    stop_valid = np.zeros((stops.shape[0],), dtype=bool)
    for k, s in enumerate(stop_sequences):
        stops[k, stops.shape[1] - len(s):] = np.asarray(s, dtype=np.int32)
        stop_valid[k] = True

    out = _generate(
        model,
        jnp.asarray(ids),
        jnp.asarray(all_lens),
        jnp.asarray(active),
        jnp.asarray(stops),
        jnp.asarray(stop_valid),
        jnp.asarray(max_tokens, dtype=jnp.int32),
        jnp.asarray(temperature, dtype=jnp.float32),
        jnp.asarray(seed % (1 << 32), dtype=jnp.uint32),
        n=n,
        max_new=t_len,
    )
    tokens, logprobs, lengths, stopped = jax.device_get(out)
    rows = n_prompts * n
    return SampleOutput(
        tokens=np.asarray(tokens[:rows, :max_tokens], dtype=np.int32),
        logprobs=np.asarray(logprobs[:rows, :max_tokens], dtype=np.float32),
        lengths=np.asarray(lengths[:rows], dtype=np.int32),
        stopped=np.asarray(stopped[:rows], dtype=bool),
    )


def compiled_shapes() -> int:
    """How many shape buckets the sampler has compiled in this process (a reload must not add one)."""
    return _generate._cache_size()


# ----------------------------------------------------------------------------------------- device


def _named(x, *axes):
    return hax.named(x, axes)


def _attend(q, k_cache, v_cache, key_ok, scale, soft_cap):
    """q [B, KV, G, Q, D]; caches [B, KV, S, D]; key_ok [B, Q, S] -> [B, Q, KV*G, D] (float32 softmax).
    The cache keeps (batch, kv_head) in front so both products are plain batched matmuls."""
    scores = jnp.einsum("bkgqd,bksd->bkgqs", q, k_cache, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(key_ok[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgqs,bksd->bqkgd", probs, v_cache)
    b, nq, kv, g, d = out.shape
    return out.reshape(b, nq, kv * g, d)


def _layer(layer, x, pos, k_cache, v_cache, write_at, key_ok):
    """One decoder layer on x (batch, position, embed) at absolute positions `pos` (batch, position).
    Writes the new keys/values into the caches at slot `write_at` and attends over the cache."""
    attn = layer.self_attn
    residual = x
    h = layer.input_layernorm(x)
    q, k, v = attn._compute_qkv(h, key=None, pos_ids=pos)
    q = q.rearrange(("batch", "kv_head", "q_heads_per_group", "position", "head_size")).array
    k = k.rearrange(("batch", "kv_head", "position", "head_size")).array.astype(k_cache.dtype)
    v = v.rearrange(("batch", "kv_head", "position", "head_size")).array.astype(v_cache.dtype)
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k, write_at, axis=2)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v, write_at, axis=2)
    cfg = attn.config
    scale = cfg.scaling_factor if cfg.scaling_factor is not None else 1.0 / math.sqrt(cfg.HeadSize.size)
    out = _attend(q, k_cache, v_cache, key_ok, scale, cfg.logits_soft_cap)
    out = _named(out.astype(x.dtype), "batch", "position", "heads", "head_size")
    attn_out = attn.o_proj(out)
    if layer.post_attn_layernorm is not None:
        attn_out = layer.post_attn_layernorm(attn_out)
    x = residual + attn_out
    residual = x
    mlp_out = layer.mlp(layer.post_attention_layernorm(x))
    if layer.post_mlp_layernorm is not None:
        mlp_out = layer.post_mlp_layernorm(mlp_out)
    return residual + mlp_out, k_cache, v_cache


def _forward(model, ids, pos, caches, write_at, key_ok):
    """Embed `ids` (batch, position), run every layer with the cache, return last-position logits [B, V]."""
    x = model.embeddings.embed(_named(ids, "batch", "position"))
    pos = _named(pos, "batch", "position")
    new_caches = []
    for layer, (kc, vc) in zip(model.transformer.layers.unstacked(), caches):
        x, kc, vc = _layer(layer, x, pos, kc, vc, write_at, key_ok)
        new_caches.append((kc, vc))
    x = model.transformer.norm(x["position", -1])
    logits = model.lm_head(x) if model.lm_head is not None else model.embeddings.unembed(x)
    return logits.rearrange(("batch", "vocab")).array.astype(jnp.float32), new_caches


def _pick(logits, temperature, u):
    """Sample one token per row from logits [R, V] given one uniform number per row u [R]; returns
    (tokens, logprobs at the sampling temperature).

    Inverse-CDF sampling needs one uniform number per row, not one per vocabulary entry as Gumbel-max
    does; all of them are drawn before the decode loop, so no PRNG runs inside it (on a CPU, PRNG
    hashing was the largest cost of a decode step at small model sizes)."""
    greedy = temperature == 0
    logp = jax.nn.log_softmax(logits / jnp.where(greedy, 1.0, temperature), axis=-1)
    cdf = jnp.cumsum(jnp.exp(logp), axis=-1)
    sampled = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    # u * total can round up to total: fall back to the most likely token (never a zero-probability one)
    sampled = jnp.where(sampled >= logits.shape[-1], jnp.argmax(logp, axis=-1), sampled)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("n", "max_new"))
def _generate(model, ids, lens, active, stops, stop_valid, budget, temperature, seed, *, n, max_new):
    b_prompts, p_len = ids.shape
    rows = b_prompts * n
    s_len = p_len + max_new
    stop_len = stops.shape[1]
    cfg = model.config
    kv_heads, head = cfg.num_kv_heads, cfg.actual_head_size
    dtype = model.embeddings.token_embeddings.weight.dtype

    # ---- prefill the prompts once (left-padded: prompt i occupies slots [p_len - lens[i], p_len))
    pad = p_len - lens
    slots = jnp.arange(p_len)
    pos = jnp.maximum(slots[None, :] - pad[:, None], 0)
    kslots = jnp.arange(s_len)
    key_ok = (kslots[None, None, :] >= pad[:, None, None]) & (kslots[None, None, :] <= slots[None, :, None])
    key_ok = key_ok | (kslots[None, None, :] == slots[None, :, None])  # pad queries see themselves: no NaN
    empty = jnp.zeros((b_prompts, kv_heads, s_len, head), dtype)
    caches = [(empty, empty) for _ in range(cfg.num_layers)]
    logits, caches = _forward(model, ids, pos, caches, 0, key_ok)

    # ---- n rows per prompt: row i * n + j is sample j of prompt i, with its own key
    expand = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
    caches = [(expand(kc), expand(vc)) for kc, vc in caches]
    logits, pad, lens, active = expand(logits), expand(pad), expand(lens), expand(active)
    base = jax.random.PRNGKey(seed)
    prompt_idx = jnp.arange(rows) // n
    sample_idx = jnp.arange(rows) % n
    keys = jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(base, i), j))(prompt_idx, sample_idx)
    uniforms = jax.vmap(lambda k: jax.random.uniform(k, (max_new,)))(keys)  # [rows, max_new]

    # Output buffer with stop_len - 1 filler columns in front, so the window of the last stop_len tokens
    # ending at step t is columns [t, t + stop_len): stop sequences only match generated tokens.
    out_tokens = jnp.full((rows, stop_len - 1 + max_new), TOKEN_PAD, jnp.int32)
    out_logprobs = jnp.zeros((rows, max_new), jnp.float32)
    lengths = jnp.zeros((rows,), jnp.int32)
    done = ~active
    stopped = jnp.zeros((rows,), bool)

    def record(t, tok, lp, out_tokens, out_logprobs, lengths, done, stopped):
        tok = jnp.where(done, TOKEN_PAD, tok)
        out_tokens = jax.lax.dynamic_update_slice_in_dim(out_tokens, tok[:, None], stop_len - 1 + t, axis=1)
        out_logprobs = jax.lax.dynamic_update_slice_in_dim(out_logprobs, jnp.where(done, 0.0, lp)[:, None], t, axis=1)
        lengths = jnp.where(done, lengths, t + 1)
        window = jax.lax.dynamic_slice_in_dim(out_tokens, t, stop_len, axis=1)
        match = (stops[None, :, :] == STOP_PAD) | (window[:, None, :] == stops[None, :, :])
        hit = jnp.any(jnp.all(match, axis=-1) & stop_valid[None, :], axis=-1) & ~done
        stopped = stopped | hit
        done = done | hit | (lengths >= budget)
        return out_tokens, out_logprobs, lengths, done, stopped

    tok, lp = _pick(logits, temperature, uniforms[:, 0])
    state = record(0, tok, lp, out_tokens, out_logprobs, lengths, done, stopped)

    def cond(carry):
        t, _, _, _, _, _, done, _ = carry
        return (t < max_new) & ~jnp.all(done)

    def body(carry):
        t, tok, caches, out_tokens, out_logprobs, lengths, done, stopped = carry
        write_at = p_len + t - 1  # slot of the token sampled at step t - 1
        step_pos = (lens + t - 1)[:, None]
        key_ok = (jnp.arange(s_len)[None, :] >= pad[:, None]) & (jnp.arange(s_len)[None, :] <= write_at)
        logits, caches = _forward(model, tok[:, None], step_pos, caches, write_at, key_ok[:, None, :])
        tok, lp = _pick(logits, temperature, jax.lax.dynamic_index_in_dim(uniforms, t, axis=1, keepdims=False))
        state = record(t, tok, lp, out_tokens, out_logprobs, lengths, done, stopped)
        return (t + 1, tok, caches, *state)

    carry = (jnp.asarray(1, jnp.int32), tok, caches, *state)
    _, _, _, out_tokens, out_logprobs, lengths, _, stopped = jax.lax.while_loop(cond, body, carry)
    return out_tokens[:, stop_len - 1:], out_logprobs, lengths, stopped
