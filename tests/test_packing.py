"""Packed rows and shared prompts against the padded layout (one rollout per row), through a tiny real
Levanter Llama: per-token logprobs, every loss preset's value and gradient, the reference (KL) forward,
multi-turn masks; attention isolation, positions, determinism and the shapes a run compiles."""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from marinrl.config.batching import BatchingConfig
from marinrl.config.loss import LossConfig
from marinrl.train.batching import TrainingBatch, pack_rollouts, row_bucket
from marinrl.train.losses import rl_loss, token_logprobs
from marinrl.train.packing import plan_rows
from marinrl.types import Rollout, RolloutMetadata

VOCAB = 64
EPS32 = float(np.finfo(np.float32).eps)
LAYOUTS = ("padded", "packed", "shared")
PRESETS = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")


@eqx.filter_jit
def _init_llama(key):
    from levanter.models.llama import LlamaConfig, LlamaLMHeadModel

    config = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, initializer_range=0.3)
    return LlamaLMHeadModel.init(hax.Axis("vocab", VOCAB), config, key=key)


@pytest.fixture(scope="module")
def llama():
    return _init_llama(jax.random.PRNGKey(0))


def make_rollouts(seed: int, groups: int = 3, samples: int = 3, multi_turn: bool = True) -> list[Rollout]:
    """Groups sharing a prompt; varied lengths and temperatures; env tokens (mask 0) inside responses.
    Each rollout's `weight_step` is its index, so its tokens can be found in any layout."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 9)))
        for _ in range(samples):
            n = int(rng.integers(1, 14))
            mask = rng.random(n) < 0.75 if multi_turn else np.ones(n, bool)
            mask[0] = True
            out.append(Rollout(
                prompt_tokens=prompt, response_tokens=rng.integers(0, VOCAB, n),
                response_logprobs=(-0.2 - 3 * rng.random(n)).astype(np.float32),
                temperature=float(rng.choice([0.7, 1.0, 1.3])), loss_mask=mask, token_rewards=np.zeros(n),
                episode_reward=0.0, finish_reason="stop", env_name="e", lesson_id="l", group_id=f"g{g}",
                metadata=RolloutMetadata("w", len(out), 0.0)))
    return out


def arrays_for(rollouts, layout, *, row_multiple=2, max_length=48, advantages=None, min_bucket=8):
    adv = np.linspace(-1.0, 1.2, len(rollouts)) if advantages is None else advantages
    config = BatchingConfig(max_length=max_length, min_bucket=min_bucket, layout=layout)
    return pack_rollouts(rollouts, adv, batch_size=len(rollouts) + 2, config=config, row_multiple=row_multiple)


def per_rollout(arrays, values) -> list[np.ndarray]:
    """Each rollout's trained-token values, in response order (rollout i has weight_step i)."""
    n = int(arrays["weight_step"].max()) + 1
    return [np.asarray(values)[arrays["weight_step"] == i] for i in range(n)]


_logprobs = eqx.filter_jit(token_logprobs)


def logprobs_of(model, arrays):
    return np.asarray(_logprobs(model, TrainingBatch.from_numpy(arrays)).array)


def bound(scale: float, terms: int) -> float:
    """Float32 rounding of a computation whose longest reduction sums `terms` numbers of size `scale`: the
    layouts sum the same numbers in different orders (more masked keys, other blocks), never others."""
    return terms * EPS32 * scale


@pytest.mark.parametrize("multi_turn", [False, True])
def test_logprobs_equal_the_padded_layout(llama, multi_turn):
    rollouts = make_rollouts(0, multi_turn=multi_turn)
    padded = per_rollout(arrays_for(rollouts, "padded"), logprobs_of(llama, arrays_for(rollouts, "padded")))
    scale = max(np.abs(x).max() for x in padded)
    assert scale > 1.0 and np.std(np.concatenate(padded)) > 0.3  # a real distribution, not uniform numbers
    for layout in ("packed", "shared"):
        arrays = arrays_for(rollouts, layout)
        assert arrays["input_ids"].shape[0] < len(rollouts)  # really several rollouts per row
        got = per_rollout(arrays, logprobs_of(llama, arrays))
        for i, (g, want) in enumerate(zip(got, padded)):
            assert g.shape == want.shape == (rollouts[i].loss_mask.sum(),)
            # hidden 32, MLP 64: no dot product in the model sums more than 64 terms
            np.testing.assert_allclose(g, want, rtol=0, atol=bound(scale, 64), err_msg=f"{layout} rollout {i}")


