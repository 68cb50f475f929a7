"""A lean batch sampler for rollouts: one jitted program per shape bucket that prefills left-padded
prompts once, copies their KV cache to the `n` samples of each prompt, and decodes all rows in a
`lax.while_loop` over a dense KV cache until every row has stopped.

It runs a Levanter model's own modules (embedding, norms, rotary embeddings, QK norms, MLP activation,
LM head) around packed projections (`decoder.py`); only the cached attention is ours. Which models it runs,
and how each family differs from Llama's decoder, is `sampler_families.py`. Logprobs are those of the
sampled token under the temperature-scaled distribution, log softmax(logits / T), in float32: the same
numbers a full forward pass gives (tests check this). At temperature 0 the token is the argmax and
its logprob is taken at T = 1, as Levanter's sampler does.

Why not Levanter's `InferenceEngine` for rollouts: at the reference shape of docs/performance.md (64
sequences of 16 + 32 tokens on 2 CPU cores) the engine's paged scheduler spends most of its time in
per-token bookkeeping (queues, page tables, host round trips between rounds), about 3-5k tokens/s,
while a dense cache sized for the batch needs none of it. docs/inference.md has the measurements.
The engine still serves the OpenAI-compatible endpoint, where requests arrive one by one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Generator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from marinrl.inference.decode_kernel import decode_attention
from marinrl.inference.decoder import (
    DenseAttention,
    cache_layout,
    constrain,
    forward,
    pack_layer,
)
from marinrl.inference.picking import cumsum_last as _cumsum_last  # noqa: F401 - the sampler's, tested here
from marinrl.inference.picking import pick as _pick
from marinrl.inference.picking import picking
from marinrl.inference.sampler_families import check_window, sampler_family
from marinrl.inference.scan_plan import (
    CPU_CACHE_BYTES,
    CallPlan,
    bucket,
    decode_blocks,
    kv_bytes_per_prompt,
    plan_calls,
)
from marinrl.inference.sharding import DATA, MODEL

STOP_PAD = -1
"""Left padding of a stop sequence: matches anything."""
TOKEN_PAD = -2
"""Filler of the output buffer before the first generated token and after a row stops."""

logger = logging.getLogger(__name__)


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
    weight_steps: Optional[np.ndarray] = None
    """int64 [R, T] weight step of the weights that sampled each token, with in-flight swaps (`swaps`);
    None without."""


def check_supported(model) -> None:
    """Raise a clear error if `model` is not one this sampler runs exactly (`sampler_families`)."""
    sampler_family(model)


def call_plan(model, n_prompts: int, *, n: int, prompt_tokens: int, max_tokens: int, max_cache_bytes: int,
              min_prompts: int = 1, mesh: Optional[Mesh] = None) -> CallPlan:
    """How `sample` splits `n_prompts` prompts of up to `prompt_tokens` tokens into device calls
    (`scan_plan.plan_calls`): `max_cache_bytes` is one call's cache budget per device."""
    cfg = model.config
    attn = cfg.attention_config()  # every family's head sizes, as its attention module has them
    per_prompt = kv_bytes_per_prompt(
        layers=cfg.num_layers, kv_heads=attn.num_kv_heads, head_size=attn.head_size,
        itemsize=jnp.dtype(model.embeddings.token_embeddings.weight.dtype).itemsize,
        p_len=bucket(prompt_tokens, 16), t_len=bucket(max_tokens, 16), n=n)
    data, model_axis = (1, 1) if mesh is None else (mesh.shape[DATA], mesh.shape[MODEL])
    return plan_calls(prompts=n_prompts, n=n, per_prompt_bytes=per_prompt, budget_bytes=max_cache_bytes,
                      kv_heads=attn.num_kv_heads, data=data, model=model_axis, min_prompts=min_prompts)


