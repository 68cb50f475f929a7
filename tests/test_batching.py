"""Batching: buckets, fixed shapes, padding rows, and the target alignment of every per-token field."""

from __future__ import annotations

import haliax as hax
import jax
import numpy as np
import pytest

from marinrl.config.batching import BatchingConfig
from marinrl.train.batching import PAD_ROW_WEIGHT_STEP, TrainingBatch, make_training_batch, pack_rollouts
from marinrl.types import Rollout, RolloutMetadata


def rollout(prompt, response, *, mask=None, logprobs=None, temperature=1.0, w=0, gid="g") -> Rollout:
    n = len(response)
    return Rollout(
        prompt_tokens=np.array(prompt, dtype=np.int64), response_tokens=np.array(response, dtype=np.int64),
        response_logprobs=np.array(logprobs if logprobs is not None else [-0.5] * n),
        temperature=temperature, loss_mask=np.array(mask if mask is not None else [1] * n),
        token_rewards=np.zeros(n), episode_reward=0.0, finish_reason="stop", env_name="env", lesson_id="lesson",
        group_id=gid, metadata=RolloutMetadata("w0", w, 0.0))


SMALL = BatchingConfig(max_length=16, min_bucket=8, layout="padded")  # buckets 8, 12, 16; one rollout per row


def test_bucket_lengths():
    # Geometric: powers of two with a 1.5x step inside each octave, from any min_bucket.
    assert BatchingConfig(max_length=1000, min_bucket=64).bucket_lengths() == (
        64, 96, 128, 192, 256, 384, 512, 768, 1000)
    assert BatchingConfig(max_length=1024, min_bucket=64).bucket_lengths() == (
        64, 96, 128, 192, 256, 384, 512, 768, 1024)
    assert BatchingConfig(max_length=64).bucket_lengths() == (16, 24, 32, 48, 64)
    assert BatchingConfig(max_length=40, min_bucket=5).bucket_lengths() == (5, 6, 8, 12, 16, 24, 32, 40)
    assert BatchingConfig(max_length=200, buckets="multiple", min_bucket=64).bucket_lengths() == (64, 128, 192, 200)
    assert BatchingConfig(max_length=256, buckets="multiple", min_bucket=128, bucket_multiple=32).bucket_lengths() \
        == (128, 160, 192, 224, 256)
    assert BatchingConfig(max_length=32, min_bucket=64).bucket_lengths() == (32,)
    config = BatchingConfig(max_length=1000, min_bucket=64)
    assert [config.bucket_for(n) for n in (1, 64, 65, 97, 128, 129, 513, 769, 1000)] == \
        [64, 64, 96, 128, 128, 192, 768, 1000, 1000]
    # The reference shape (16 prompt + 32 response tokens) is not padded; no row is padded by half or more.
    assert BatchingConfig().bucket_for(48) == 48
    assert all(BatchingConfig().bucket_for(n) < 1.5 * n for n in range(17, 2049))
    with pytest.raises(ValueError, match="1001 tokens does not fit BatchingConfig.max_length=1000"):
        config.bucket_for(1001)


@pytest.mark.parametrize("bad", [dict(buckets="fib"), dict(layout="dense"), dict(max_length=1), dict(min_bucket=0),
                                 dict(bucket_multiple=0), dict(pad_token_id=-1)])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        BatchingConfig(**bad)


