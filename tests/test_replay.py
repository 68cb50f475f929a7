"""Replay buffer: staleness, age, capacity, env mixing, reuse, filters, timeouts, metrics, exact resume."""

from __future__ import annotations

import dataclasses
import json
import threading

import draccus
import numpy as np
import pytest
from factories import HAND_ADVANTAGES

from marinrl.config.batching import BatchingConfig
from marinrl.config.loss import LOSS_PRESETS, LossConfig
from marinrl.config.replay import (
    GroupFilterConfig,
    OffPolicyConfig,
    OnPolicyConfig,
    ReplayConfig,
    ReplaySamplingConfig,
    RewardMeanFilter,
    RewardStdQuantileFilter,
    SamplingConfig,
    TrimOutliersFilter,
    ZeroVarianceFilter,
)
from marinrl.storage.fs import RolloutStorageError
from marinrl.storage.rollouts import RolloutReader, RolloutWriter
from marinrl.train.advantages import group_advantages
from marinrl.train.replay.buffer import ReplayBuffer, ReplayIngestionError, ReplayTimeoutError
from marinrl.train.replay.filters import FILTERS
from marinrl.train.replay.groups import BufferedGroup
from marinrl.train.replay.ingest import overlong_reward_fn
from marinrl.train.replay.sampling import CHOOSERS, choose
from marinrl.types import DEFAULT_POLICY, Rollout, RolloutBatch, RolloutGroup, RolloutMetadata


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_group(gid: str, rewards, *, w: int = 0, env: str = "math", created_at: float = 1000.0,
               lengths=None, prompt_len: int = 2, policy: str = DEFAULT_POLICY) -> RolloutGroup:
    lengths = lengths or [3] * len(rewards)
    rollouts = []
    for reward, n in zip(rewards, lengths):
        rollouts.append(Rollout(
            prompt_tokens=np.arange(1, prompt_len + 1), response_tokens=np.full(n, 7),
            response_logprobs=np.full(n, -0.5), temperature=1.0, loss_mask=np.ones(n),
            token_rewards=np.r_[np.zeros(n - 1), reward], episode_reward=reward, finish_reason="stop",
            env_name=env, lesson_id=env, group_id=gid, policy_name=policy,
            metadata=RolloutMetadata("w0", w, created_at)))
    return RolloutGroup(tuple(rollouts))


def make_batch(groups, *, w: int = 0, created_at: float = 1000.0) -> RolloutBatch:
    return RolloutBatch(tuple(groups), RolloutMetadata("w0", w, created_at))


def batch_of(w: int, *gids: str, env: str = "math", created_at: float = 1000.0, rewards=(0.0, 1.0)):
    return make_batch([make_group(g, rewards, w=w, env=env, created_at=created_at) for g in gids],
                      w=w, created_at=created_at)


def ids(sample) -> list[str]:
    return [g.group.group_id for g in sample.groups]


def drops(buf) -> dict[str, float]:
    return {k.removeprefix("replay/dropped/"): v for k, v in buf.metrics().items() if k.startswith("replay/dropped/")}


# ----------------------------------------------------------------------------- staleness


def test_off_policy_window_is_step_minus_one_to_step():
    clock = Clock(1000.0)
    buf = ReplayBuffer(ReplayConfig(sampling=OffPolicyConfig(staleness=1)), clock=clock)
    for w in (3, 4, 5, 6):
        buf.ingest([batch_of(w, f"w{w}", created_at=1001.0)])  # made by this run: held until sampled
    assert buf.metrics()["replay/groups"] == 4
    sample = buf.sample(5, 2, timeout_s=0)
    assert ids(sample) == ["w4", "w5"]  # oldest first
    assert [g.staleness for g in sample.groups] == [1, 0]
    assert drops(buf) == {"stale": 1, "future": 1}  # w3: 5 - 3 > 1; w6: from the future, never trained


def test_stale_groups_are_dropped_at_ingestion_once_the_step_is_known():
    buf = ReplayBuffer(ReplayConfig(sampling=OffPolicyConfig(staleness=1)), clock=Clock(), start_step=5)
    assert buf.ingest([batch_of(3, "a"), batch_of(4, "b"), batch_of(5, "c")]) == 2
    assert drops(buf) == {"stale": 1}
    buf.sample(5, 2, timeout_s=0)
    # The trainer moves on: what was usable at 5 with staleness 1 is stale at 7.
    buf.ingest([batch_of(5, "d"), batch_of(6, "e")])
    assert ids(buf.sample(7, 1, timeout_s=0)) == ["e"]
    assert drops(buf) == {"stale": 2}


def test_on_policy_uses_only_current_weights_and_waits_for_them():
    buf = ReplayBuffer(ReplayConfig(sampling=OnPolicyConfig()), clock=Clock())
    buf.ingest([batch_of(0, "old")])
    with pytest.raises(ReplayTimeoutError):
        buf.sample(1, 1, timeout_s=0)  # weights 0 are stale at step 1 under max_staleness 0
    assert drops(buf) == {"stale": 1}

    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("s", buf.sample(1, 1, timeout_s=60)))
    waiter.start()
    buf.ingest([batch_of(1, "fresh", created_at=1001.0)])  # the rollout worker catches up
    waiter.join(60)
    assert ids(result["s"]) == ["fresh"] and result["s"].groups[0].staleness == 0


def test_future_groups_of_a_previous_run_are_dropped_and_this_runs_are_held():
    clock = Clock(1000.0)
    buf = ReplayBuffer(ReplayConfig(), clock=clock, start_step=2)  # this run started at t=1000, at step 2
    buf.ingest([batch_of(3, "previous-run", created_at=990.0)])
    assert drops(buf) == {"future": 1}
    buf.ingest([batch_of(3, "this-run", created_at=1005.0)])  # weights 3 published before sample(3)
    assert buf.metrics()["replay/groups"] == 1
    assert ids(buf.sample(3, 1, timeout_s=0)) == ["this-run"]


def test_a_group_from_the_future_at_sample_time_is_never_trained():
    buf = ReplayBuffer(ReplayConfig(), clock=Clock())
    buf.ingest([batch_of(0, "now", created_at=1001.0), batch_of(1, "ahead", created_at=1001.0)])
    assert ids(buf.sample(0, 1, timeout_s=0)) == ["now"]
    assert drops(buf) == {"future": 1}
    with pytest.raises(ReplayTimeoutError):
        buf.sample(1, 1, timeout_s=0)


