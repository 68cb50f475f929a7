"""Builders and hypothesis strategies for rollouts, shared by the tests."""

from __future__ import annotations

import uuid

import numpy as np
from hypothesis import strategies as st

from marinrl.types import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata


def encode_batch_v1(batch: RolloutBatch) -> bytes:
    """The bytes the version-1 writer made of `batch` (no `weight_steps` column, format_version "1"):
    for batches a checked-in v1 file cannot hold (tests/test_storage.py checks that this layout is the
    one of tests/fixtures/rollouts_format_v1.parquet). Version 1 cannot say that tokens came from
    newer weights, so such rollouts are refused."""
    import io

    import pyarrow.parquet as pq

    from marinrl.storage.format import VERSION_KEY, encode_batch

    assert all(r.weight_steps is None for r in batch.rollouts), "version 1 holds one weight step per rollout"
    table = pq.read_table(io.BytesIO(encode_batch(batch)))
    meta = {**table.schema.metadata, VERSION_KEY: b"1"}
    table = table.drop_columns(["weight_steps"]).replace_schema_metadata(meta)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="lz4", write_statistics=False)
    return sink.getvalue()


def make_rollout(
    group_id: str = "g0",
    reward: float = 1.0,
    prompt_len: int = 4,
    response_len: int = 3,
    weight_step: int = 0,
    worker_id: str = "w0",
    env_name: str = "env",
    lesson_id: str = "lesson",
    rng: np.random.Generator | None = None,
    **overrides,
) -> Rollout:
    rng = rng or np.random.default_rng(0)
    fields = dict(
        prompt_tokens=rng.integers(0, 500, prompt_len),
        response_tokens=rng.integers(0, 500, response_len),
        response_logprobs=-rng.random(response_len).astype(np.float32),
        temperature=1.0,
        loss_mask=np.ones(response_len, dtype=bool),
        token_rewards=np.where(np.arange(response_len) == response_len - 1, reward, 0.0).astype(np.float32),
        episode_reward=reward,
        finish_reason="stop",
        env_name=env_name,
        lesson_id=lesson_id,
        group_id=group_id,
        metadata=RolloutMetadata(worker_id, weight_step, 1_700_000_000.0),
    )
    fields.update(overrides)
    return Rollout(**fields)


def make_batch(n_groups: int = 2, group_size: int = 4, weight_step: int = 0, worker_id: str = "w0",
               response_len: int = 3, seed: int = 0, env_name: str = "env") -> RolloutBatch:
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(n_groups):
        gid = uuid.UUID(int=int(rng.integers(0, 2**62))).hex
        groups.append(RolloutGroup(tuple(
            make_rollout(gid, float(rng.integers(0, 2)), response_len=response_len, weight_step=weight_step,
                         worker_id=worker_id, env_name=env_name, rng=rng)
            for _ in range(group_size)
        )))
    return RolloutBatch(tuple(groups), RolloutMetadata(worker_id, weight_step, 1_700_000_000.0))


_names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF, blacklist_categories=("Cs",)),
                 min_size=1, max_size=12)
_finite32 = st.floats(-2.0**127, 2.0**127, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def rollouts(draw, group_id: str, weight_step: int, worker_id: str) -> Rollout:
    n = draw(st.integers(1, 40))
    ints = lambda size: st.lists(st.integers(0, 2**31 - 1), min_size=size, max_size=size)  # noqa: E731
    return Rollout(
        prompt_tokens=np.array(draw(st.lists(st.integers(0, 2**31 - 1), max_size=40)), dtype=np.int64),
        response_tokens=np.array(draw(ints(n))),
        response_logprobs=np.array(draw(st.lists(st.floats(-(2.0**127), 0, width=32), min_size=n, max_size=n)),
                                   dtype=np.float32),
        temperature=draw(st.floats(0, 10)),
        loss_mask=np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool),
        token_rewards=np.array(draw(st.lists(_finite32, min_size=n, max_size=n)), dtype=np.float32),
        episode_reward=draw(st.floats(-1e300, 1e300)),
        finish_reason=draw(st.sampled_from(["stop", "length"])),
        env_name=draw(_names),
        lesson_id=draw(_names),
        group_id=group_id,
        metadata=RolloutMetadata(worker_id, weight_step, draw(st.floats(0, 4e9))),
        agent_name=draw(_names),
        policy_name=draw(_names),
        # in-flight updates: each token's weight step, never below the rollout's and never decreasing
        weight_steps=draw(st.none() | st.lists(st.integers(0, 2), min_size=n, max_size=n).map(
            lambda jumps: weight_step + np.cumsum(jumps))),
    )


