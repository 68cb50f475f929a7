"""The policy forward on a `TrainingBatch`: per-token log π(target) at each target's sampling temperature.

One code path for every layout of batching.py: attention is causal, inside one block (`segment_ids`), and a
response token sees its block's prompt and its own response only (`response_ids`); positions come from
`position_ids` (restarting per block, every response continuing from its prompt's length). The hidden state
that predicts target t is the one at `source_positions[t]`: where a block's later response begins, that is the
prompt's last position, computed once and gathered for each response.
"""

from __future__ import annotations

import contextlib
import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel
from levanter.models.loss import fused_cross_entropy_loss_and_logsumexp_penalty

from marinrl.config.model import FLASH_MAX_BLOCK, keeps_attention_scores
from marinrl.train.batching import BATCH, POSITION, TrainingBatch
from marinrl.train.flat_dots import flat_token_dots

VOCAB_BLOCK = 32768
"""Vocabulary columns of the LM head's logits computed at once when the model config sets no
`cross_entropy_block_size`. A float32 logits block is tokens × block × 4 bytes: at 16 rows × 512 tokens, 1 GiB
per block where Qwen3's 151,936 columns at once are 4.6 GiB (and the backward recomputes each block rather
than keeping it). A vocabulary of at most one block (the tiny models of the tests and the quickstart) is one
block, as before; 32k keeps the blocks few (5 at 151,936, 4 at Llama 3's 128,256) and each matmul large."""


def lm_head_block(cross_entropy_block_size: int | None, vocab_size: int) -> int:
    """The vocabulary block of the train step's logprobs and entropy (and what the dry run counts).

    Never one whole block plus a straggler: Levanter's blockwise cross-entropy (levanter 1.2's
    `_block_cross_entropy_forward` and its backward) processes a single full block at the size of the whole
    vocabulary and then the straggler again, so the straggler's columns count twice in log Z and a target
    among them twice in its logit (logprobs up to +27 nats on SmolLM2's 49,152 columns with 32,768-column
    blocks). Such a vocabulary is cut into two halves instead (and a straggler of at most one column)."""
    block = min(cross_entropy_block_size or VOCAB_BLOCK, vocab_size)
    if vocab_size // block == 1 and vocab_size % block:
        block = vocab_size // 2
    return block


def flash_block(length: int) -> int:
    """The key block of the JAX flash attention for rows of `length` positions: the largest divisor of `length`
    up to `FLASH_MAX_BLOCK`. Levanter's flash attention needs a row that is a multiple of its block (a 1,536-token
    row under its default block of 1,024 raises) and runs the vanilla attention, which keeps every layer's
    scores, for a row shorter than one block: one block of the whole row keeps only its output and log-sum-exp."""
    return next(b for b in range(min(length, FLASH_MAX_BLOCK), 0, -1) if length % b == 0)


def with_flash_blocks(model: LmHeadModel, length: int, platform: str | None = None) -> LmHeadModel:
    """`model` whose attention layers that run Levanter's JAX flash attention with no block of their own take
    `flash_block(length)` (inside the traced loss only, as `flat_token_dots`: the model the trainer holds keeps
    its config). On a CPU (`platform`, default JAX's backend) a row shorter than `FLASH_MAX_BLOCK` keeps
    Levanter's vanilla attention: there the one-block flash attention took 1.2x the update's time at the reference
    shape (docs/training.md, "Attention in the update"); a longer row takes the block, where Levanter's own would
    raise unless the row is a multiple of 1,024. Other backends are unchanged."""
    from levanter.layers.attention import Attention, AttentionBackend

    if keeps_attention_scores("jax_flash", platform or jax.default_backend(), length):
        return model  # Levanter's vanilla fallback, as the dry run's estimate counts it
    flash = (AttentionBackend.JAX_FLASH,) + ((None, AttentionBackend.DEFAULT) if default_is_jax_flash() else ())

    def blocked(x):
        config = getattr(x, "config", None)
        if not isinstance(x, Attention) or config.attn_backend not in flash or \
                config.flash_attention_block_size is not None:
            return x
        block = flash_block(length)
        return dataclasses.replace(x, config=dataclasses.replace(config, flash_attention_block_size=block))

    return jax.tree_util.tree_map(blocked, model, is_leaf=lambda x: isinstance(x, Attention))