def mixed_group(gid: str, steps_per_rollout, *, start: int, created_at: float = 1001.0) -> RolloutGroup:
    """A group whose rollouts began with weights `start` and had tokens sampled by newer ones (in flight)."""
    group = make_group(gid, [float(i % 2) for i in range(len(steps_per_rollout))], w=start, created_at=created_at,
                       lengths=[len(s) for s in steps_per_rollout])
    return RolloutGroup(tuple(dataclasses.replace(r, weight_steps=s)
                              for r, s in zip(group.rollouts, steps_per_rollout)))


MIXED_STEPS = ([3, 3, 5, 5], [3, 5, 5, 5])
"""Tokens at steps 3 (3 of them) and 5 (5 of them): oldest 3, newest 5, mean 34 / 8 = 4.25 -> 4."""


@pytest.mark.parametrize("reduction, staleness", [("oldest", 3), ("newest", 1), ("mean", 2)])
def test_token_version_reduction_decides_a_mixed_groups_staleness(reduction, staleness):
    buf = ReplayBuffer(ReplayConfig(sampling=OffPolicyConfig(staleness=10), token_version_reduction=reduction),
                       clock=Clock())
    buf.ingest([make_batch([mixed_group("mixed", MIXED_STEPS, start=3)], w=3, created_at=1001.0)])
    sample = buf.sample(6, 1, timeout_s=0)
    assert [g.staleness for g in sample.groups] == [staleness]
    metrics = sample.metrics()
    assert metrics["batch/version_spread_max"] == 2 and metrics["batch/version_spread_mean"] == 2
    assert metrics["batch/mixed_version_frac"] == 1
    assert metrics["batch/token_staleness_mean"] == (3 * 3 + 5 * 1) / 8 and metrics["batch/token_staleness_max"] == 3


def test_the_window_drops_a_mixed_group_by_its_oldest_token_by_default():
    for reduction, dropped in (("oldest", {"stale": 1}), ("newest", {})):
        buf = ReplayBuffer(ReplayConfig(sampling=OffPolicyConfig(staleness=1), token_version_reduction=reduction),
            clock=Clock(), start_step=5)
        buf.ingest([make_batch([mixed_group("mixed", MIXED_STEPS, start=3)], w=3, created_at=1001.0)])
        assert drops(buf) == dropped, reduction


def test_a_group_with_a_token_from_the_future_is_never_trained():
    buf = ReplayBuffer(ReplayConfig(), clock=Clock())
    buf.ingest([make_batch([mixed_group("half-ahead", ([0, 0, 1],), start=0)], w=0, created_at=1001.0)])
    with pytest.raises(ReplayTimeoutError):
        buf.sample(0, 1, timeout_s=0)  # its oldest token is current, but one token's weights are newer
    assert drops(buf) == {"future": 1}


def test_steps_only_go_up():
    buf = ReplayBuffer(ReplayConfig(), clock=Clock())
    buf.ingest([batch_of(3, "a", created_at=1001.0)])
    buf.sample(3, 1, timeout_s=0)
    with pytest.raises(ValueError, match="steps only go up"):
        buf.sample(2, 1, timeout_s=0)


# ----------------------------------------------------------------------------- age and capacity


def test_age_limit_uses_the_injected_clock_with_an_inclusive_boundary():
    clock = Clock(100.0)
    buf = ReplayBuffer(ReplayConfig(max_age_s=10.0), clock=clock)
    buf.ingest([batch_of(0, "too-old", created_at=89.0), batch_of(0, "edge", created_at=90.0),
                batch_of(0, "young", created_at=95.0)])
    assert drops(buf) == {"too_old": 1}
    assert buf.metrics()["replay/groups"] == 2
    clock.t = 100.5  # "edge" is now 10.5 s old
    assert ids(buf.sample(0, 1, timeout_s=0)) == ["young"]
    assert drops(buf) == {"too_old": 2}


def test_capacity_is_per_env_and_evicts_the_oldest():
    buf = ReplayBuffer(ReplayConfig(sampling=OffPolicyConfig(staleness=3), capacity_per_env=2), clock=Clock(),
                       start_step=2)
    buf.ingest([batch_of(1, "a1"), batch_of(2, "a2"), batch_of(2, "b2", env="code")])
    buf.ingest([batch_of(2, "a3")])  # a1 (weight step 1) goes
    buf.ingest([batch_of(0, "a0")])  # older than everything kept: evicted at once
    m = buf.metrics()
    assert m["replay/size/math"] == 2 and m["replay/size/code"] == 1
    assert drops(buf) == {"evicted": 2}
    assert ids(buf.sample(2, 3, timeout_s=0)) == ["a2", "b2", "a3"]  # oldest first across envs


# ----------------------------------------------------------------------------- env mixing


def test_env_mix_follows_weights_exactly_not_buffer_contents():
    config = ReplayConfig(sampling=OffPolicyConfig(staleness=100), env_weights={"math": 3.0, "code": 1.0})
    buf = ReplayBuffer(config, clock=Clock())
    # Far more code than math in the buffer; the mix must still be 3:1.
    buf.ingest([batch_of(0, *[f"m{i}" for i in range(40)]),
                batch_of(0, *[f"c{i}" for i in range(80)], env="code"),
                batch_of(0, "other", env="chess")])
    assert drops(buf) == {"unweighted_env": 1}
    per_step = []
    for _ in range(10):
        s = buf.sample(0, 2, timeout_s=0)
        per_step.append(tuple(g.env_name for g in s.groups))
    # Slots go to the env furthest below its share of everything handed out so far (ties: by name).
    assert [sorted(step) for step in per_step[:2]] == [["code", "math"], ["math", "math"]]
    envs = [e for step in per_step for e in step]
    assert envs.count("math") == 15 and envs.count("code") == 5
    for _ in range(5):
        s = buf.sample(0, 4, timeout_s=0)
        assert sorted(g.env_name for g in s.groups) == ["code", "math", "math", "math"]


def test_env_mix_waits_for_a_missing_env():
    buf = ReplayBuffer(ReplayConfig(env_weights={"math": 1.0, "code": 1.0}), clock=Clock())
    buf.ingest([batch_of(0, "m1", "m2", "m3", "m4")])
    with pytest.raises(ReplayTimeoutError, match=r"code=1 \(usable 0\)"):
        buf.sample(0, 2, timeout_s=0)
    buf.ingest([batch_of(0, "c1", env="code")])
    assert sorted(g.env_name for g in buf.sample(0, 2, timeout_s=0).groups) == ["code", "math"]


# ----------------------------------------------------------------------------- reuse