@st.composite
def batches(draw) -> RolloutBatch:
    weight_step = draw(st.integers(0, 10**8 - 1))
    worker = draw(_names)
    gids = draw(st.lists(_names, min_size=1, max_size=4, unique=True))
    groups = [RolloutGroup(tuple(draw(st.lists(rollouts(g, weight_step, worker), min_size=1, max_size=3))))
              for g in gids]
    return RolloutBatch(tuple(groups), RolloutMetadata(worker, weight_step, draw(st.floats(0, 4e9))))


# Advantages worked out by hand (not by the code under test), for every advantage kind.
# Group a, rewards [0, 1, 1, 0.5], G = 4: mean 2.5/4 = 0.625, centred [-0.625, 0.375, 0.375, -0.125].
#   group_mean: the centred rewards.
#   rloo: R_i - mean_{j≠i} R_j:  0 - (1+1+0.5)/3 = -0.8333…,  1 - (0+1+0.5)/3 = 0.5 (twice),
#         0.5 - (0+1+1)/3 = -0.1666…  (= centred × G/(G-1) = × 4/3).
#   group_std: population variance (0.390625 + 0.140625·2 + 0.015625)/4 = 0.171875, std 0.41457809879;
#         centred / (std + 1e-6) = -0.625/0.41457909879 = -1.50755308…, 0.375/… = 0.90453185…,
#         -0.125/… = -0.30151062….
# Group b, rewards [2, 0], G = 2: mean 1, std 1; rloo 2 - 0 = 2 and 0 - 2 = -2 (centred × 2/1);
#   group_std ±1/(1 + 1e-6) = ±0.999999.
# A group of one, [3]: every kind gives 0 (rloo has no other response to compare with).
# Equal rewards, [1, 1, 1]: every kind gives zeros.
HAND_ADVANTAGES = {
    "group_mean": {(0, 1, 1, 0.5): [-0.625, 0.375, 0.375, -0.125], (2, 0): [1.0, -1.0], (3,): [0.0],
                   (1, 1, 1): [0.0, 0.0, 0.0]},
    "rloo": {(0, 1, 1, 0.5): [-2.5 / 3, 0.5, 0.5, -0.5 / 3], (2, 0): [2.0, -2.0], (3,): [0.0],
             (1, 1, 1): [0.0, 0.0, 0.0]},
    "group_std": {(0, 1, 1, 0.5): [-1.507553087, 0.904531852, 0.904531852, -0.301510617],
                  (2, 0): [0.999999, -0.999999], (3,): [0.0], (1, 1, 1): [0.0, 0.0, 0.0]},
}
"""kind -> rewards -> advantages, to ~1e-9 (the literals above carry 9-10 significant digits)."""


def levanter_load_pretrained(path: str, dtype, mapping=None, mesh=None):
    """A Hugging Face checkpoint loaded by Levanter's own `HFCheckpointConverter.load_pretrained`, which
    reads every byte on every process: the loader `marinrl.models.hf_checkpoints` replaced, to compare with."""
    import jax.numpy as jnp
    from levanter.compat.hf_checkpoints import HFCheckpointConverter

    from marinrl.models.hf_checkpoints import _in_dtype, default_mesh, levanter_config, read_hf_config
    from marinrl.models.tokenizers import byte_tokenizer

    hf_config = read_hf_config(path)
    config = levanter_config(hf_config, path)
    converter = HFCheckpointConverter(type(config), reference_checkpoint=path, HfConfigClass=type(hf_config),
                                      tokenizer=byte_tokenizer(512))
    with default_mesh(mesh):
        model = converter.load_pretrained(config.model_type, ref=path, config=config, axis_mapping=mapping,
                                          resize_vocab_to_match_tokenizer=False, dtype=dtype)
    return _in_dtype(model, jnp.dtype(dtype))