def default_is_jax_flash() -> bool:
    """Whether Levanter's default attention here is its JAX flash attention (on a CPU)."""
    from levanter.layers.attention import AttentionBackend, default_attention_type

    return default_attention_type() == AttentionBackend.JAX_FLASH


KEY_POSITION = "key_position"
"""Levanter's name for the attended-to position axis (`LlamaConfig.KeyPos`)."""


def _stop(x):
    return jax.lax.stop_gradient(x)


def attention_mask(batch: TrainingBatch) -> AttentionMask:
    """causal ∧ same block ∧ (key on the prompt ∨ key in the query's response), built inside the jitted step
    from two small per-token arrays: the [batch, position, key_position] boolean lives only here."""
    response_q = batch.response_ids
    response_k = batch.response_ids.rename({POSITION: KEY_POSITION})
    sees = (response_k == 0) | (response_q.broadcast_axis(response_k.resolve_axis(KEY_POSITION)) == response_k)
    return (AttentionMask.causal() & AttentionMask.explicit(sees)).with_segment_ids(batch.segment_ids)


def _gather_positions(h: NamedArray, source_positions: NamedArray) -> NamedArray:
    """h'[b, t] = h[b, source_positions[b, t]]: the hidden state that predicts each target."""
    Batch, Pos = source_positions.resolve_axis(BATCH), source_positions.resolve_axis(POSITION)
    rest = tuple(a for a in h.axes if a.name not in (BATCH, POSITION))
    arr = h.rearrange((Batch, Pos, *rest)).array
    idx = source_positions.rearrange((Batch, Pos)).array.reshape(Batch.size, Pos.size, *([1] * len(rest)))
    return hax.named(jnp.take_along_axis(arr, idx, axis=1), (Batch, Pos, *rest))
def _vocab_entropy(h: NamedArray, lm_head: NamedArray, Embed: hax.Axis, Vocab: hax.Axis, block_size: int) -> NamedArray:
    """H = log Z − Σ_v p_v ℓ_v per position, over vocabulary blocks with an online max (never [.., Vocab] at once
    when block_size < |Vocab|). For metrics: the caller passes detached inputs."""
    shape = hax.sum(h, axis=Embed).axes
    init = (hax.full(shape, -jnp.inf, jnp.float32), hax.zeros(shape, jnp.float32), hax.zeros(shape, jnp.float32))

    def step(start, carry, size):
        running_max, z, weighted = carry
        Block = Vocab.resize(size)
        logits = hax.dot(h, lm_head[Vocab, hax.dslice(start, Block)], axis=Embed).astype(jnp.float32)
        new_max = hax.maximum(running_max, hax.max(logits, axis=Block))
        scale = hax.exp(running_max - new_max)
        e = hax.exp(logits - new_max)
        return new_max, z * scale + hax.sum(e, axis=Block), weighted * scale + hax.sum(e * logits, axis=Block)

    full, rest = divmod(Vocab.size, block_size)
    carry = init
    if full == 1:
        carry = step(0, carry, block_size)
    elif full > 1:
        carry = jax.lax.fori_loop(0, full, lambda b, c: step(b * block_size, c, block_size), carry)
    if rest:
        carry = step(full * block_size, carry, rest)
    running_max, z, weighted = carry
    return running_max + hax.log(z) - weighted / z


