"""A lean batch sampler for rollouts: one jitted program per shape bucket that prefills left-padded
prompts once, copies their KV cache to the `n` samples of each prompt, and decodes all rows in a
`lax.while_loop` over a dense KV cache until every row has stopped.

It runs a Levanter model's own modules (embedding, norms, rotary embeddings, QK norms, MLP activation,
LM head) around packed projections (`decoder.py`); only the cached attention is ours. Which models it runs,
and how each family differs from Llama's decoder, is `sampler_families.py`. Logprobs are those of the
sampled token under the temperature-scaled distribution, log softmax(logits / T), in float32: the same
numbers a full forward pass gives (tests check this). At temperature 0 the token is the argmax and
its logprob is taken at T = 1, as Levanter's sampler does.

Many agents, one base: with `adapters` (`models/adapter_stack.py`, K LoRA slots on the model) and an
`adapter_index`, each prompt's rows sample from the base with their own slot's adapter, applied unmerged in
every adapted layer (`adapter_rows.py`), and one call mixes rows of every slot. Without them the program is
the plain model's, unchanged.

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

from marinrl.inference import call_rows
from marinrl.inference.adapter_rows import pack_adapters
from marinrl.inference.call_rows import STOP_PAD
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
    adapters=None,
    adapter_index: Optional[Sequence[int]] = None,
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
    the server resolves `inference.attention` with `decode_kernel.resolve_attention`).

    `adapters` (`adapter_stack.StackedAdapters` of K slots on `model`) with `adapter_index` (a slot per prompt,
    or per row agreeing within each prompt; -1: the base alone, `call_rows.prompt_slots`): each row samples
    from the base with its slot's adapter, unmerged. Not with `swaps`."""
    check_supported(model)
    n_prompts = len(prompts)
    slots = call_rows.adapter_slots(adapters, adapter_index, swaps, n_prompts, n)
    key_seeds, key_index = call_rows.prompt_keys(prompt_keys, seed, n_prompts)
    if swaps is not None and dry_run:
        swaps = None  # nothing is generated: nothing to swap
    if n_prompts == 0:
        return _concat([], max_tokens, swaps is not None)
    lens = np.array([len(p) for p in prompts], dtype=np.int32)
    p_len, t_len = bucket(int(lens.max()), 16), bucket(max_tokens, 16)
    chunk = _chunk(model, lens, n=n, max_tokens=max_tokens, max_cache_bytes=max_cache_bytes, min_prompts=min_prompts,
                   mesh=mesh)
    greedy = temperature == 0

    stops, stop_valid = call_rows.stop_table(stop_sequences)
    shared = (jnp.asarray(stops), jnp.asarray(stop_valid), jnp.asarray(max_tokens, dtype=jnp.int32),
              picking(temperature, top_k, top_p, min_p))

    pieces = []
    for start in range(0, n_prompts, chunk):
        part = prompts[start:start + chunk]
        ids, part_lens, active, part_seeds, part_index = call_rows.prompt_rows(
            part, chunk, p_len, lens[start:], key_seeds[start:], key_index[start:], dry_run)
        args = (ids, part_lens, active, *shared, part_seeds, part_index)
        # no adapters: not even a None argument, so the call (and its program) is the plain model's
        lora = {} if slots is None else dict(adapters=adapters,
                                             adapter_index=call_rows.padded_slots(slots[start:start + chunk], chunk))
        rows = len(part) * n
        out, steps = yield from _run_call(model, args, n=n, max_new=t_len, mesh=mesh, lm_head_float32=lm_head_float32,
                                          greedy=greedy, attention=attention, swaps=swaps, chunk_tokens=chunk_tokens,
                                          **lora)
        if steps is not None:
            steps = np.broadcast_to(steps[None, :max_tokens], (rows, max_tokens))
        tokens, logprobs, lengths, stopped = jax.device_get(tuple(out))
        pieces.append((tokens[:rows, :max_tokens], logprobs[:rows, :max_tokens], lengths[:rows], stopped[:rows],
                       steps))
        if start + chunk < n_prompts:
            yield
    return _concat(pieces, max_tokens, swaps is not None)


def _chunk(model, lens, *, n, max_tokens, max_cache_bytes, min_prompts, mesh) -> int:
    """Prompts per device call (`call_plan`), after checking the prompts' lengths against the model's window."""
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    check_window(model, int(lens.max()), max_tokens)
    plan = call_plan(model, len(lens), n=n, prompt_tokens=int(lens.max()), max_tokens=max_tokens,
                     max_cache_bytes=max_cache_bytes, min_prompts=min_prompts, mesh=mesh)
    if plan.calls > 1:
        logger.info("scan sampler: %d prompts x %d samples in %d calls of %d rows (cache %.2f GiB a device, "
                    "budget %.2f GiB)", len(lens), n, plan.calls, plan.rows_per_call,
                    plan.per_device_cache_bytes / 2**30, max_cache_bytes / 2**30)
    return plan.prompts_per_call


