"""The scan sampler's decode attention as a GPU kernel (`inference.attention: gpu_kernel`): a Pallas kernel that
reads only the cache slots that hold tokens, where the XLA path (`decoder.GroupedDecodeAttention`) reads whole
arrays and masks. Per decode step it reads each prompt's keys and values once for the prompt's n rows, from the
prompt's first real slot on (left padding skipped), and each row's generated slots up to the one just written,
nothing of a row that has finished. Each part returns its softmax partial (running max, sum of exponentials,
unnormalized weighted values, all float32); the parts merge by log-sum-exp into one softmax, as the XLA path's
shared max does, so both give the same numbers within float32 rounding (tests/test_decode_kernel.py).

The kernel is written once (`_partial_kernel`) and launched by a backend from `BACKENDS`: Pallas's Triton backend
today. Pallas's Triton backend is deprecated from JAX 0.11 on; a Mosaic GPU launch is a new entry in `BACKENDS`
with the same signature, chosen by `BACKEND`, and nothing else changes. Off a GPU the kernel runs only in Pallas's
interpret mode (tests); `resolve_attention` turns `gpu_kernel` into the XLA path there, with one logged line.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from marinrl.inference.decoder import GroupedDecodeAttention, write_generated_kv

logger = logging.getLogger(__name__)

INTERPRET_ENV = "MARINRL_DECODE_KERNEL_INTERPRET"
"""Private switch for tests: set to 1, `resolve_attention` turns `gpu_kernel` off a GPU into the kernel in Pallas's
interpret mode (`INTERPRET`) instead of the XLA path. Slow; never for real runs."""
INTERPRET = "gpu_kernel_interpret"
"""The sampler's `attention` value for the kernel in interpret mode (any backend; tests)."""
BLOCK_SLOTS = 64
"""Cache slots a kernel program reads per iteration at most (fewer where a part's slot count needs it)."""