def test_replay_uses_each_group_up_to_max_uses():
    buf = ReplayBuffer(ReplayConfig(sampling=ReplaySamplingConfig(staleness=3, uses=2)), clock=Clock())
    buf.ingest([batch_of(0, "a", "b", "c", "d")])
    first, second = buf.sample(0, 4, timeout_s=0), buf.sample(1, 4, timeout_s=0)
    assert sorted(ids(first)) == sorted(ids(second)) == ["a", "b", "c", "d"]
    assert {g.use for g in first.groups} == {1} and {g.use for g in second.groups} == {2}
    assert [g.staleness for g in second.groups] == [1] * 4
    with pytest.raises(ReplayTimeoutError):
        buf.sample(1, 1, timeout_s=0)
    m = buf.metrics()
    assert m["replay/uses/2"] == 4 and m["replay/groups"] == 0
    assert drops(buf) == {}  # used-up groups are not drops


def test_off_policy_uses_each_group_once():
    buf = ReplayBuffer(ReplayConfig(), clock=Clock())
    buf.ingest([batch_of(0, "a", "b")])
    assert ids(buf.sample(0, 2, timeout_s=0)) == ["a", "b"]
    with pytest.raises(ReplayTimeoutError):
        buf.sample(0, 1, timeout_s=0)


def test_recency_weighting_draws_in_proportion_to_decay_power_staleness():
    strategy = ReplaySamplingConfig(staleness=3, uses=1, recency_decay=0.5)
    candidates = [BufferedGroup(group=make_group(gid, [0, 1], w=w), advantages=np.zeros(2, np.float32),
                                advantage_scale=1.0, rewards=np.array([0.0, 1.0]), trainable=np.ones(2, bool),
                                env_name="math", weight_step=w, created_at=1000.0, seq=seq, source=None)
                  for seq, (gid, w) in enumerate([("new", 3), ("old", 0)])]
    rng = np.random.default_rng(0)
    trials = 20000
    old = sum(choose(strategy, candidates, 1, 3, rng)[0].group_id == "old" for _ in range(trials))
    assert abs(old / trials - 0.125 / 1.125) < 0.01  # weights 0.5**3 and 0.5**0
    uniform = ReplaySamplingConfig(staleness=3, recency_decay=1.0)
    old = sum(choose(uniform, candidates, 1, 3, rng)[0].group_id == "old" for _ in range(trials))
    assert abs(old / trials - 0.5) < 0.015
    # k = all candidates takes all of them, oldest first.
    assert [g.group_id for g in choose(strategy, candidates, 2, 3, rng)] == ["old", "new"]


def test_replay_draws_are_reproducible_from_seed_and_step():
    def run(seed):
        buf = ReplayBuffer(ReplayConfig(sampling=ReplaySamplingConfig(staleness=5, uses=3), seed=seed), clock=Clock())
        buf.ingest([batch_of(w, *[f"w{w}g{i}" for i in range(5)], created_at=1001.0) for w in range(3)])
        return [ids(buf.sample(s, 3, timeout_s=0)) for s in (2, 2, 3, 4)]

    assert run(0) == run(0)
    assert run(0) != run(1)


# ----------------------------------------------------------------------------- filters


def test_every_registered_strategy_and_filter_has_its_code():
    """The config layer registers the names (`replay.sampling`, `replay.filters`); the buffer's code is a table
    keyed by the same names, so a name registered without code (or code left for a removed name) fails here."""
    assert sorted(CHOOSERS) == sorted(SamplingConfig.get_known_choices())
    assert sorted(FILTERS) == sorted(GroupFilterConfig.get_known_choices())


def test_zero_variance_filter():
    buf = ReplayBuffer(ReplayConfig(filters=[ZeroVarianceFilter()]), clock=Clock())
    buf.ingest([make_batch([make_group("flat", [1, 1, 1, 1]), make_group("mixed", [0, 1, 0, 0])])])
    assert drops(buf) == {"zero_variance": 1}
    assert buf.metrics()["replay/dropped_rollouts/zero_variance"] == 4
    assert ids(buf.sample(0, 1, timeout_s=0)) == ["mixed"]


def test_reward_mean_filter_keeps_an_inclusive_range():
    buf = ReplayBuffer(ReplayConfig(filters=[RewardMeanFilter(low=0.25, high=0.5)]), clock=Clock())
    buf.ingest([make_batch([make_group(g, r) for g, r in
                            [("none", [0, 0, 0, 0]), ("quarter", [1, 0, 0, 0]), ("half", [1, 1, 0, 0]),
                             ("most", [1, 1, 1, 0])]])])
    assert drops(buf) == {"reward_mean": 2}
    assert ids(buf.sample(0, 2, timeout_s=0)) == ["quarter", "half"]


def test_reward_std_quantile_filter_is_relative_to_the_file():
    groups = [make_group("s0", [0, 0, 0, 0]), make_group("s1", [0, 0, 0, 1]),
              make_group("s2", [0, 0, 1, 1]), make_group("s3", [0, 0, 0, 4])]
    # stds 0, 0.433, 0.5, 1.732: the median is 0.467, so the upper half keeps s2 and s3.
    buf = ReplayBuffer(ReplayConfig(filters=[RewardStdQuantileFilter(low=0.5)]), clock=Clock())
    buf.ingest([make_batch(groups)])
    assert drops(buf) == {"reward_std_quantile": 2}
    assert ids(buf.sample(0, 2, timeout_s=0)) == ["s2", "s3"]
    buf = ReplayBuffer(ReplayConfig(filters=[RewardStdQuantileFilter(low=0.0, high=0.0)]), clock=Clock())
    buf.ingest([make_batch(groups)])
    assert ids(buf.sample(0, 1, timeout_s=0)) == ["s0"] and drops(buf) == {"reward_std_quantile": 3}