def _concat(pieces, max_tokens: int, with_steps: bool) -> SampleOutput:
    """The calls' outputs (tokens, logprobs, lengths, stopped, weight steps) as one `SampleOutput`."""
    if not pieces:
        return SampleOutput(np.zeros((0, max_tokens), np.int32), np.zeros((0, max_tokens), np.float32),
                            np.zeros((0,), np.int32), np.zeros((0,), bool),
                            np.zeros((0, max_tokens), np.int64) if with_steps else None)
    return SampleOutput(
        tokens=np.concatenate([p[0] for p in pieces]).astype(np.int32),
        logprobs=np.concatenate([p[1] for p in pieces]).astype(np.float32),
        lengths=np.concatenate([p[2] for p in pieces]).astype(np.int32),
        stopped=np.concatenate([p[3] for p in pieces]).astype(bool),
        weight_steps=np.concatenate([p[4] for p in pieces]).astype(np.int64) if with_steps else None,
    )


def _run_call(model, args, *, swaps, chunk_tokens, **kw):
    """One device call's (tokens, logprobs, lengths, stopped) and, with in-flight `swaps`, the weight step of each
    generated position (else None): in one program, in chunks of `chunk_tokens` steps, or through `swaps`."""
    if swaps is not None:
        *out, by_token = swaps.generate(*args, **kw)  # inflight.py builds on this module
        return out, by_token
    if chunk_tokens is not None:
        out = yield from _generate_in_chunks(model, args, chunk_tokens, **kw)
        return out, None
    return _generate(model, *args, **kw), None


def _generate_in_chunks(model, args, chunk_tokens: int, *, n, max_new, mesh, lm_head_float32, greedy, attention="xla",
                        **lora):
    """`_generate` as device calls of at most `chunk_tokens` decode steps, yielding between them; what it returns.
    Rows step in lockstep, so `t` (the next step) and whether every row is done say when to stop. `lora`: the
    adapters and each prompt row's slot, or nothing."""
    ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index = args
    state = _start_call(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index,
                        n=n, max_new=max_new, mesh=mesh, lm_head_float32=lm_head_float32, greedy=greedy, **lora)
    decode_lora = {} if not lora else dict(adapters=lora["adapters"])
    t, finished = 1, False  # the prefill sampled token 0
    while t < max_new and not finished:
        yield
        state = _decode_call(model, state, stops, stop_valid, budget, temperature,
                             jnp.asarray(t + chunk_tokens, jnp.int32), mesh=mesh, lm_head_float32=lm_head_float32,
                             greedy=greedy, attention=attention, **decode_lora)
        t, finished = jax.device_get((state["t"], jnp.all(state["done"])))
        t = int(t)
    return _outputs(state, stops)


def compiled_shapes() -> int:
    """How many shape buckets the sampler has compiled in this process (a reload must not add one)."""
    return _generate._cache_size()


# ----------------------------------------------------------------------------------------- device


@functools.partial(jax.jit, static_argnames=("n", "max_new", "mesh", "lm_head_float32", "greedy", "attention"))
def _generate(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index, adapters=None,
              adapter_index=None, *, n, max_new, mesh, lm_head_float32=False, greedy=False, attention="xla"):
    state = _start(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index,
                   n=n, max_new=max_new, mesh=mesh, lm_head_float32=lm_head_float32, greedy=greedy,
                   adapters=adapters, adapter_index=adapter_index)
    state = _decode_until(model, state, stops, stop_valid, budget, temperature, jnp.asarray(max_new, jnp.int32),
                          mesh=mesh, lm_head_float32=lm_head_float32, greedy=greedy, attention=attention,
                          adapters=adapters)
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
           mesh, lm_head_float32=False, greedy=False, adapters=None, adapter_index=None):
    """Prefills the prompts once and samples token 0 of their `n` rows each: the decode state (a dict of arrays)
    that `_decode_until` advances. The prompts' caches stay one per prompt (`prompt_caches`); each row's
    generated tokens get a cache of their own, in the blocks of `scan_plan.decode_blocks` (`caches`: per layer the
    keys and values of each block, `decoder.GroupedDecodeAttention`). With `adapters`, prompt row i prefills with
    slot `adapter_index[i]` and its n rows keep it (`state["adapter_rows"]`)."""
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
    lora = None if adapters is None else pack_adapters(adapters, model, layers, adapter_index)
    logits, prompt_caches = forward(model, layers, packed, lm_head, ids, pos, prompt_caches,
                                    DenseAttention(jnp.asarray(0, jnp.int32), key_ok), lm_head_float32, lora)

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
    if adapters is not None:
        state["adapter_rows"] = expand(adapter_index)
    tok, lp = _pick(logits, temperature, uniforms[:, 0], greedy)
    return dict(_record(state, 0, tok, lp, stops, stop_valid, budget), tok=tok)


def _decode_until(model, state, stops, stop_valid, budget, temperature, t_stop, *, mesh, lm_head_float32=False,
                  greedy=False, attention="xla", adapters=None):
    """Decodes from step `state["t"]` until every row is done or step `t_stop` (exclusive) is reached, in the
    phases of `scan_plan.decode_blocks`: a step writes its token's keys and values into the block its slot lies
    in and reads only that block and the ones before it (`attention`: `decode_kernel.decode_attention`)."""
    p_len = state["row_ids"].shape[1]
    max_new = state["out_logprobs"].shape[1]
    layers = model.transformer.layers.unstacked()
    packed = [pack_layer(layer, mesh) for layer in layers]
    lm_head = model.get_lm_head().rearrange(("embed", "vocab")).array
    lora = None if adapters is None else pack_adapters(adapters, model, layers, state["adapter_rows"])
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
                                     caches, step_attention, lm_head_float32, lora)
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