def tile_range(start, end, block: int):
    """The tiles of `block` slots a kernel program reads for slots [start, end): (first, stop), stop exclusive; no
    tile (stop == first) for an empty range, so that every tile read holds a slot of the range."""
    first = start // block
    return first, jnp.where(end > start, (end + block - 1) // block, first)


def _partial_kernel(start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale: float,
                    soft_cap: Optional[float], block: int):
    """One (batch row, KV head): queries q [M, D] against slots [start, end) of keys and values [S, D], `block`
    slots at a time; writes the softmax partial: max m [M], sum of exponentials l [M] and unnormalized
    weighted values o [M, D] (m = -inf, l = 0, o = 0 when the range is empty). Only blocks that hold a slot of the
    range are read."""
    start, end = start_ref[()], end_ref[()]
    q = q_ref[...]
    m_rows = q.shape[0]
    first, stop = tile_range(start, end, block)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32 rounding of float32

    def body(i, carry):
        m, l_sum, o = carry
        at = pl.ds(i * block, block)
        k = k_ref[at, :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * scale  # [M, block]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        slot = i * block + jax.lax.broadcasted_iota(jnp.int32, (m_rows, block), 1)
        s = jnp.where((slot >= start) & (slot < end), s, -jnp.inf)
        v_slot = i * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        v = jnp.where((v_slot >= start) & (v_slot < end), v_ref[at, :], 0)  # whatever a slot outside holds, NaN too
        m_new = jnp.maximum(m, s.max(axis=1))  # finite: every block read holds a slot of the range
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        return m_new, correction * l_sum + p.sum(axis=1), correction[:, None] * o + pv

    init = (jnp.full((m_rows,), -jnp.inf, jnp.float32), jnp.zeros((m_rows,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, l_sum, o = jax.lax.fori_loop(first, stop, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l_sum


def _block_slots(slots: int) -> int:
    """The largest power of two <= BLOCK_SLOTS that divides `slots` (the sampler's parts hold multiples of 16)."""
    block = BLOCK_SLOTS
    while slots % block:
        block //= 2
    return block


def _triton_partial(q, k, v, start, end, *, scale, soft_cap, interpret: bool):
    """`_partial_kernel` on a grid of (batch row, KV head) through Pallas's Triton backend. q [B, KV, M, D];
    k, v [B, KV, S, D]; start, end int32 [B] -> (m [B, KV, M], l [B, KV, M], o [B, KV, M, D]), float32."""
    from jax.experimental.pallas import triton as pl_triton  # GPU-only parameters; importable on any platform

    b, kv, m_rows, head = q.shape
    slots = k.shape[2]
    kernel = functools.partial(_partial_kernel, scale=scale, soft_cap=soft_cap, block=_block_slots(slots))
    row = pl.BlockSpec((None,), lambda i, h: (i,))
    o, m, l_sum = pl.pallas_call(
        kernel,
        grid=(b, kv),
        in_specs=[row, row,
                  pl.BlockSpec((None, None, m_rows, head), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, slots, head), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, slots, head), lambda i, h: (i, h, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, m_rows, head), lambda i, h: (i, h, 0, 0)),
                   pl.BlockSpec((None, None, m_rows), lambda i, h: (i, h, 0)),
                   pl.BlockSpec((None, None, m_rows), lambda i, h: (i, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kv, m_rows, head), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, m_rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, m_rows), jnp.float32)],
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="marinrl_decode_partial",
    )(start.astype(jnp.int32), end.astype(jnp.int32), q, k, v)
    return m, l_sum, o


BACKENDS: dict[str, Callable] = {"triton": _triton_partial}
"""Kernel launchers by name, each `(q, k, v, start, end, *, scale, soft_cap, interpret) -> (m, l, o)` as
`_triton_partial`. The one place a backend is added or swapped (`BACKEND` picks it)."""
BACKEND = "triton"


def shape_problem(head_size: int) -> Optional[str]:
    """Why the compiled kernel cannot run a model of this head size (None when it can): a GPU kernel's tiles are
    powers of two of at least 16 elements. The slot counts the sampler gives (multiples of 16) always fit."""
    if head_size < 16 or head_size & (head_size - 1):
        return f"the model's head size {head_size} is not a power of two >= 16"
    return None


def resolve_attention(setting: str, platform: str, head_size: int, devices: int = 1) -> str:
    """The sampler's `attention` for `inference.attention` = `setting` on `devices` devices of `platform`
    (`jax.devices()[0].platform`): `gpu_kernel` on one GPU whose model the kernel runs; otherwise `xla`, with one
    logged line saying why (or `INTERPRET` off a GPU when tests set `INTERPRET_ENV`). Over a mesh of several
    devices the kernel is not partitioned (a Pallas call is one device's program), so the mesh runs `xla`."""
    if setting != "gpu_kernel":
        return setting
    if platform != "gpu":
        if os.environ.get(INTERPRET_ENV) == "1":
            return INTERPRET
        problem = f"it runs on a GPU only, and this is a {platform}"
    elif devices > 1:
        problem = f"the rollout mesh has {devices} devices, and the kernel runs on one"
    else:
        problem = shape_problem(head_size)
    if problem is None:
        return setting
    logger.info("inference.attention: gpu_kernel is not used (%s): the sampler runs the XLA attention", problem)
    return "xla"


def partial_attention(q, k, v, start, end, *, scale, soft_cap, interpret: bool):
    """Softmax partial of q [B, KV, M, D] over slots [start, end) of k, v [B, KV, S, D] by `BACKENDS[BACKEND]`:
    (m, l [B, KV, M], o [B, KV, M, D]). The query rows are padded to a power of two of at least 16 (a GPU dot's
    smallest tile; the padding is a few zero queries, never the cache)."""
    m_rows = q.shape[2]
    padded = max(16, 1 << (m_rows - 1).bit_length())
    if padded != m_rows:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - m_rows), (0, 0)))
    m, l_sum, o = BACKENDS[BACKEND](q, k, v, start, end, scale=scale, soft_cap=soft_cap, interpret=interpret)
    return m[:, :, :m_rows], l_sum[:, :, :m_rows], o[:, :, :m_rows]