REFERENCE_LENGTH = 48


@eqx.filter_jit
def _sequence_logprobs(model, tokens, temperature):
    """log softmax(logits / T) of one sequence under the model's own causal forward (positions 0..n-1)."""
    from levanter.layers.attention import AttentionMask

    Pos = hax.Axis("position", REFERENCE_LENGTH)
    logits = model(hax.named(tokens, Pos), attn_mask=AttentionMask.causal())
    return hax.nn.log_softmax(logits / temperature, axis="vocab").array


def reference_logprobs(model, rollout: Rollout) -> np.ndarray:
    """The trained tokens' logprobs of one rollout computed without `pack_rollouts`: its prompt and
    response as one causal sequence from position 0 (right padding cannot reach earlier positions),
    response token i predicted at the position before it."""
    p, n = len(rollout.prompt_tokens), len(rollout.response_tokens)
    tokens = np.zeros(REFERENCE_LENGTH, np.int32)
    tokens[:p + n] = np.concatenate([rollout.prompt_tokens, rollout.response_tokens])
    logp = np.asarray(_sequence_logprobs(model, tokens, np.float32(rollout.temperature)))
    predicted = logp[np.arange(p - 1, p + n - 1), rollout.response_tokens]
    return predicted[np.asarray(rollout.loss_mask, bool)]


@pytest.mark.parametrize("multi_turn", [False, True])
def test_every_layout_equals_an_independent_per_sequence_forward(llama, multi_turn):
    """The padded layout is the other tests' reference; this checks it (and the packed layouts) against
    logprobs built without `pack_rollouts`, so a fault every layout shares (a shifted position or target)
    cannot hide."""
    rollouts = make_rollouts(0, multi_turn=multi_turn)
    want = [reference_logprobs(llama, r) for r in rollouts]
    scale = max(np.abs(x).max() for x in want)
    assert scale > 1.0 and np.std(np.concatenate(want)) > 0.3
    for layout in LAYOUTS:
        arrays = arrays_for(rollouts, layout)
        got = per_rollout(arrays, logprobs_of(llama, arrays))
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, (layout, i)
            np.testing.assert_allclose(g, w, rtol=0, atol=bound(scale, 64), err_msg=f"{layout} rollout {i}")


@functools.partial(eqx.filter_jit)
def _loss_and_grad(model, batch, reference, config):
    fn = functools.partial(rl_loss, config=config, reference_logprobs=reference)
    return eqx.filter_value_and_grad(fn, has_aux=True)(model, batch)