def sample(model, prompts: Sequence[Sequence[int]], **kwargs) -> SampleOutput:
    """`sample_steps` run to the end: `n` samples of each prompt."""
    steps = sample_steps(model, prompts, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def sample_steps(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    stop_sequences: Sequence[Sequence[int]],
    seed: int,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    max_cache_bytes: int = CPU_CACHE_BYTES,
    prompt_keys: Optional[Sequence[tuple[int, int]]] = None,
    min_prompts: int = 1,
    mesh: Optional[Mesh] = None,
    dry_run: bool = False,
    swaps=None,
    lm_head_float32: bool = False,
    chunk_tokens: Optional[int] = None,
    attention: str = "xla",
) -> Generator[None, None, SampleOutput]:
    """`n` samples of each prompt, as a generator that yields after each device call and returns the
    `SampleOutput` (`sample` runs it to the end). A row ends at the first occurrence of any of `stop_sequences` inside
    its generated tokens (which it includes), or after `max_tokens` tokens.

    All prompts go to one device call unless their KV cache would exceed `max_cache_bytes` on a device
    (`call_plan`); then they are split into equal chunks that share one compiled shape. Sample j of
    prompt i depends only on (seed, i, j), the prompt and the model: not on the other prompts, nor on
    how they were chunked.
    `prompt_keys[i] = (seed_i, index_i)` replaces (seed, i) for prompt i, so that prompts of several
    HTTP requests, each with its own seed, share one device call and still get their own samples.
    `min_prompts` pads a call to at least that many prompt rows (within the cache budget): calls of
    varying small sizes then share one compiled shape.

    `mesh` (axes data, model; `sharding.rollout_mesh`): the model's weights are sharded over "model"
    (`sharding.place`), and so are the KV cache's heads; rows go over "data" when they divide evenly.
    The samples are those of one device: same tokens, logprobs within float32 rounding.

    `dry_run`: the same compiled program for the same shapes, but every row starts finished, so only
    the prompts' prefill runs and every row comes back empty (length 0): compiles a call's shapes
    ahead of time, e.g. before the policy's weights arrive (`marinrl/rollout/warmup.py`).

    `swaps` (`inflight.WeightSwaps`): in-flight weight updates. Generation runs in chunks of decode
    steps and takes newer weights between them (`model` is then ignored: `swaps.model` is used, and
    left at the newest weights); `weight_steps` says which weights sampled each token.

    `lm_head_float32`: the LM head's logits in float32 (`decoder.head_logits`), as a trainer with
    `model.lm_head_float32` computes its own.

    `top_k`, `top_p`, `min_p`: sample from the temperature-scaled distribution restricted to the tokens
    these filters keep (`_pick`), renormalized; the logprobs are those of that distribution.

    `chunk_tokens`: decode in device calls of that many steps, yielding between them (no in-flight swaps),
    so that a caller can run other work between the chunks of a long generation (the HTTP endpoint's
    `generate_queue`); the samples are those of one call.

    `attention`: how decode steps read the KV cache, `xla` or the GPU kernel (`decode_kernel.decode_attention`;
    the server resolves `inference.attention` with `decode_kernel.resolve_attention`)."""
    check_supported(model)
    n_prompts = len(prompts)
    if prompt_keys is None:
        prompt_keys = [(seed, i) for i in range(n_prompts)]
    if len(prompt_keys) != n_prompts:
        raise ValueError(f"prompt_keys has {len(prompt_keys)} entries for {n_prompts} prompts")
    key_seeds = np.array([k[0] % (1 << 32) for k in prompt_keys], dtype=np.uint32)
    key_index = np.array([k[1] for k in prompt_keys], dtype=np.int32)
    if swaps is not None and dry_run:
        swaps = None  # nothing is generated: nothing to swap
    if n_prompts == 0:
        return SampleOutput(
            np.zeros((0, max_tokens), np.int32), np.zeros((0, max_tokens), np.float32),
            np.zeros((0,), np.int32), np.zeros((0,), bool),
            None if swaps is None else np.zeros((0, max_tokens), np.int64),
        )
    lens = np.array([len(p) for p in prompts], dtype=np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    check_window(model, int(lens.max()), max_tokens)
    p_len = bucket(int(lens.max()), 16)
    t_len = bucket(max_tokens, 16)
    plan = call_plan(model, n_prompts, n=n, prompt_tokens=int(lens.max()), max_tokens=max_tokens,
                     max_cache_bytes=max_cache_bytes, min_prompts=min_prompts, mesh=mesh)
    chunk = plan.prompts_per_call
    if plan.calls > 1:
        logger.info("scan sampler: %d prompts x %d samples in %d calls of %d rows (cache %.2f GiB a device, "
                    "budget %.2f GiB)", n_prompts, n, plan.calls, plan.rows_per_call,
                    plan.per_device_cache_bytes / 2**30, max_cache_bytes / 2**30)
    greedy = temperature == 0

    stops, stop_valid = _stop_table(stop_sequences)
    shared = (jnp.asarray(stops), jnp.asarray(stop_valid), jnp.asarray(max_tokens, dtype=jnp.int32),
              picking(temperature, top_k, top_p, min_p))

    pieces = []
    for start in range(0, n_prompts, chunk):
        part = prompts[start:start + chunk]
        ids, part_lens, active, part_seeds, part_index = _call_rows(
            part, chunk, p_len, lens[start:], key_seeds[start:], key_index[start:], dry_run)
        args = (ids, part_lens, active, *shared, part_seeds, part_index)
        rows = len(part) * n
        if swaps is None and chunk_tokens is not None:
            out = yield from _generate_in_chunks(model, args, chunk_tokens, n=n, max_new=t_len, mesh=mesh,
                                                 lm_head_float32=lm_head_float32, greedy=greedy, attention=attention)
            steps = None
        elif swaps is None:
            out = _generate(model, *args, n=n, max_new=t_len, mesh=mesh, lm_head_float32=lm_head_float32,
                            greedy=greedy, attention=attention)
            steps = None
        else:
            *out, by_token = swaps.generate(*args, n=n, max_new=t_len, mesh=mesh,  # inflight.py builds on this module
                                            lm_head_float32=lm_head_float32, greedy=greedy, attention=attention)
            steps = np.broadcast_to(by_token[None, :max_tokens], (rows, max_tokens))
        tokens, logprobs, lengths, stopped = jax.device_get(tuple(out))
        pieces.append((tokens[:rows, :max_tokens], logprobs[:rows, :max_tokens], lengths[:rows], stopped[:rows],
                       steps))
        if start + chunk < n_prompts:
            yield
    return SampleOutput(
        tokens=np.concatenate([p[0] for p in pieces]).astype(np.int32),
        logprobs=np.concatenate([p[1] for p in pieces]).astype(np.float32),
        lengths=np.concatenate([p[2] for p in pieces]).astype(np.int32),
        stopped=np.concatenate([p[3] for p in pieces]).astype(bool),
        weight_steps=None if swaps is None else np.concatenate([p[4] for p in pieces]).astype(np.int64),
    )


def _generate_in_chunks(model, args, chunk_tokens: int, *, n, max_new, mesh, lm_head_float32, greedy, attention="xla"):
    """`_generate` as device calls of at most `chunk_tokens` decode steps, yielding between them; what it returns.
    Rows step in lockstep, so `t` (the next step) and whether every row is done say when to stop."""
    ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index = args
    state = _start_call(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index,
                        n=n, max_new=max_new, mesh=mesh, lm_head_float32=lm_head_float32, greedy=greedy)
    t, finished = 1, False  # the prefill sampled token 0
    while t < max_new and not finished:
        yield
        state = _decode_call(model, state, stops, stop_valid, budget, temperature,
                             jnp.asarray(t + chunk_tokens, jnp.int32), mesh=mesh, lm_head_float32=lm_head_float32,
                             greedy=greedy, attention=attention)
        t, finished = jax.device_get((state["t"], jnp.all(state["done"])))
        t = int(t)
    return _outputs(state, stops)


def _stop_table(stop_sequences) -> tuple[np.ndarray, np.ndarray]:
    """Stop sequences as a left-padded table [bucket(k), bucket(longest)] (`STOP_PAD` matches anything) and which
    of its rows are real."""
    s_max = max((len(s) for s in stop_sequences), default=1)
    stops = np.full((bucket(max(len(stop_sequences), 1)), bucket(s_max)), STOP_PAD, dtype=np.int32)
    stop_valid = np.zeros((stops.shape[0],), dtype=bool)
    for k, s in enumerate(stop_sequences):
        stops[k, stops.shape[1] - len(s):] = np.asarray(s, dtype=np.int32)
        stop_valid[k] = True
    return stops, stop_valid


def _call_rows(part, chunk: int, p_len: int, lens, key_seeds, key_index, dry_run: bool):
    """One device call's prompt rows, padded to `chunk`: left-padded ids [chunk, p_len], lengths (1 for padding
    rows), which rows generate, and each row's key (seed, index)."""
    k = len(part)
    ids = np.zeros((chunk, p_len), dtype=np.int32)
    for i, p in enumerate(part):
        ids[i, p_len - len(p):] = np.asarray(p, dtype=np.int32)
    part_lens = np.ones((chunk,), dtype=np.int32)
    part_lens[:k] = lens[:k]
    active = np.arange(chunk) < (0 if dry_run else k)
    seeds = np.zeros((chunk,), dtype=np.uint32)
    seeds[:k] = key_seeds[:k]
    index = np.zeros((chunk,), dtype=np.int32)
    index[:k] = key_index[:k]
    return tuple(jnp.asarray(x) for x in (ids, part_lens, active, seeds, index))


def compiled_shapes() -> int:
    """How many shape buckets the sampler has compiled in this process (a reload must not add one)."""
    return _generate._cache_size()


# ----------------------------------------------------------------------------------------- device


@functools.partial(jax.jit, static_argnames=("n", "max_new", "mesh", "lm_head_float32", "greedy", "attention"))
def _generate(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index, *, n,
              max_new, mesh, lm_head_float32=False, greedy=False, attention="xla"):
    state = _start(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index,
                   n=n, max_new=max_new, mesh=mesh, lm_head_float32=lm_head_float32, greedy=greedy)
    state = _decode_until(model, state, stops, stop_valid, budget, temperature, jnp.asarray(max_new, jnp.int32),
                          mesh=mesh, lm_head_float32=lm_head_float32, greedy=greedy, attention=attention)
    return _outputs(state, stops)


def _outputs(state, stops):
    """(tokens [R, max_new], logprobs, lengths, stopped) of a decode state."""
    return state["out_tokens"][:, stops.shape[1] - 1:], state["out_logprobs"], state["lengths"], state["stopped"]


def _record(state, t, tok, lp, stops, stop_valid, budget):
    """Writes the tokens sampled at step t (rows already done keep TOKEN_PAD) and updates which rows stopped."""
    stop_len = stops.shape[1]
    done = state["done"]
    tok = jnp.where(done, TOKEN_PAD, tok)
    out_tokens = jax.lax.dynamic_update_slice_in_dim(state["out_tokens"], tok[:, None], stop_len - 1 + t, axis=1)
    out_logprobs = jax.lax.dynamic_update_slice_in_dim(state["out_logprobs"], jnp.where(done, 0.0, lp)[:, None], t,
                                                       axis=1)
    lengths = jnp.where(done, state["lengths"], t + 1)
    window = jax.lax.dynamic_slice_in_dim(out_tokens, t, stop_len, axis=1)
    match = (stops[None, :, :] == STOP_PAD) | (window[:, None, :] == stops[None, :, :])
    hit = jnp.any(jnp.all(match, axis=-1) & stop_valid[None, :], axis=-1) & ~done
    return dict(state, out_tokens=out_tokens, out_logprobs=out_logprobs, lengths=lengths,
                stopped=state["stopped"] | hit, done=done | hit | (lengths >= budget))


def _start(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index, *, n, max_new,
           mesh, lm_head_float32=False, greedy=False):
    """Prefills the prompts once and samples token 0 of their `n` rows each: the decode state (a dict of arrays)
    that `_decode_until` advances. The prompts' caches stay one per prompt (`prompt_caches`); each row's
    generated tokens get a cache of their own, in the blocks of `scan_plan.decode_blocks` (`caches`: per layer the
    keys and values of each block, `decoder.GroupedDecodeAttention`)."""
    b_prompts, p_len = ids.shape
    rows = b_prompts * n
    stop_len = stops.shape[1]
    cfg = model.config
    kv_heads, head = cfg.attention_config().num_kv_heads, cfg.attention_config().head_size
    dtype = model.embeddings.token_embeddings.weight.dtype
    layers = model.transformer.layers.unstacked()
    packed = [pack_layer(layer, mesh) for layer in layers]
    lm_head = model.get_lm_head().rearrange(("embed", "vocab")).array  # tied or not, as the model says

    # ---- prefill the prompts once (left-padded: prompt i occupies slots [p_len - lens[i], p_len))
    pad = p_len - lens
    slots = jnp.arange(p_len)
    pos = jnp.maximum(slots[None, :] - pad[:, None], 0)
    key_ok = (slots[None, None, :] >= pad[:, None, None]) & (slots[None, None, :] <= slots[None, :, None])
    key_ok = key_ok | (slots[None, None, :] == slots[None, :, None])  # pad queries see themselves: no NaN
    empty = jnp.zeros((b_prompts, kv_heads, p_len, head), dtype)
    prompt_caches = cache_layout([(empty, empty) for _ in range(cfg.num_layers)], mesh)
    logits, prompt_caches = forward(model, layers, packed, lm_head, ids, pos, prompt_caches,
                                    DenseAttention(jnp.asarray(0, jnp.int32), key_ok), lm_head_float32)

    # ---- n rows per prompt: row i * n + j is sample j of prompt i, with its own key
    expand = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
    blocks = [jnp.zeros((rows, kv_heads, size, head), dtype) for _, size in decode_blocks(max_new)]
    caches = cache_layout([tuple(x for block in blocks for x in (block, block)) for _ in range(cfg.num_layers)], mesh)
    # every device samples from whole rows of logits: the same draws as on one device
    logits = constrain(expand(logits), mesh, DATA, None)
    sample_idx = jnp.arange(rows) % n
    keys = jax.vmap(lambda s, i, j: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), i), j))(
        expand(key_seeds), expand(key_index), sample_idx)
    uniforms = jax.vmap(lambda k: jax.random.uniform(k, (max_new,)))(keys)  # [rows, max_new]

    # Output buffer with stop_len - 1 filler columns in front, so the window of the last stop_len tokens
    # ending at step t is columns [t, t + stop_len): stop sequences only match generated tokens.
    state = dict(
        t=jnp.asarray(1, jnp.int32), prompt_caches=prompt_caches, caches=caches, pad=expand(pad), lens=expand(lens),
        uniforms=uniforms, row_ids=expand(ids),
        out_tokens=jnp.full((rows, stop_len - 1 + max_new), TOKEN_PAD, jnp.int32),
        out_logprobs=jnp.zeros((rows, max_new), jnp.float32), lengths=jnp.zeros((rows,), jnp.int32),
        done=~expand(active), stopped=jnp.zeros((rows,), bool),
    )
    tok, lp = _pick(logits, temperature, uniforms[:, 0], greedy)
    return dict(_record(state, 0, tok, lp, stops, stop_valid, budget), tok=tok)