def lm_head_weight(model: LmHeadModel) -> NamedArray:
    """The output projection, tied or not; with a LoRA adapter on the head (`marinrl/models/lora.py`) its merged
    weight W + scale·A·B (a vocab × embed × rank product: cheap, and differentiable in A and B)."""
    from levanter.lora import LoraLinear

    head = getattr(model, "lm_head", None)
    if isinstance(head, LoraLinear):
        weight = head.wrapped.weight
        return (weight + head.lora.merge().astype(weight.dtype)).rearrange(weight.axes)
    return model.get_lm_head()


def policy_forward(
    model: LmHeadModel, batch: TrainingBatch, *, key, with_entropy: bool, lm_head_float32: bool = False
) -> tuple[NamedArray, NamedArray | None, jax.Array | float]:
    """(log π(target_ids) at the batch temperature, entropy or None, auxiliary model loss).

    `lm_head_float32` (`ModelConfig.lm_head_float32`): the head in float32, as the sampler's
    (`inference/decoder.head_logits`): the hidden state cast to float32 before it is divided by the
    temperature, the head's weights (in their dtype) promoted to float32 block by block, float32 sums at
    `HIGHEST` precision (an accelerator's default would round float32 operands to bfloat16 passes). The
    backward of Levanter's blockwise loss is traced outside this precision scope and runs at the default:
    the gradients' rounding is the compute dtype's either way."""
    model = flat_token_dots(model)  # 2-D projections on the CPU: docs/performance.md, "The update"
    model = with_flash_blocks(model, batch.input_ids.resolve_axis(POSITION).size)
    out = model.activations(batch.input_ids, attention_mask(batch), key=key, pos_ids=batch.position_ids)
    aux: jax.Array | float = 0.0
    if isinstance(out, tuple):  # mixture-of-experts models return (activations, load-balancing loss)
        out, aux = out
    out = _gather_positions(out, batch.source_positions)
    # logits / T = (h / T) · W: scaling the activations keeps the lm head blockwise. A temperature of 0
    # (greedy) has no logprobs; such tokens are scored at T = 1 and should not be trained on.
    temperature = hax.where(batch.temperature > 0, batch.temperature, 1.0)
    h = out.astype(jnp.float32) / temperature if lm_head_float32 else (out / temperature).astype(out.dtype)
    lm_head = lm_head_weight(model)
    Vocab = lm_head.resolve_axis(model.Vocab.name)
    block_size = lm_head_block(model.config.cross_entropy_block_size, Vocab.size)
    # Levanter's blockwise cross-entropy has a custom VJP that recomputes each logits block in the
    # backward pass, so neither pass holds [batch, position, vocab] beyond one block.
    with jax.default_matmul_precision("highest") if lm_head_float32 else contextlib.nullcontext():
        nll = fused_cross_entropy_loss_and_logsumexp_penalty(
            h,
            lm_head,
            Contract=model.Embed,
            Label=Vocab,
            target_y=batch.target_ids,
            reduction=None,
            where=None,
            logsumexp_weight=0.0,
            block_size=block_size,
            dtype=jnp.float32,
        )
        entropy = _vocab_entropy(_stop(h), _stop(lm_head), model.Embed, Vocab, block_size) if with_entropy else None
    return -nll, entropy, aux


def token_logprobs(model: LmHeadModel, batch: TrainingBatch, *, key=None, lm_head_float32: bool = False) -> NamedArray:
    """log π(target_ids[t] | input_ids[..t]) under `model`, shape [batch, position], float32.

        log π(o_t) = z_t[o_t] − log Σ_v exp z_t[v],     z_t = logits_t / T_row

    Logits are divided by each row's sampling temperature, so at the sampler's weights this equals the
    sampler's logprobs. Used for the policy (inside `rl_loss`), the frozen reference and π_old.
    Positions outside the loss mask hold whatever the model says; callers mask them. `lm_head_float32`: the
    head in float32 (`policy_forward`).
    """
    return policy_forward(model, batch, key=key, with_entropy=False, lm_head_float32=lm_head_float32)[0]