def _config(name: str) -> LossConfig:
    extra = dict(max_response_tokens=16) if name == "dr_grpo" else {}
    # every preset with a KL term and the recomputed anchor's sequence-level correction where it applies
    if name in ("grpo", "gspo"):
        extra.update(ratio_anchor="recomputed", correction="tis", correction_level="sequence", tis_cap=1.5)
    return LossConfig.preset(name, kl_beta=0.05, **extra)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loss_and_gradient_equal_the_padded_layout(llama, name):
    config = _config(name)
    rollouts = make_rollouts(1)
    results = {}
    for layout in LAYOUTS:
        arrays = arrays_for(rollouts, layout)
        batch = TrainingBatch.from_numpy(arrays)
        reference = _logprobs(_init_llama(jax.random.PRNGKey(1)), batch)  # the reference forward, same layout
        (loss, metrics), grads = _loss_and_grad(llama, batch, reference, config)
        leaves = [np.asarray(g) for g in jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_inexact_array))]
        results[layout] = (float(loss), {k: float(v) for k, v in metrics.items()}, leaves, arrays["loss_mask"].sum())
    want_loss, want_metrics, want_leaves, tokens = results["padded"]
    assert abs(want_loss) > 1e-3 and want_metrics["kl"] > 1e-3
    for layout in ("packed", "shared"):
        loss, metrics, leaves, _ = results[layout]
        # the loss sums `tokens` per-token terms of the size of the logprobs (≤ 8 here)
        assert abs(loss - want_loss) <= bound(8.0, int(tokens)), (layout, loss, want_loss)
        for key in ("policy_loss", "kl", "num_tokens", "entropy", "ratio_mean", "is_weight_mean"):
            assert abs(metrics[key] - want_metrics[key]) <= bound(max(8.0, abs(want_metrics[key])), int(tokens)), key
        for g, w in zip(leaves, want_leaves):
            # a parameter's gradient sums one term per token position of the batch
            np.testing.assert_allclose(g, w, rtol=0, atol=bound(float(np.abs(w).max()), 4 * int(tokens)),
                                       err_msg=f"{name} {layout}")


def test_a_segment_cannot_see_its_neighbour(llama):
    rollouts = make_rollouts(2, groups=6)  # enough blocks that rows of the longest block's length hold two
    for layout in ("packed", "shared"):
        arrays = arrays_for(rollouts, layout)
        row = int(np.argmax((arrays["segment_ids"] >= 0).sum(1)))
        segments = np.unique(arrays["segment_ids"][row][arrays["segment_ids"][row] >= 0])
        assert segments.size >= 2
        before = logprobs_of(llama, arrays)
        changed = {k: v.copy() for k, v in arrays.items()}
        first = arrays["segment_ids"][row] == segments[0]
        changed["input_ids"][row, first] = (arrays["input_ids"][row, first] + 1) % VOCAB
        after = logprobs_of(llama, changed)
        others = (arrays["segment_ids"][row] != segments[0]) & (arrays["loss_mask"][row] > 0)
        # the target slot just before a segment starts belongs to the previous one: skip the boundary
        assert others.any()
        np.testing.assert_array_equal(after[row, others], before[row, others])
        assert not np.array_equal(after[row, first & (arrays["loss_mask"][row] > 0)],
                                  before[row, first & (arrays["loss_mask"][row] > 0)])


def test_a_response_sees_its_prompt_but_not_its_siblings(llama):
    rollouts = make_rollouts(3, groups=1, samples=3, multi_turn=False)
    arrays = arrays_for(rollouts, "shared", row_multiple=1)
    assert arrays["input_ids"].shape[0] == 1 and (arrays["segment_ids"][0] == 0).sum() == \
        rollouts[0].num_tokens + sum(r.response_tokens.size for r in rollouts[1:])  # one block: prompt once
    before = logprobs_of(llama, arrays)
    first, second = (arrays["weight_step"][0] == 0), (arrays["weight_step"][0] == 1)
    sibling = {k: v.copy() for k, v in arrays.items()}
    sibling["input_ids"][0, arrays["response_ids"][0] == 1] += 1  # response 1's tokens (rollout 0)
    after = logprobs_of(llama, sibling)
    # response 2's logprobs do not move when response 1's tokens change (its first target reads the prompt)
    np.testing.assert_array_equal(after[0, second], before[0, second])
    prompt = {k: v.copy() for k, v in arrays.items()}
    prompt["input_ids"][0, 0] = (prompt["input_ids"][0, 0] + 1) % VOCAB
    moved = logprobs_of(llama, prompt)
    assert not np.allclose(moved[0, first], before[0, first]) and not np.allclose(moved[0, second], before[0, second])