def test_filter_ratio_keeps_the_top_share_by_mean_per_policy_with_ties_by_group_id():
    groups = [make_group("a-mid-z", [1, 1, 0, 0]), make_group("a-top", [1, 1, 1, 0]), make_group("a-low", [1, 0, 0, 0]),
              make_group("a-mid-b", [1, 0, 1, 0]), make_group("a-none", [0, 0, 0, 0]),
              make_group("b-only", [0, 0, 0, 0], policy="b")]
    # Policy a: 0.4 of 5 groups is 2, the top mean (0.75) and of the two at 0.5 the lower group id;
    # policy b is ranked on its own, and a share of one group keeps it (whatever its mean).
    kept = {}
    for order in (groups, groups[::-1]):  # the file's order decides nothing
        buf = ReplayBuffer(ReplayConfig(filters=[RewardMeanFilter(filter_ratio=0.4)]), clock=Clock())
        buf.ingest([make_batch(order)])
        assert drops(buf) == {"reward_mean": 3}
        kept[len(kept)] = set(ids(buf.sample(0, 3, timeout_s=0)))
    assert kept[0] == kept[1] == {"a-top", "a-mid-b", "b-only"}
    # After the [low, high] band: of the 3 groups with mean <= 0.5 (a-mid-z, a-low, a-mid-b), 0.4 keeps 2.
    buf = ReplayBuffer(ReplayConfig(filters=[RewardMeanFilter(low=0.1, high=0.5, filter_ratio=0.4)]), clock=Clock())
    buf.ingest([make_batch(groups[:5])])
    assert ids(buf.sample(0, 2, timeout_s=0)) == ["a-mid-z", "a-mid-b"]


def test_filter_ratio_on_std_keeps_the_most_informative_groups_of_the_file():
    groups = [make_group("s0", [0, 0, 0, 0]), make_group("s1", [0, 0, 0, 1]),
              make_group("s2", [0, 0, 1, 1]), make_group("s3", [0, 0, 0, 4])]  # stds 0, 0.433, 0.5, 1.732
    buf = ReplayBuffer(ReplayConfig(filters=[RewardStdQuantileFilter(filter_ratio=0.5)]), clock=Clock())
    buf.ingest([make_batch(groups)])
    assert drops(buf) == {"reward_std_quantile": 2}
    assert ids(buf.sample(0, 2, timeout_s=0)) == ["s2", "s3"]
    buf = ReplayBuffer(ReplayConfig(filters=[RewardStdQuantileFilter(low=0.5, filter_ratio=0.5)]), clock=Clock())
    buf.ingest([make_batch(groups)])  # the upper half by quantile (s2, s3), then its top half
    assert ids(buf.sample(0, 1, timeout_s=0)) == ["s3"] and drops(buf) == {"reward_std_quantile": 3}


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5, float("nan")])
def test_filter_ratio_outside_zero_to_one_is_refused_naming_the_field(ratio, tmp_path):
    from marinrl.config.errors import ConfigInputError, load_job_config
    from marinrl.config.job import RLJobConfig

    for cls, name in ((RewardMeanFilter, "reward_mean"), (RewardStdQuantileFilter, "reward_std_quantile")):
        with pytest.raises(ValueError, match=rf"^{name}\.filter_ratio must be in \(0, 1\] or null, got {ratio}$"):
            cls(filter_ratio=ratio)
    path = tmp_path / "job.yaml"
    yaml_ratio = ".nan" if np.isnan(ratio) else ratio
    path.write_text(f"run_id: x\nreplay:\n  filters:\n    - {{type: reward_mean, filter_ratio: {yaml_ratio}}}\n")
    with pytest.raises(ConfigInputError,
                       match=r"job.yaml:4:\d+: .*replay\.filters\[0\].*reward_mean\.filter_ratio must be"):
        load_job_config(RLJobConfig, str(path), [])


def test_trim_outliers_recomputes_advantages_on_what_remains():
    rewards = [0, 1, 0, 1, 0, 1, 0, 1, 10]  # z of the 10 is 2.79, of the others at most 0.51
    buf = ReplayBuffer(ReplayConfig(filters=[TrimOutliersFilter(max_z=2.5)]), clock=Clock())
    buf.ingest([make_batch([make_group("g", rewards)])])
    s = buf.sample(0, 1, timeout_s=0)
    kept = [r.episode_reward for r in s.rollouts]
    assert kept == [0, 1, 0, 1, 0, 1, 0, 1]
    np.testing.assert_allclose(s.advantages, group_advantages(np.array(kept)), rtol=1e-6)
    assert drops(buf) == {} and buf.metrics()["replay/dropped_rollouts/trim_outliers"] == 1


def test_trim_outliers_on_length_and_min_size():
    f = TrimOutliersFilter(metric="response_length", max_z=2.5, min_size=2)
    buf = ReplayBuffer(ReplayConfig(filters=[f]), clock=Clock())
    long_one = make_group("long", [0, 1, 0, 1, 0, 1, 0, 1, 0], lengths=[4] * 8 + [40])
    # Two samples are each exactly one std from the mean: max_z 0.5 trims both, leaving too few.
    pair = make_group("pair", [0, 100])
    buf.ingest([make_batch([long_one, pair])])
    assert drops(buf) == {}
    buf2 = ReplayBuffer(ReplayConfig(filters=[TrimOutliersFilter(max_z=0.5)]), clock=Clock())
    buf2.ingest([make_batch([pair])])
    assert drops(buf2) == {"trim_outliers": 1}
    s = buf.sample(0, 2, timeout_s=0)
    assert [len(g.group) for g in s.groups] == [8, 2]
    assert all(r.response_tokens.size == 4 for r in s.groups[0].group.rollouts)


def test_filters_compose_in_order():
    outlier = [1, 1, 1, 1, 1, 1, 1, 1, 10]
    trim_then_flat = ReplayBuffer(ReplayConfig(filters=[TrimOutliersFilter(max_z=2.5), ZeroVarianceFilter()]),
                                  clock=Clock())
    trim_then_flat.ingest([make_batch([make_group("g", outlier)])])
    assert drops(trim_then_flat) == {"zero_variance": 1}
    flat_then_trim = ReplayBuffer(ReplayConfig(filters=[ZeroVarianceFilter(), TrimOutliersFilter(max_z=2.5)]),
                                  clock=Clock())
    flat_then_trim.ingest([make_batch([make_group("g", outlier)])])
    s = flat_then_trim.sample(0, 1, timeout_s=0)
    assert len(s.rollouts) == 8 and np.all(s.advantages == 0)


# ----------------------------------------------------------------------------- advantages and rewards


@pytest.mark.parametrize("kind", ["group_std", "group_mean", "rloo"])
def test_advantages_are_computed_per_group_at_ingestion(kind):
    buf = ReplayBuffer(ReplayConfig(), clock=Clock(), advantage=kind)
    buf.ingest([make_batch([make_group("a", [0, 1, 1, 0.5]), make_group("b", [2, 0])])])
    s = buf.sample(0, 2, timeout_s=0)
    # Hand-computed references (worked out in factories.HAND_ADVANTAGES); the buffer stores float32:
    # a relative error of a few eps32 on values of order 1.
    eps32 = float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(s.groups[0].advantages, HAND_ADVANTAGES[kind][(0, 1, 1, 0.5)], rtol=4 * eps32, atol=1e-9)
    np.testing.assert_allclose(s.groups[1].advantages, HAND_ADVANTAGES[kind][(2, 0)], rtol=4 * eps32, atol=1e-9)
    assert s.advantages.shape == (6,) and s.advantages.dtype == np.float32