def test_alignment_masks_and_padding_by_hand():
    # A multi-turn rollout: 9 is an environment token (mask 0) between two policy tokens; 10 is the
    # stop token the policy sampled, trained like any other.
    a = rollout([5, 6, 7], [8, 9, 10], mask=[1, 0, 1], logprobs=[-0.1, -0.2, -0.3], temperature=0.7, w=3)
    b = rollout([1], [2, 3], logprobs=[-0.5, -0.6], w=4)
    arrays = pack_rollouts([a, b], [2.0, -1.0], batch_size=3, config=SMALL)
    # 6 tokens at most: bucket 8 (8, 12, 16).
    np.testing.assert_array_equal(arrays["input_ids"], [[5, 6, 7, 8, 9, 10, 0, 0],
                                                        [1, 2, 3, 0, 0, 0, 0, 0],
                                                        [0, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(arrays["target_ids"], [[6, 7, 8, 9, 10, 0, 0, 0],
                                                         [2, 3, 0, 0, 0, 0, 0, 0],
                                                         [0, 0, 0, 0, 0, 0, 0, 0]])
    # Index t describes target_ids[t]: the prompt's targets (6, 7) and the env token 9 are not trained.
    np.testing.assert_array_equal(arrays["loss_mask"], [[0, 0, 1, 0, 1, 0, 0, 0],
                                                        [1, 1, 0, 0, 0, 0, 0, 0],
                                                        [0, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_allclose(arrays["sampler_logprobs"], [[0, 0, -0.1, 0, -0.3, 0, 0, 0],
                                                            [-0.5, -0.6, 0, 0, 0, 0, 0, 0],
                                                            [0, 0, 0, 0, 0, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_array_equal(arrays["advantages"], [[0, 0, 2, 0, 2, 0, 0, 0],
                                                         [-1, -1, 0, 0, 0, 0, 0, 0],
                                                         [0, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_allclose(arrays["temperature"], [[1, 1, 0.7, 1, 0.7, 1, 1, 1], [1] * 8, [1] * 8], rtol=1e-6)
    pad = PAD_ROW_WEIGHT_STEP
    np.testing.assert_array_equal(arrays["weight_step"], [[pad, pad, 3, pad, 3, pad, pad, pad],
                                                          [4, 4] + [pad] * 6, [pad] * 8])
    np.testing.assert_array_equal(arrays["sequence_ids"], [[-1, -1, 0, -1, 0, -1, -1, -1], [0, 0] + [-1] * 6, [-1] * 8])
    np.testing.assert_array_equal(arrays["position_ids"], [[0, 1, 2, 3, 4, 5, 0, 0], [0, 1, 2] + [0] * 5, [0] * 8])
    np.testing.assert_array_equal(arrays["source_positions"], np.tile(np.arange(8), (3, 1)))
    np.testing.assert_array_equal(arrays["response_ids"], [[0, 0, 0, 1, 1, 1, 0, 0], [0, 1, 1] + [0] * 5, [0] * 8])
    np.testing.assert_array_equal(arrays["segment_ids"], [[0] * 6 + [-1] * 2, [0] * 3 + [-1] * 5, [-1] * 8])
    np.testing.assert_allclose(arrays["sequence_slots"], [1, 1, 1])
    assert {k: v.dtype for k, v in arrays.items()} == {
        "input_ids": np.int32, "target_ids": np.int32, "source_positions": np.int32, "position_ids": np.int32,
        "segment_ids": np.int32, "response_ids": np.int32, "sequence_ids": np.int32, "loss_mask": np.float32,
        "sampler_logprobs": np.float32, "advantages": np.float32, "temperature": np.float32,
        "weight_step": np.int32, "sequence_slots": np.float32}


def test_every_trained_target_is_the_response_token_with_its_logprob():
    rng = np.random.default_rng(0)
    rollouts, advantages = [], []
    for i in range(6):
        p, r = int(rng.integers(1, 10)), int(rng.integers(1, 20))
        mask = rng.integers(0, 2, r)
        rollouts.append(rollout(rng.integers(0, 500, p), rng.integers(0, 500, r), mask=mask,
                                logprobs=-rng.random(r), gid=f"g{i}"))
        advantages.append(float(rng.normal()))
    config = BatchingConfig(max_length=64, min_bucket=8, layout="padded")
    arrays = pack_rollouts(rollouts, advantages, batch_size=8, config=config)
    for i, r in enumerate(rollouts):
        trained = np.flatnonzero(arrays["loss_mask"][i])
        j = trained - (r.prompt_tokens.size - 1)  # response index of each trained target
        np.testing.assert_array_equal(j, np.flatnonzero(r.loss_mask))
        np.testing.assert_array_equal(arrays["target_ids"][i, trained], r.response_tokens[j])
        np.testing.assert_array_equal(arrays["input_ids"][i, trained + 1], r.response_tokens[j])
        np.testing.assert_allclose(arrays["sampler_logprobs"][i, trained], r.response_logprobs[j])
        assert np.all(arrays["advantages"][i, trained] == np.float32(advantages[i]))
        assert arrays["loss_mask"][i].sum() == r.loss_mask.sum()
    assert arrays["loss_mask"][6:].sum() == 0


def test_untrainable_rows_keep_their_tokens_but_no_mask():
    a, b = rollout([1], [2, 3]), rollout([1], [4, 5, 6])
    arrays = pack_rollouts([a, b], [1.0, -1.0], batch_size=2, config=SMALL, trainable=np.array([True, False]))
    np.testing.assert_array_equal(arrays["input_ids"][1, :4], [1, 4, 5, 6])
    assert arrays["loss_mask"][1].sum() == 0 and arrays["advantages"][1].sum() == 0
    assert arrays["loss_mask"][0].sum() == 2
    with pytest.raises(ValueError, match="trainable must be 2 booleans"):
        pack_rollouts([a, b], [1.0, -1.0], batch_size=2, config=SMALL, trainable=[1, 0])


def test_pad_token_fills_padding():
    config = BatchingConfig(max_length=8, min_bucket=4, pad_token_id=99, layout="padded")
    arrays = pack_rollouts([rollout([1], [2])], [0.5], batch_size=2, config=config)
    np.testing.assert_array_equal(arrays["input_ids"], [[1, 2, 99, 99], [99, 99, 99, 99]])
    np.testing.assert_array_equal(arrays["target_ids"], [[2, 99, 99, 99], [99, 99, 99, 99]])


def test_shapes_come_from_the_buckets_only():
    config = BatchingConfig(max_length=64, min_bucket=8, layout="padded")
    shapes = {pack_rollouts([rollout([1] * p, [2] * r)], [0.0], batch_size=4, config=config)["input_ids"].shape
              for p in (1, 5, 20) for r in (1, 7, 30, 40) if p + r <= 64}
    assert shapes == {(4, 8), (4, 12), (4, 24), (4, 32), (4, 48), (4, 64)}


def test_errors_name_the_problem():
    ok = rollout([1], [2, 3])
    with pytest.raises(ValueError, match="3 rollouts do not fit a batch of 2 rows"):
        pack_rollouts([ok] * 3, [0.0] * 3, batch_size=2, config=SMALL)
    with pytest.raises(ValueError, match=r"advantages must have one entry per rollout \(1\), got 2"):
        pack_rollouts([ok], [0.0, 1.0], batch_size=2, config=SMALL)
    with pytest.raises(ValueError, match=r"advantages\[0\] must be finite"):
        pack_rollouts([ok], [np.nan], batch_size=2, config=SMALL)
    with pytest.raises(ValueError, match=r"advantages\[0\] must be a number or 2 per-token values"):
        pack_rollouts([ok], [np.zeros(3)], batch_size=2, config=SMALL)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_rollouts([rollout([], [2, 3])], [0.0], batch_size=2, config=SMALL)
    with pytest.raises(ValueError, match=r"group 'long'\) has 17 tokens \(7 prompt \+ 10 response\), more than a "
                                         r"row holds: BatchingConfig.max_length=16"):
        pack_rollouts([rollout([1] * 7, [2] * 10, gid="long")], [0.0], batch_size=2, config=SMALL)
    with pytest.raises(ValueError, match="zero rollouts"):
        pack_rollouts([], [], batch_size=2, config=SMALL)


def test_training_batch_is_named_and_matches_the_numpy_arrays():
    rollouts = [rollout([5, 6, 7], [8, 9, 10], mask=[1, 0, 1], w=3), rollout([1], [2, 3], w=4)]
    arrays = pack_rollouts(rollouts, [2.0, -1.0], batch_size=4, config=SMALL)
    batch = make_training_batch(rollouts, [2.0, -1.0], batch_size=4, config=SMALL)
    assert isinstance(batch, TrainingBatch)
    assert batch.Batch == hax.Axis("batch", 4) and batch.Pos == hax.Axis("position", 8)
    for name, arr in arrays.items():
        field = getattr(batch, name)
        assert isinstance(field.array, jax.Array)
        assert field.axes == ((batch.Batch, batch.Pos) if arr.ndim == 2 else (batch.Batch,))
        np.testing.assert_array_equal(np.asarray(field.array), arr)
        assert field.array.dtype == arr.dtype
    same = TrainingBatch.from_rollouts(rollouts, [2.0, -1.0], batch_size=4, config=SMALL)
    assert np.array_equal(np.asarray(same.advantages.array), np.asarray(batch.advantages.array))


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_each_trained_token_carries_the_weight_step_that_sampled_it(layout):
    """In-flight swaps stamp tokens of one rollout with several steps: the batch keeps each token's own."""
    import dataclasses

    mixed = dataclasses.replace(rollout([1, 2], [5, 6, 7, 8], w=3), weight_steps=np.array([3, 3, 4, 5]))
    plain = rollout([1, 2], [9, 9], w=3, gid="g")
    arrays = pack_rollouts([mixed, plain], [1.0, -1.0], batch_size=2,
                           config=BatchingConfig(max_length=16, min_bucket=8, layout=layout))
    trained = arrays["loss_mask"] > 0
    steps = sorted(arrays["weight_step"][trained].tolist())
    assert steps == [3, 3, 3, 3, 4, 5]
    assert np.all(arrays["weight_step"][~trained] == PAD_ROW_WEIGHT_STEP)