def test_positions_restart_and_first_tokens_read_the_prompts_last_position():
    rollouts = make_rollouts(4, groups=2, samples=2, multi_turn=False)
    # a third group of exactly 96 tokens (a row length) fills row 0, so the two groups above share row 1
    long = [dataclasses.replace(rollouts[0], prompt_tokens=np.arange(8), response_tokens=np.ones(44, np.int64),
                                response_logprobs=np.full(44, -1.0, np.float32), loss_mask=np.ones(44, bool),
                                token_rewards=np.zeros(44), group_id="long",
                                metadata=dataclasses.replace(rollouts[0].metadata, weight_step=4 + k))
            for k in range(2)]
    arrays = arrays_for(rollouts + long, "shared", row_multiple=1, max_length=128, min_bucket=96)  # rows of 96 or 128
    assert arrays["input_ids"].shape == (2, 96) and set(arrays["segment_ids"][0]) == {0}
    arrays = {k: v[1:] for k, v in arrays.items()}
    pos, src, resp, seg = (arrays[k][0] for k in ("position_ids", "source_positions", "response_ids", "segment_ids"))
    for s in (0, 1):
        block = seg == s
        start = int(np.flatnonzero(block)[0])
        rs = sorted({int(w) for w in arrays["weight_step"][0][block | np.roll(block, -1)] if w >= 0})
        p = rollouts[rs[0]].prompt_tokens.size
        assert len(rs) == 2 and np.array_equal(arrays["input_ids"][0, start:start + p], rollouts[rs[0]].prompt_tokens)
        np.testing.assert_array_equal(pos[start:start + p], np.arange(p))
        for j, i in enumerate(rs, start=1):
            tokens = np.flatnonzero(block & (resp == j))
            n = rollouts[i].response_tokens.size
            np.testing.assert_array_equal(pos[tokens], np.arange(p, p + n))  # responses continue the prompt
            np.testing.assert_array_equal(arrays["input_ids"][0, tokens], rollouts[i].response_tokens)
            assert src[tokens[0] - 1] == start + p - 1  # first token predicted from the prompt's last position
            assert arrays["target_ids"][0, tokens[0] - 1] == rollouts[i].response_tokens[0]
    untouched = np.ones_like(src, bool)
    for s in (0, 1):
        block = np.flatnonzero((seg == s) & (resp > 1))
        untouched[[t - 1 for t in block if resp[t - 1] != resp[t]]] = False
    np.testing.assert_array_equal(src[untouched], np.flatnonzero(untouched))  # elsewhere a target reads its own


def test_packing_is_deterministic_and_fills_rows():
    rollouts = make_rollouts(5, groups=6, samples=4)
    for layout in ("packed", "shared"):
        a, b = arrays_for(rollouts, layout), arrays_for(list(rollouts), layout)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    shared, packed = arrays_for(rollouts, "shared"), arrays_for(rollouts, "packed")
    padded = arrays_for(rollouts, "padded")
    assert shared["input_ids"].size <= packed["input_ids"].size < padded["input_ids"].size
    assert (shared["segment_ids"] >= 0).sum() < (packed["segment_ids"] >= 0).sum()  # prompts once per group
    # every layout trains the same tokens with the same sampler logprobs and advantages
    for name in ("sampler_logprobs", "advantages", "temperature"):
        want = per_rollout(padded, padded[name])
        for arrays in (shared, packed):
            for x, y in zip(per_rollout(arrays, arrays[name]), want):
                np.testing.assert_array_equal(x, y)
    assert shared["loss_mask"].sum() == packed["loss_mask"].sum() == padded["loss_mask"].sum()
    # first-fit decreasing: ties keep their order; a group too long for a row is split with its prompt repeated
    assert plan_rows([1, 1, 1], [[0], [1], [2]], [3, 3, 3], length=8, split=False) == [[(0, [0]), (1, [1])], [(2, [2])]]
    assert plan_rows([2], [[0, 1, 2]], [3, 3, 3], length=8, split=True) == [[(0, [0, 1])], [(0, [2])]]