def two_turn_group(gid: str, turn_rewards) -> RolloutGroup:
    """Episodes of two one-token turns with one environment token between them (mask 1, 0, 1); each
    turn's reward on its own token."""
    rollouts = []
    for r1, r2 in turn_rewards:
        rollouts.append(Rollout(
            prompt_tokens=np.array([1]), response_tokens=np.array([5, 9, 6]), response_logprobs=np.full(3, -0.5),
            temperature=1.0, loss_mask=np.array([1, 0, 1]), token_rewards=np.array([r1, 0.0, r2]),
            episode_reward=r1 + r2, finish_reason="stop", env_name="game", lesson_id="game", group_id=gid,
            metadata=RolloutMetadata("w0", 0, 1000.0)))
    return RolloutGroup(tuple(rollouts))


@pytest.mark.parametrize("kind", ["group_std", "group_mean", "rloo"])
def test_multi_turn_credit_reaches_the_batch_per_token(kind):
    # Returns 1, 0, 2, 1: turn 1 of episode "a" earned 1, its turn 2 nothing; "c" earned in both turns.
    turns = [(1.0, 0.0), (0.0, 0.0), (1.0, 1.0), (0.0, 1.0)]
    buf = ReplayBuffer(ReplayConfig(), clock=Clock(), advantage=kind)
    buf.ingest([make_batch([two_turn_group("g", turns)])])
    s = buf.sample(0, 1, timeout_s=0)
    returns = np.array([a + b for a, b in turns])
    episode = group_advantages(returns, kind)
    scale = returns.std() + 1e-6 if kind == "group_std" else 1.0
    # Token t is credited with the rewards from its own turn on: turn 2 loses what turn 1 earned.
    expected_turn2 = episode - np.array([a for a, _ in turns]) / scale
    batch = s.training_batch(batch_size=4, config=BatchingConfig(max_length=8, min_bucket=4, layout="padded"))
    adv = np.asarray(batch.advantages.array)
    # Prompt of one token: the response's tokens are targets at positions 0, 1, 2 (1 is the env token).
    np.testing.assert_allclose(adv[:, 0], episode, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv[:, 1], 0.0)
    np.testing.assert_allclose(adv[:, 2], expected_turn2, rtol=1e-5, atol=1e-6)
    if kind == "group_std":  # the same as reward-to-go against the group's baseline
        np.testing.assert_allclose(adv[:, 2], (np.array([b for _, b in turns]) - returns.mean()) / scale, atol=1e-5)
    # A single-turn group (reward on the last token) is unchanged: every token gets the episode advantage.
    buf.ingest([make_batch([make_group("single", [0, 1, 1, 0.5])])])
    single = buf.sample(0, 1, timeout_s=0)
    padded = BatchingConfig(max_length=8, min_bucket=8, layout="padded")
    packed = np.asarray(single.training_batch(batch_size=4, config=padded).advantages.array)
    np.testing.assert_allclose(packed[:, 1:4], np.repeat(single.advantages[:, None], 3, axis=1), rtol=1e-6)


def test_a_zero_variance_multi_turn_group_contributes_nothing():
    buf = ReplayBuffer(ReplayConfig(), clock=Clock(), advantage="group_mean")
    buf.ingest([make_batch([two_turn_group("tie", [(1.0, 0.0), (0.0, 1.0)])])])  # equal returns, different turns
    batch = buf.sample(0, 1, timeout_s=0).training_batch(
        batch_size=2, config=BatchingConfig(max_length=8, min_bucket=4, layout="padded"))
    assert np.all(np.asarray(batch.advantages.array) == 0)


def test_batch_metrics_split_by_policy_and_agent():
    def tagged(gid, rewards, agent, policy):
        return RolloutGroup(tuple(dataclasses.replace(r, agent_name=agent, policy_name=policy)
                                  for r in make_group(gid, rewards).rollouts))

    buf = ReplayBuffer(ReplayConfig(), clock=Clock())
    buf.ingest([make_batch([tagged("s", [1.0, 0.0], "solver", "policy"), tagged("c", [1.0, 1.0], "checker", "policy"),
                            tagged("o", [0.0, 0.5], "opponent", "frozen")])])
    m = buf.sample(0, 3, timeout_s=0).metrics()
    assert m["batch/rollouts/policy/policy"] == 4 and m["batch/rollouts/policy/frozen"] == 2
    assert m["batch/reward_mean/policy/policy"] == 0.75 and m["batch/reward_mean/policy/frozen"] == 0.25
    assert m["batch/reward_mean/agent/policy/solver"] == 0.5 and m["batch/reward_mean/agent/policy/checker"] == 1.0


def test_reward_fn_reshapes_rewards_before_filters_and_advantages():
    def penalize_length(group):  # a stand-in for overlong shaping
        return np.array([r.episode_reward - 0.1 * r.response_tokens.size for r in group.rollouts])

    buf = ReplayBuffer(ReplayConfig(filters=[ZeroVarianceFilter()]), clock=Clock(), reward_fn=penalize_length)
    buf.ingest([make_batch([make_group("same-reward", [1, 1], lengths=[2, 6]),
                            make_group("same-shaped", [1, 1], lengths=[3, 3])])])
    assert drops(buf) == {"zero_variance": 1}
    s = buf.sample(0, 1, timeout_s=0)
    assert ids(s) == ["same-reward"]
    np.testing.assert_allclose(s.advantages, group_advantages(np.array([0.8, 0.4])), rtol=1e-6)


def test_reward_fn_can_keep_a_rollout_in_the_baseline_without_training_it():
    def mask_long(group):
        return group.rewards, np.array([r.response_tokens.size < 5 for r in group.rollouts])

    buf = ReplayBuffer(ReplayConfig(), clock=Clock(), reward_fn=mask_long)
    buf.ingest([make_batch([make_group("g", [0, 1, 1], lengths=[3, 3, 6])])])
    s = buf.sample(0, 1, timeout_s=0)
    assert s.trainable.tolist() == [True, True, False]
    np.testing.assert_allclose(s.advantages, group_advantages(np.array([0.0, 1, 1])), rtol=1e-6)
    batch = s.training_batch(batch_size=4, config=BatchingConfig(max_length=16, min_bucket=8, layout="padded"))
    assert np.asarray(batch.loss_mask.array).sum(axis=1).tolist() == [3, 3, 0, 0]
    # weight_step is per target token: the untrained rollout's tokens are no one's targets
    assert np.asarray(batch.weight_step.array).max(axis=1).tolist() == [0, 0, -1, -1]