def merge_partials(parts):
    """One softmax's output from its parts' partials [(m, l, o)], by log-sum-exp: each part's sums rescaled to
    the shared max. A part with no slots (m = -inf) adds nothing; at least one part must hold a slot."""
    top = functools.reduce(jnp.maximum, [m for m, _, _ in parts])
    total = sum(jnp.exp(m - top) * l_sum for m, l_sum, _ in parts)
    out = sum(jnp.exp(m - top)[..., None] * o for m, _, o in parts)
    return out / total[..., None]


class KernelDecodeAttention(eqx.Module):
    """`decoder.GroupedDecodeAttention`'s decode step with the kernel reading the cache: the same cache layout
    (each prompt's keys and values once [P, KV, S_p, D], each row's generated ones in blocks [R, KV, T_b, D]),
    the same write of the step's key and value at generated slot `write_at` (in block `block`). A prompt is read
    from slot `pad` of its rows on, once for its n rows; row r's generated slots 0..`write_at` where `reads[r]`,
    none where not (a finished row: its token is discarded, so its attention need not be exact)."""

    write_at: jax.Array
    pad: jax.Array
    reads: jax.Array
    block: int = eqx.field(static=True)
    block_starts: tuple[int, ...] = eqx.field(static=True)
    interpret: bool = eqx.field(static=True, default=False)

    def __call__(self, q, k, v, cache, scale, soft_cap):
        """q [R, KV, G, 1, D]; k, v [R, KV, 1, D]; cache (prompt keys, prompt values, then each generated block's
        keys and values) -> ([R, 1, KV*G*D], cache)."""
        kp, vp, gen = write_generated_kv(cache, k, v, self.block, self.block_starts, self.write_at)
        b = self.block
        n_prompts, n_kv, s_p, _ = kp.shape
        rows, _, group, _, head = q.shape
        n = rows // n_prompts
        q = q[:, :, :, 0]  # [R, KV, G, D]
        run = functools.partial(partial_attention, scale=scale, soft_cap=soft_cap, interpret=self.interpret)
        # the prompt part: a prompt's n × G queries of each KV head as one [n * G, D] matrix
        grouped = q.reshape(n_prompts, n, n_kv, group, head).transpose(0, 2, 1, 3, 4).reshape(
            n_prompts, n_kv, n * group, head)
        m, l_sum, o = run(grouped, kp, vp, self.pad[::n], jnp.full((n_prompts,), s_p, jnp.int32))
        by_row = lambda x: x.reshape(n_prompts, n_kv, n, group, *x.shape[3:]).swapaxes(1, 2).reshape(  # noqa: E731
            rows, n_kv, group, *x.shape[3:])
        parts = [(by_row(m), by_row(l_sum), by_row(o))]
        # the generated part: each block up to the one written, each row up to `write_at` (none if it reads none)
        filled = jnp.where(self.reads, self.write_at + 1, 0)
        for i in range(b + 1):
            size = gen[2 * i].shape[2]
            end = jnp.clip(filled - self.block_starts[i], 0, size)
            parts.append(run(q, gen[2 * i], gen[2 * i + 1], jnp.zeros_like(end), end))
        out = merge_partials(parts).reshape(rows, n_kv * group * head)
        return out[:, None, :].astype(vp.dtype), (kp, vp, *gen)


def decode_attention(attention: str, write_at, prompt_ok, pad, done, block: int, block_starts: tuple[int, ...]):
    """The decode step's attention module for the sampler's `attention` (`xla`, `gpu_kernel`, `INTERPRET`)."""
    if attention == "xla":
        return GroupedDecodeAttention(write_at, prompt_ok, block, block_starts)
    if attention not in ("gpu_kernel", INTERPRET):
        raise ValueError(f"attention must be 'xla', 'gpu_kernel' or {INTERPRET!r}, got {attention!r}")
    return KernelDecodeAttention(write_at, pad, ~done, block, block_starts, interpret=attention == INTERPRET)