def _decode_until(model, state, stops, stop_valid, budget, temperature, t_stop, *, mesh, lm_head_float32=False,
                  greedy=False, attention="xla"):
    """Decodes from step `state["t"]` until every row is done or step `t_stop` (exclusive) is reached, in the
    phases of `scan_plan.decode_blocks`: a step writes its token's keys and values into the block its slot lies
    in and reads only that block and the ones before it (`attention`: `decode_kernel.decode_attention`)."""
    p_len = state["row_ids"].shape[1]
    max_new = state["out_logprobs"].shape[1]
    layers = model.transformer.layers.unstacked()
    packed = [pack_layer(layer, mesh) for layer in layers]
    lm_head = model.get_lm_head().rearrange(("embed", "vocab")).array
    pad, lens, uniforms = state["pad"], state["lens"], state["uniforms"]
    prompt_ok = jnp.arange(p_len)[None, :] >= pad[:, None]
    t_stop = jnp.minimum(t_stop, max_new)

    blocks = decode_blocks(max_new)
    starts = tuple(start for start, _ in blocks)
    for block, (start, size) in enumerate(blocks):
        def cond(state, end=start + size):  # step t writes slot t - 1: this block's steps are start + 1 .. end
            return (state["t"] <= jnp.minimum(t_stop - 1, end)) & ~jnp.all(state["done"])

        def body(state, block=block):
            t = state["t"]
            step_attention = decode_attention(attention, t - 1, prompt_ok, pad, state["done"], block,  # token t - 1
                                              starts)
            caches = [(*pc, *gc) for pc, gc in zip(state["prompt_caches"], state["caches"])]
            logits, caches = forward(model, layers, packed, lm_head, state["tok"][:, None], (lens + t - 1)[:, None],
                                     caches, step_attention, lm_head_float32)
            caches = cache_layout([c[2:] for c in caches], mesh)
            logits = constrain(logits, mesh, DATA, None)
            tok, lp = _pick(logits, temperature, jax.lax.dynamic_index_in_dim(uniforms, t, axis=1, keepdims=False),
                            greedy)
            state = _record(dict(state, caches=caches), t, tok, lp, stops, stop_valid, budget)
            return dict(state, t=t + 1, tok=tok)

        state = jax.lax.while_loop(cond, body, state)
    return state


# `_start` and `_decode_until` as device calls of their own (`_generate_in_chunks`)
_start_call = jax.jit(_start, static_argnames=("n", "max_new", "mesh", "lm_head_float32", "greedy"))
_decode_call = jax.jit(_decode_until, static_argnames=("mesh", "lm_head_float32", "greedy", "attention"),
                       donate_argnames=("state",))
