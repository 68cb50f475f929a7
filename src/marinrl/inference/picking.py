"""How the scan sampler picks each token (`pick`): inverse-CDF sampling from the temperature-scaled distribution,
optionally restricted by `top_k`, `top_p` and `min_p` (`filtered`), with the logprob of the distribution actually
sampled from; greedy at temperature 0. `sampler.py` runs it at every decode step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class Picking(NamedTuple):
    """How `pick` chooses a token, as traced arrays: the temperature, and the filters (top_k, top_p, min_p) or
    None when none is asked for (a program without the filters' sort: rollouts pay nothing for them)."""

    temperature: jax.Array
    filters: Optional[tuple[jax.Array, jax.Array, jax.Array]] = None


def picking(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Picking:
    """`Picking` of these settings (`top_k` 0, `top_p` 1 and `min_p` 0 filter nothing)."""
    if top_k < 0 or not 0 < top_p <= 1 or not 0 <= min_p <= 1:
        raise ValueError(f"top_k must be >= 0, top_p in (0, 1], min_p in [0, 1]; got {top_k}, {top_p}, {min_p}")
    filters = None
    if top_k > 0 or top_p < 1 or min_p > 0:
        filters = (jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32), jnp.asarray(min_p, jnp.float32))
    return Picking(jnp.asarray(temperature, dtype=jnp.float32), filters)


def cumsum_last(p, block: int = 32):
    """Cumulative sum over the last axis of p [R, V] as two small matmuls (within blocks of `block`, then
    over block totals): on a CPU much cheaper than XLA's reduce-window cumsum at vocabulary sizes."""
    r, v = p.shape
    if v % block:
        p = jnp.pad(p, ((0, 0), (0, block - v % block)))
    nb = p.shape[1] // block
    blocks = p.reshape(r, nb, block)
    within = jnp.matmul(blocks, jnp.triu(jnp.ones((block, block), p.dtype)), precision="highest")
    before = jnp.matmul(within[:, :, -1], jnp.triu(jnp.ones((nb, nb), p.dtype), k=1), precision="highest")
    return (within + before[:, :, None]).reshape(r, -1)[:, :v]


def pick(logits, temperature, u, greedy: bool):
    """Sample one token per row from logits [R, V] given one uniform number per row u [R]; returns
    (tokens, logprobs of the distribution sampled from). `temperature`: a `Picking` (or the temperature alone).
    `greedy` (temperature 0, known on the host): the argmax, its logprob at T = 1; the choice is made when the
    program is traced, not by a branch at every step. The filters never drop the argmax, so greedy ignores them.

    Inverse-CDF sampling needs one uniform number per row, not one per vocabulary entry as Gumbel-max
    does; all of them are drawn before the decode loop, so no PRNG runs inside it (on a CPU, PRNG
    hashing was the largest cost of a decode step at small model sizes). The token is the first index
    whose CDF exceeds u * total, which never picks a zero-probability token."""
    how = temperature if isinstance(temperature, Picking) else Picking(temperature)
    if greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        logp = jax.nn.log_softmax(logits / how.temperature, axis=-1)
        if how.filters is not None:
            logp = filtered(logp, *how.filters)
        cdf = cumsum_last(jnp.exp(logp))
        total = cdf[:, -1]
        x = jnp.minimum(u * total, jnp.nextafter(total, jnp.zeros_like(total)))
        tokens = jnp.sum(cdf <= x[:, None], axis=-1, dtype=jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def filtered(logp, top_k, top_p, min_p):
    """log p [R, V] restricted to the tokens the filters keep and renormalized, in vLLM's order: `min_p` keeps
    tokens at least `min_p` times as likely as the likeliest, `top_k` (0: all) the `top_k` likeliest, then `top_p`
    the likeliest whose probability (renormalized over those kept) sums to `top_p`, the one that crosses it
    included. Tokens tied with the last one kept are kept too."""
    desc = -jnp.sort(-logp, axis=-1)  # [R, V], likeliest first
    v = logp.shape[-1]
    rank = jnp.arange(v)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kept = (rank < k) & (desc >= desc[:, :1] + jnp.log(min_p))  # a prefix of the sorted row
    p = jnp.where(kept, jnp.exp(desc), 0.0)
    before = cumsum_last(p) - p  # mass of the likelier kept tokens
    kept = kept & (before < top_p * jnp.sum(p, axis=-1, keepdims=True))
    last = jnp.sum(kept, axis=-1, keepdims=True) - 1  # >= 0: the likeliest token is always kept
    threshold = jnp.take_along_axis(desc, last, axis=-1)
    logp = jnp.where(logp >= threshold, logp, -jnp.inf)
    return logp - jax.nn.logsumexp(logp, axis=-1, keepdims=True)
