import dataclasses

import numpy as np
import pytest
from factories import make_batch, make_rollout

from marinrl.types import RolloutBatch, RolloutGroup, RolloutMetadata, RolloutValidationError


def test_valid_rollout_normalizes_dtypes():
    r = make_rollout(prompt_tokens=[1, 2], response_tokens=[3, 4, 5], loss_mask=[1, 0, 1])
    assert r.prompt_tokens.dtype == np.int32 and r.response_tokens.dtype == np.int32
    assert r.response_logprobs.dtype == np.float32 and r.token_rewards.dtype == np.float32
    assert r.loss_mask.dtype == np.bool_ and r.loss_mask.tolist() == [True, False, True]
    assert r.num_tokens == 5


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(response_logprobs=np.zeros(2)), "response_logprobs"),
        (dict(loss_mask=np.ones(4)), "loss_mask"),
        (dict(token_rewards=np.zeros(1)), "token_rewards"),
        (dict(token_rewards=np.array([0, np.nan, 1.0])), "token_rewards"),
        (dict(response_logprobs=np.array([-1, -np.inf, -1.0])), "response_logprobs"),
        (dict(response_logprobs=np.array([-1, 0.5, -1.0])), "response_logprobs"),
        (dict(episode_reward=float("nan")), "episode_reward"),
        (dict(episode_reward=float("inf")), "episode_reward"),
        (dict(prompt_tokens=np.array([1, -2])), "prompt_tokens"),
        (dict(response_tokens=np.array([1, -1, 2])), "response_tokens"),
        (dict(response_tokens=np.array([1.5, 2.0, 3.0])), "response_tokens"),
        (dict(response_tokens=np.array([1, 2, 2**40])), "response_tokens"),
        (dict(finish_reason="eos"), "finish_reason"),
        (dict(loss_mask=np.array([0, 2, 1])), "loss_mask"),
        (dict(temperature=-1.0), "temperature"),
        (dict(group_id=""), "group_id"),
        (dict(metadata="w0"), "metadata"),
        (dict(weight_steps=np.array([5, 5])), "weight_steps"),
        (dict(weight_steps=np.array([5, 6, 5])), "weight_steps"),
        (dict(weight_steps=np.array([4, 5, 5])), "weight_steps"),  # below the rollout's weight_step 5
        (dict(weight_steps=np.array([5.0, 5.0, 6.0])), "weight_steps"),
    ],
)
def test_inconsistent_rollout_names_the_field(overrides, field):
    with pytest.raises(RolloutValidationError, match=rf"Rollout\.{field}:"):
        make_rollout(response_len=3, weight_step=5, **overrides)


def test_token_weight_steps_default_to_the_rollout_weight_step_and_survive_stamping():
    plain = make_rollout(response_len=3, weight_step=4)
    assert plain.weight_steps is None and plain.token_weight_steps.tolist() == [4, 4, 4]
    assert plain == make_rollout(response_len=3, weight_step=4, weight_steps=[4, 4, 4])  # the same rollout
    mixed = make_rollout(response_len=3, weight_step=0, weight_steps=[4, 4, 6])  # unstamped, as envs make them
    assert mixed.token_weight_steps.dtype == np.int64 and mixed != plain
    stamped = dataclasses.replace(mixed, metadata=RolloutMetadata("w0", 4))
    assert stamped.token_weight_steps.tolist() == [4, 4, 6]
    with pytest.raises(RolloutValidationError, match="below the rollout's metadata.weight_step 5"):
        dataclasses.replace(mixed, metadata=RolloutMetadata("w0", 5))


def test_empty_response_is_rejected():
    with pytest.raises(RolloutValidationError, match="response_tokens: is empty"):
        make_rollout(response_len=0)


def test_metadata_validation():
    with pytest.raises(RolloutValidationError, match="weight_step"):
        RolloutMetadata("w", -1)
    with pytest.raises(RolloutValidationError, match="worker_id"):
        RolloutMetadata("", 0)
    with pytest.raises(RolloutValidationError, match="weight_step"):
        RolloutMetadata("w", 1.5)


def test_group_and_batch_validation():
    with pytest.raises(RolloutValidationError, match="RolloutGroup.rollouts: is empty"):
        RolloutGroup(())
    with pytest.raises(RolloutValidationError, match="mixes group_ids"):
        RolloutGroup((make_rollout("a"), make_rollout("b")))
    g = RolloutGroup((make_rollout("a", reward=1.0), make_rollout("a", reward=0.0)))
    assert g.group_id == "a" and len(g) == 2 and g.rewards.tolist() == [1.0, 0.0]
    meta = RolloutMetadata("w0", 0)
    with pytest.raises(RolloutValidationError, match="RolloutBatch.groups: is empty"):
        RolloutBatch((), meta)
    with pytest.raises(RolloutValidationError, match="repeats group_id"):
        RolloutBatch((g, g), meta)
    with pytest.raises(RolloutValidationError, match="weight_step 0 in a batch of weight_step 3"):
        RolloutBatch((g,), RolloutMetadata("w0", 3))


def test_batch_accessors():
    b = make_batch(n_groups=3, group_size=2, weight_step=5)
    assert len(b) == 6 and len(b.rollouts) == 6 and b.weight_step == 5


def test_rollout_equality_compares_arrays_and_dtypes():
    a = make_rollout()
    assert a == make_rollout()
    assert a != make_rollout(episode_reward=0.5)
    assert a != make_rollout(response_tokens=a.response_tokens + 1)