def test_row_counts_and_lengths_come_from_ladders_so_a_run_compiles_few_shapes():
    """Rows as long as the longest block (not max_length for short rollouts); row counts on a ladder: over
    batches of 1..64 rollouts of 4 tokens the (rows, length) shapes are few and padding rows stay <= 1/4."""
    assert [row_bucket(n) for n in (1, 8, 9, 11, 16, 17, 33, 65)] == [1, 8, 10, 12, 16, 20, 40, 80]
    one = make_rollouts(0, groups=1, samples=1, multi_turn=False)[0]
    shapes = set()
    for n in range(1, 65):
        rollouts = [dataclasses.replace(one, prompt_tokens=np.array([1, 2]), response_tokens=np.array([3, 4]),
                                        response_logprobs=np.zeros(2, np.float32), loss_mask=np.ones(2, bool),
                                        token_rewards=np.zeros(2), group_id=f"g{i}") for i in range(n)]
        arrays = pack_rollouts(rollouts, np.ones(n), batch_size=64, row_multiple=1,
                               config=BatchingConfig(max_length=256, min_bucket=8, layout="packed"))
        rows, length = arrays["input_ids"].shape
        assert length == 8  # the smallest bucket that holds a 4-token rollout, not max_length
        real = int((arrays["segment_ids"] >= 0).any(axis=1).sum())
        assert real == math.ceil(n / 2) and (rows - real) * 4 <= rows
        shapes.add(rows)
    assert sorted(shapes) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32]


def test_rows_come_in_multiples_and_a_too_long_rollout_names_the_field():
    rollouts = make_rollouts(6)
    for m in (1, 2, 4):
        for layout in LAYOUTS:
            assert arrays_for(rollouts, layout, row_multiple=m)["input_ids"].shape[0] % m == 0
    with pytest.raises(ValueError, match=r"rollout \d+ \(group 'g\d'\) has \d+ tokens .* BatchingConfig.max_length=8"):
        arrays_for(rollouts, "shared", max_length=8)
    # constant normalization still counts every rollout slot: Σ sequence_slots = batch_size
    for layout in LAYOUTS:
        assert arrays_for(rollouts, layout)["sequence_slots"].sum() == pytest.approx(len(rollouts) + 2)


def _short_rollouts(n: int) -> list[Rollout]:
    one = make_rollouts(0, groups=1, samples=1, multi_turn=False)[0]
    return [dataclasses.replace(one, prompt_tokens=np.array([1, 2]), response_tokens=np.array([3, 4]),
                                response_logprobs=np.zeros(2, np.float32), loss_mask=np.ones(2, bool),
                                token_rewards=np.zeros(2), group_id=f"g{i}") for i in range(n)]


def test_a_microbatch_aligns_rows_only_past_one_microbatch():
    config = BatchingConfig(max_length=256, min_bucket=8, layout="packed")
    rows = [pack_rollouts(_short_rollouts(n), np.ones(n), batch_size=64, config=config, row_multiple=2,
                          microbatch_rows=8)["input_ids"].shape[0] for n in (2, 6, 14, 20, 40)]
    assert rows == [2, 4, 8, 16, 24]  # 1, 3 real rows: multiples of 2; 7, 10, 20: one microbatch, then whole ones
    with pytest.raises(ValueError, match="microbatch_rows must be a positive multiple of row_multiple=4, got 6"):
        pack_rollouts(_short_rollouts(2), np.ones(2), batch_size=64, config=config, row_multiple=4, microbatch_rows=6)


def test_the_trainer_pads_packed_rows_to_its_data_parallel_size_not_to_the_whole_batch():
    """Levanter fills an unset per_device_parallelism with the whole batch (microbatch_size = train_batch_size):
    aligning rows to that microbatch padded every packed batch back to train_batch_size rows."""
    from marinrl.levanter_configs import cpu_trainer_config
    from marinrl.train.batching import row_alignment

    plain = cpu_trainer_config(train_batch_size=64)
    plain._validate_and_set_defaults()  # what levanter.initialize(config) does to the worker's config
    assert plain.microbatch_size == 64  # the reason row_alignment exists
    aligned = row_alignment(plain)
    assert aligned == {"row_multiple": plain.data_axis_size, "microbatch_rows": None}
    arrays = pack_rollouts(_short_rollouts(12), np.ones(12), batch_size=64, **aligned,
                           config=BatchingConfig(max_length=256, min_bucket=8, layout="packed"))
    d = plain.data_axis_size  # 12 blocks of 4 tokens fill 6 rows of 8, then whole rows for each device
    assert arrays["input_ids"].shape[0] == math.ceil(6 / d) * d < 64
    accumulating = cpu_trainer_config(train_batch_size=64, per_device_parallelism=2)
    accumulating._validate_and_set_defaults()
    assert row_alignment(accumulating) == {"row_multiple": accumulating.data_axis_size,
                                           "microbatch_rows": 2 * accumulating.data_axis_size}