def truncated_group(gid, rewards, lengths):
    group = make_group(gid, rewards, lengths=lengths)
    return RolloutGroup(tuple(dataclasses.replace(r, finish_reason="length" if n >= 8 else "stop")
                              for r, n in zip(group.rollouts, lengths)))


def test_a_loss_preset_sets_advantages_dynamic_sampling_and_overlong_masking():
    dapo = LossConfig(**LOSS_PRESETS["dapo"])
    config = ReplayConfig(filters=[RewardMeanFilter(high=0.9)]).for_loss(dapo)
    assert isinstance(config.filters[0], ZeroVarianceFilter)
    assert config.for_loss(dapo).filters == config.filters  # idempotent
    buf = ReplayBuffer(config, clock=Clock(), advantage=dapo.advantage, reward_fn=overlong_reward_fn(dapo))
    buf.ingest([make_batch([make_group("flat", [0, 0]), truncated_group("g", [0, 1, 1], [3, 3, 8])])])
    assert drops(buf) == {"zero_variance": 1}
    s = buf.sample(0, 1, timeout_s=0)
    assert s.trainable.tolist() == [True, True, False]  # the truncated response is not trained
    np.testing.assert_allclose(s.advantages, group_advantages(np.array([0.0, 1, 1]), dapo.advantage), rtol=1e-6)


def test_overlong_penalty_reshapes_rewards_before_advantages():
    loss = LossConfig(overlong="penalty", max_response_tokens=8, overlong_cache_tokens=4, overlong_penalty=1.0)
    assert overlong_reward_fn(LossConfig()) is None
    buf = ReplayBuffer(ReplayConfig(), clock=Clock(), advantage="group_mean", reward_fn=overlong_reward_fn(loss))
    buf.ingest([make_batch([truncated_group("g", [1, 1, 1], [4, 6, 8])])])
    s = buf.sample(0, 1, timeout_s=0)
    # Penalty ramps from 0 at 8 - 4 = 4 tokens to -1 at 8: shaped rewards 1, 0.5, 0.
    np.testing.assert_allclose(s.advantages, [0.5, 0.0, -0.5], atol=1e-6)
    assert s.trainable.all()


def test_invalid_and_too_long_groups_are_dropped_and_counted():
    buf = ReplayBuffer(ReplayConfig(), clock=Clock(), max_tokens=6)
    buf.ingest([make_batch([make_group("empty-prompt", [0, 1], prompt_len=0),
                            make_group("long", [0, 1], lengths=[3, 5]),
                            make_group("ok", [0, 1], lengths=[4, 4])])])
    assert drops(buf) == {"invalid": 1, "too_long": 1}
    assert ids(buf.sample(0, 1, timeout_s=0)) == ["ok"]


# ----------------------------------------------------------------------------- errors and metrics


def test_timeout_error_says_what_the_buffer_holds_and_why_groups_were_dropped():
    clock = Clock(1000.0)
    config = ReplayConfig(env_weights={"math": 1.0, "code": 1.0}, filters=[ZeroVarianceFilter()])
    buf = ReplayBuffer(config, clock=clock)
    buf.ingest([batch_of(0, "stale"), batch_of(1, "m1", created_at=1001.0),
                batch_of(3, "future", created_at=1001.0),
                make_batch([make_group("flat", [1, 1], w=2, env="code")], w=2)])
    with pytest.raises(ReplayTimeoutError) as e:
        buf.sample(2, 4, timeout_s=0)
    msg = str(e.value)
    assert "no batch of 4 groups for trainer step 2 within 0 s" in msg
    assert "off_policy (max_staleness=1, max_uses=1) accepts weight steps 1..2" in msg
    assert "needed per env: code=2 (usable 0), math=2 (usable 1)" in msg
    assert "buffer holds 1 groups:" in msg and "math: weight_step 1: 1 groups (0 used before)" in msg
    assert "groups dropped unused so far: " in msg
    for reason in ("stale=1", "future=1", "zero_variance=1"):
        assert reason in msg
    assert "no reader" in msg


def test_metrics_cover_size_drops_staleness_uses_and_lag():
    clock = Clock(1000.0)
    buf = ReplayBuffer(ReplayConfig(sampling=ReplaySamplingConfig(staleness=2, uses=2)), clock=clock, start_step=1)
    buf.ingest([batch_of(0, "a", "b", created_at=990.0), batch_of(1, "c", env="code", created_at=996.0)])
    buf.ingest([batch_of(9, "x", created_at=980.0)])  # a previous run's future
    m = buf.metrics()
    assert m["replay/size/math"] == 2 and m["replay/size/code"] == 1 and m["replay/size_rollouts/math"] == 4
    assert m["replay/ingestion_lag_s/mean"] == pytest.approx((10 + 4 + 20) / 3)
    assert m["replay/ingestion_lag_s/max"] == 20
    assert m["replay/dropped/future"] == 1 and m["replay/dropped_rollouts/future"] == 2
    s1 = buf.sample(1, 3, timeout_s=0)
    s2 = buf.sample(2, 2, timeout_s=0)
    m = buf.metrics()
    trained = sorted(g.staleness for s in (s1, s2) for g in s.groups)
    assert m["replay/trained_staleness/1"] == trained.count(1)
    assert m["replay/trained_staleness/2"] == trained.count(2)
    assert sum(v for k, v in m.items() if k.startswith("replay/trained_staleness/")) == 5
    assert m["replay/uses/2"] == 2 and m["replay/sampled_groups"] == 5
    bm = s1.metrics()
    assert bm["batch/groups"] == 3 and bm["batch/rollouts"] == 6 and bm["batch/groups/code"] == 1
    assert bm["batch/staleness_max"] == 1 and bm["batch/use_mean"] == 1


# ----------------------------------------------------------------------------- background ingestion


def test_background_thread_ingests_from_a_real_reader_and_stops(tmp_path):
    root = f"file://{tmp_path}/rollouts"
    writer, reader = RolloutWriter(root), RolloutReader(root)
    buf = ReplayBuffer(ReplayConfig(poll_interval_s=0.01), reader)
    with buf:
        assert buf.running
        writer.write(batch_of(0, "a", "b"))
        s = buf.sample(0, 2, timeout_s=60)
        assert sorted(ids(s)) == ["a", "b"]
        assert all(g.source.startswith("step=00000000/") for g in s.groups)
    assert not buf.running
    assert buf.metrics()["replay/ingested_files"] == 1
    buf.stop()  # stopping twice is harmless