def _groups(groups: int, samples: int, prompt: int, response: int) -> list[Rollout]:
    one = make_rollouts(0, groups=1, samples=1, multi_turn=False)[0]
    return [dataclasses.replace(one, prompt_tokens=np.arange(1, prompt + 1), response_tokens=np.full(response, 7),
                                response_logprobs=np.zeros(response, np.float32), loss_mask=np.ones(response, bool),
                                token_rewards=np.zeros(response), group_id=f"g{g}")
            for g in range(groups) for _ in range(samples)]


@pytest.mark.parametrize("shape, break_even, want", [
    # 8 groups of 8 x 32-token responses to 16-token prompts (a group is 272 tokens, more than a row):
    ((8, 8, 16, 32), 384, 48),  # hidden 128: sharing 16 prompt tokens is not worth longer rows: one per row
    ((8, 8, 16, 32), 10**6, 256),  # layers that dwarf attention: the fewest positions (10 rows of 256)
    ((32, 16, 5, 1), 192, 24),  # the quickstart (hidden 64): a group (5 + 16 tokens) in one 24-token row
    ((32, 16, 5, 1), 1, 8),  # attention alone: the shortest rows, the prompt repeated for every 3 responses
])
def test_shared_rows_take_the_length_that_costs_least(shape, break_even, want):
    rollouts = _groups(*shape)
    config = BatchingConfig(max_length=256, min_bucket=8, layout="shared", attention_break_even=break_even)
    arrays = pack_rollouts(rollouts, np.ones(len(rollouts)), batch_size=len(rollouts), config=config)
    assert arrays["input_ids"].shape[1] == want
    assert arrays["loss_mask"].sum() == sum(r.response_tokens.size for r in rollouts)  # every token, once


def test_the_break_even_comes_from_the_model_unless_set():
    assert BatchingConfig().for_model(64).attention_break_even == 192
    assert BatchingConfig(attention_break_even=100).for_model(64).attention_break_even == 100
    assert BatchingConfig().for_model(None).attention_break_even is None
    with pytest.raises(ValueError, match="attention_break_even must be >= 1"):
        BatchingConfig(attention_break_even=0)


@pytest.mark.parametrize("block", [24, 8])
def test_the_flash_attention_gives_the_vanilla_attentions_logprobs_and_gradient(block):
    """`attn_backend: auto` runs Levanter's JAX flash attention where Levanter's default would keep every layer's
    scores (a GPU without Transformer Engine, config/model.attention_backend_on): under the shared layout's mask
    (causal, inside a block, a response sees its prompt and itself) it gives the vanilla attention's logprobs
    and loss gradient, in one block of keys (`block` 24: the whole row, as `with_flash_blocks` takes it on a GPU)
    and in several (8 keys)."""
    from levanter.layers.attention import AttentionBackend

    flash, vanilla = _llama_with(AttentionBackend.JAX_FLASH, block), _llama_with(AttentionBackend.VANILLA)
    arrays = arrays_for(make_rollouts(2), "shared")
    assert arrays["input_ids"].shape[1] == 24
    batch = TrainingBatch.from_numpy(arrays)
    got, want = logprobs_of(flash, arrays), logprobs_of(vanilla, arrays)
    scale = float(np.abs(want).max())
    assert scale > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=bound(scale, 64))
    config = LossConfig.preset("grpo")
    tokens = int(arrays["loss_mask"].sum())
    (loss_f, _), grads_f = _loss_and_grad(flash, batch, None, config)
    (loss_v, _), grads_v = _loss_and_grad(vanilla, batch, None, config)
    assert abs(float(loss_f) - float(loss_v)) <= bound(8.0, tokens)
    leaves = [jax.tree_util.tree_leaves(eqx.filter(g, eqx.is_inexact_array)) for g in (grads_f, grads_v)]
    for g, w in zip(*leaves):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                                   atol=bound(float(np.abs(np.asarray(w)).max()), 4 * tokens))


def _llama_with(backend, block=None, seq_len=64):
    from levanter.models.llama import LlamaConfig, LlamaLMHeadModel

    config = LlamaConfig(seq_len=seq_len, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, initializer_range=0.3, attn_backend=backend, flash_attention_block_size=block)
    return eqx.filter_jit(LlamaLMHeadModel.init)(hax.Axis("vocab", VOCAB), config, key=jax.random.PRNGKey(0))


def _blocks(model) -> set:
    from levanter.layers.attention import Attention

    layers = jax.tree_util.tree_leaves(model, is_leaf=lambda x: isinstance(x, Attention))
    return {x.config.flash_attention_block_size for x in layers if isinstance(x, Attention)}


def test_flash_blocks_divide_the_row_and_leave_other_backends_alone():
    """The block is the largest divisor of the row up to 1,024; on a CPU rows shorter than that keep Levanter's
    vanilla fallback (no block set); a vanilla model and a model with a block of its own are left as they are."""
    from levanter.layers.attention import AttentionBackend

    from marinrl.train.policy_forward import flash_block, with_flash_blocks

    assert [flash_block(n) for n in (24, 768, 1024, 1536, 2048, 3072, 1100, 1031)] == \
        [24, 768, 1024, 768, 1024, 1024, 550, 1]
    flash = _llama_with(AttentionBackend.JAX_FLASH)
    assert _blocks(flash) == {None}
    assert _blocks(with_flash_blocks(flash, 48, "cpu")) == {None}
    assert _blocks(with_flash_blocks(flash, 48, "gpu")) == {48}
    assert _blocks(with_flash_blocks(flash, 1536, "cpu")) == {768}
    assert _blocks(with_flash_blocks(_llama_with(AttentionBackend.VANILLA), 1536, "gpu")) == {None}
    assert _blocks(with_flash_blocks(_llama_with(AttentionBackend.JAX_FLASH, 8), 48, "gpu")) == {8}


def test_a_row_longer_than_one_block_and_not_a_multiple_of_it_trains():
    """A 1,536-token row (the geometric ladder's bucket after 1,024): Levanter's flash attention at its own block
    of 1,024 raises on it; with the row's block (768) it gives the vanilla attention's logprobs."""
    from levanter.layers.attention import AttentionBackend

    rng = np.random.default_rng(3)
    rollouts = [Rollout(prompt_tokens=rng.integers(0, VOCAB, 700), response_tokens=rng.integers(0, VOCAB, 700),
                        response_logprobs=np.full(700, -1.0, np.float32), temperature=1.0,
                        loss_mask=np.ones(700, bool), token_rewards=np.zeros(700), episode_reward=0.0,
                        finish_reason="stop", env_name="e", lesson_id="l", group_id="g",
                        metadata=RolloutMetadata("w", 0, 0.0))]
    arrays = arrays_for(rollouts, "padded", row_multiple=1, max_length=2048, min_bucket=16)
    assert arrays["input_ids"].shape[1] == 1536
    with pytest.raises(ValueError, match="not a multiple of 1024"):  # Levanter's own block (set: left alone)
        logprobs_of(_llama_with(AttentionBackend.JAX_FLASH, 1024, seq_len=2048), arrays)
    flash = _llama_with(AttentionBackend.JAX_FLASH, seq_len=2048)
    vanilla = _llama_with(AttentionBackend.VANILLA, seq_len=2048)
    want = logprobs_of(vanilla, arrays)
    np.testing.assert_allclose(logprobs_of(flash, arrays), want, rtol=0,
                               atol=bound(float(np.abs(want).max()), 1536))