class ListingReader(RolloutReader):
    """A real reader that counts its listings, so a test can wait for the ingestion thread's progress."""

    def __init__(self, root: str):
        super().__init__(root)
        self.listed = threading.Condition()
        self.listings = 0

    def read_new_with_paths(self, min_step=None, max_files=None, max_step=None):
        out = super().read_new_with_paths(min_step, max_files, max_step)
        with self.listed:
            self.listings += 1
            self.listed.notify_all()
        return out

    def wait_for_listings(self, n: int, timeout_s: float = 60.0) -> None:
        with self.listed:
            assert self.listed.wait_for(lambda: self.listings >= n, timeout_s), f"fewer than {n} listings"


def test_a_waiting_trainer_does_not_wait_for_the_idle_poll_interval(tmp_path):
    """With an hour between idle listings, a waiting sample() gets files written while the thread idles
    and files written while it waits: it wakes the ingestion thread, which then lists often."""
    root = f"file://{tmp_path}/rollouts"
    writer, reader = RolloutWriter(root), ListingReader(root)
    buf = ReplayBuffer(ReplayConfig(poll_interval_s=3600.0), reader)
    with buf:
        reader.wait_for_listings(1)  # the thread listed the empty root and now idles for an hour
        writer.write(batch_of(0, "a", "b"))
        s = buf.sample(0, 2, timeout_s=60)  # without the wake-up this raises ReplayTimeoutError
        assert sorted(ids(s)) == ["a", "b"]

        # A file that appears only after sample() has started waiting (and the thread has listed twice since).
        seen = reader.listings
        late = threading.Thread(target=lambda: (reader.wait_for_listings(seen + 2), writer.write(batch_of(0, "c"))))
        late.start()
        assert ids(buf.sample(0, 1, timeout_s=60)) == ["c"]
        late.join()


class FailingReader:
    """A reader whose storage fails: first with `first`, then (if given) returns `then`."""

    url = "memory://failing"

    def __init__(self, first: BaseException, then=None):
        self.first, self.then, self.calls = first, then, 0

    def read_new_with_paths(self, min_step=None, max_files=None, max_step=None):
        self.calls += 1
        if self.calls == 1:
            raise self.first
        out, self.then = self.then or [], None
        return out


def test_a_dead_ingestion_thread_fails_sample_with_its_cause():
    buf = ReplayBuffer(ReplayConfig(poll_interval_s=0.01), FailingReader(RuntimeError("bucket is gone")))
    buf.start()
    with pytest.raises(ReplayIngestionError, match="bucket is gone") as e:
        buf.sample(0, 1, timeout_s=60)
    assert isinstance(e.value.__cause__, RuntimeError)
    buf.stop()


def test_transient_read_errors_are_counted_and_retried():
    batch = batch_of(0, "a", created_at=2e9)
    reader = FailingReader(RolloutStorageError("flaky"), then=[("memory://r/step=00000000/f.parquet", batch)])
    buf = ReplayBuffer(ReplayConfig(poll_interval_s=0.01), reader)
    with buf:
        assert ids(buf.sample(0, 1, timeout_s=60)) == ["a"]
    assert buf.metrics()["replay/read_errors"] == 1


def test_sample_polls_the_reader_itself_without_a_thread(tmp_path):
    root = f"file://{tmp_path}/rollouts"
    RolloutWriter(root).write(batch_of(0, "a", created_at=2e9))
    buf = ReplayBuffer(ReplayConfig(), RolloutReader(root))
    assert ids(buf.sample(0, 1, timeout_s=60)) == ["a"]
    with pytest.raises(ReplayTimeoutError, match=r"thread not running \(sample\(\) polls\), 1 files ingested"):
        buf.sample(0, 1, timeout_s=0)


# ----------------------------------------------------------------------------- checkpoint and resume


def run_steps(buf, writer, clock, steps, make_file, log, n_groups):
    """One trainer loop: rollouts of weights `s` appear, the trainer reads them and samples step `s`."""
    for s in steps:
        clock.t += 1
        if make_file is not None:
            writer.write(make_file(s, clock.t))
        while buf.poll():
            pass
        trained = [(g.group.group_id, g.use) for g in buf.sample(s, n_groups, timeout_s=0).groups]
        # What a checkpoint now would keep: the groups still usable next step, with their use counts.
        held = sorted((gid, uses) for groups in buf.state_dict(next_step=s + 1)["pending"].values()
                      for gid, uses in groups.items())
        log.append((s, trained, held))


def schedule(prefix=""):
    # Per step, one file of weights s: three groups, and one the zero-variance filter drops.
    return lambda s, t: make_batch([make_group(f"{prefix}s{s}g{j}", [0.0, float(s + j + 1)], w=s, created_at=t)
                                    for j in range(3)] + [make_group(f"{prefix}s{s}flat", [1.0, 1.0], w=s)],
                                   w=s, created_at=t)


@pytest.mark.parametrize("sampling,n", [(OffPolicyConfig(staleness=1), 2),
                                        (ReplaySamplingConfig(staleness=2, uses=2), 3)], ids=["off_policy", "replay"])
def test_resume_trains_exactly_what_an_uninterrupted_run_trains(fsspec_root, sampling, n):
    """Three groups appear per step; off-policy trains two (a backlog builds up and expires), replay
    trains three of the up to six usable (partly used groups are drawn again)."""
    url, options = fsspec_root
    config = ReplayConfig(sampling=sampling, filters=[ZeroVarianceFilter()], max_files_per_poll=1)

    # Reference: ten steps without interruption.
    clock = Clock()
    ref_root = f"{url}/reference"
    reference = ReplayBuffer(config, RolloutReader(ref_root, storage_options=options), clock=clock)
    ref_log: list = []
    run_steps(reference, RolloutWriter(ref_root, storage_options=options), clock, range(10), schedule(), ref_log, n)

    # Interrupted: checkpoint after step 5, the old run goes on to step 7 and dies, a new one resumes.
    clock = Clock()
    root = f"{url}/interrupted"
    writer = RolloutWriter(root, storage_options=options)
    first = ReplayBuffer(config, RolloutReader(root, storage_options=options), clock=clock)
    log: list = []
    run_steps(first, writer, clock, range(6), schedule(), log, n)
    state = json.loads(json.dumps(first.state_dict(next_step=6)))
    uses = [u for groups in state["pending"].values() for u in groups.values()]
    assert uses, "the checkpoint should hold read but untrained groups"
    if sampling.max_uses > 1:
        assert 0 < max(uses) < sampling.max_uses, "the checkpoint should hold partly used groups"
    doomed: list = []
    run_steps(first, writer, clock, [6], schedule(), doomed, n)  # weights 6 = the checkpoint's: still valid
    run_steps(first, writer, clock, [7], schedule("lost-"), doomed, n)  # weights 7 of the dead run
    assert doomed[0] == ref_log[6]

    clock.t += 100
    second = ReplayBuffer(config, RolloutReader(root, storage_options=options), clock=clock)
    second.load_state_dict(state)
    run_steps(second, writer, clock, [6], None, log, n)  # the rollouts of weights 6 are on disk already
    run_steps(second, writer, clock, range(7, 10), schedule(), log, n)

    assert log == ref_log
    trained = [(gid, use) for _, step, _ in log for gid, use in step]
    assert len(trained) == len(set(trained)), "a group was trained twice with the same use"
    assert not any(gid.startswith("lost-") for gid, _ in trained)
    # Counters continue from the checkpoint as if uninterrupted, plus the dead run's weights-7 file, read
    # after the restart: its three groups are from this run's future, its flat one is filtered first.
    expected = drops(reference)
    expected = {**expected, "future": 3, "zero_variance": expected["zero_variance"] + 1}
    assert drops(second) == expected
    assert second.metrics()["replay/sampled_groups"] == reference.metrics()["replay/sampled_groups"]
    assert second.metrics()["replay/ingested_groups"] == reference.metrics()["replay/ingested_groups"] + 3
    assert second.metrics()["replay/restore_files_pending"] == 0


def test_state_dict_refuses_a_checkpoint_taken_after_prefetching():
    buf = ReplayBuffer(ReplayConfig(), clock=Clock())
    buf.ingest([batch_of(0, "a", "b")])
    buf.sample(0, 1, timeout_s=0)
    buf.state_dict(next_step=1)
    buf.sample(1, 1, timeout_s=0)
    with pytest.raises(ValueError, match="snapshot the replay state before sampling past it"):
        buf.state_dict(next_step=1)


def test_groups_without_a_source_are_reported_as_unrecoverable_but_ones_with_a_source_come_back():
    buf = ReplayBuffer(ReplayConfig(sampling=ReplaySamplingConfig(uses=3)), clock=Clock())
    buf.ingest([batch_of(0, "anon")])
    buf.ingest([batch_of(0, "a", "b")], sources=["custom://x"])
    buf.sample(0, 3, timeout_s=0)
    buf.sample(0, 3, timeout_s=0)
    state = buf.state_dict(next_step=1)
    assert state["unrecoverable_groups"] == 1 and state["reader"] is None
    assert state["pending"] == {"custom://x": {"a": 2, "b": 2}}

    restored = ReplayBuffer(ReplayConfig(sampling=ReplaySamplingConfig(uses=3)), clock=Clock())
    restored.load_state_dict(state)
    # The caller re-ingests its source; a group of it not in the state was dealt with before the checkpoint.
    restored.ingest([batch_of(0, "a", "b", "c")], sources=["custom://x"])
    s = restored.sample(1, 2, timeout_s=0)
    assert sorted((g.group.group_id, g.use) for g in s.groups) == [("a", 3), ("b", 3)]
    with pytest.raises(ReplayTimeoutError):
        restored.sample(1, 1, timeout_s=0)


def test_load_state_dict_needs_a_fresh_buffer_and_a_known_version():
    buf = ReplayBuffer(ReplayConfig(), clock=Clock())
    state = buf.state_dict()
    buf.ingest([batch_of(0, "a")])
    with pytest.raises(RuntimeError, match="fresh buffer"):
        buf.load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        ReplayBuffer(ReplayConfig()).load_state_dict({**state, "version": 99})


# ----------------------------------------------------------------------------- config


def test_config_is_draccus_friendly():
    config = draccus.decode(ReplayConfig, {
        "sampling": {"type": "replay", "uses": 3, "recency_decay": 0.8},
        "filters": [{"type": "zero_variance"}, {"type": "trim_outliers", "max_z": 2.0}],
        "env_weights": {"math": 2.0, "code": 1.0},
    })
    assert config.sampling == ReplaySamplingConfig(uses=3, recency_decay=0.8)
    assert config.filters == [ZeroVarianceFilter(), TrimOutliersFilter(max_z=2.0)]
    assert draccus.decode(ReplayConfig, draccus.encode(config)) == config
    assert draccus.decode(ReplayConfig, {}).sampling == OffPolicyConfig(staleness=1)
    assert draccus.decode(ReplayConfig, {"sampling": {"type": "on_policy"}}).sampling.max_staleness == 0


@pytest.mark.parametrize("bad", [
    dict(env_weights={}), dict(env_weights={"a": -1.0}), dict(capacity_per_env=0), dict(max_age_s=0.0),
    dict(token_version_reduction="median"),
])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        ReplayConfig(**bad)
    with pytest.raises(ValueError, match="advantage must be group_std, group_mean or rloo, got 'nope'"):
        ReplayBuffer(ReplayConfig(), advantage="nope")


@pytest.mark.parametrize("ingesting", [True, False], ids=["ingestion-thread", "self-polling"])
def test_a_stop_ends_a_wait_for_rollouts_that_never_come(tmp_path, ingesting):
    """Ctrl-C on a job whose environments stall: the trainer's wait for a batch ends at the stop, not after
    `timeout_s` (an hour here), through `next_batch` as the TrainWorker calls it (train/cohort_batch.py)."""
    from types import SimpleNamespace

    from marinrl.multihost import Cohort
    from marinrl.train.cohort_batch import next_batch

    reader = ListingReader(f"file://{tmp_path}/rollouts")
    buf = ReplayBuffer(ReplayConfig(poll_interval_s=0.01, timeout_s=3600), reader)
    if ingesting:
        buf.start()
    stop, got = threading.Event(), []
    waiter = threading.Thread(target=lambda: got.append(  # a daemon: a wait that ignores `stop` fails, never hangs
        next_batch(Cohort(), buf, 0, SimpleNamespace(groups_per_step=2), stop, trainer=None)), daemon=True)
    waiter.start()
    reader.wait_for_listings(2)  # the wait has begun: the reader was listed (and found nothing)
    assert waiter.is_alive()
    stop.set()
    waiter.join(60)
    assert not waiter.is_alive() and got == [None]
    buf.stop()
