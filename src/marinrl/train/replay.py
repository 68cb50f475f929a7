"""The replay buffer: rollout groups between the rollout files and the trainer's batches.

Groups come in from a `RolloutReader` (a background thread, or `poll()`), or from `ingest()`. At
ingestion each group gets its rewards (optionally reshaped by a `reward_fn`), passes the configured
group filters, and gets its group-relative advantages (`advantages.group_advantages`). It stays in
the buffer until it is used up (`max_uses`), too stale, too old, or evicted by its environment's
capacity. `sample(step, n_groups)` hands the trainer whole groups for one optimizer step, mixing
environments by configured weights; it waits for a complete batch and, if none comes in time, raises
an error that says what the buffer holds and why groups were dropped.

Weight steps follow docs/architecture.md ("The contracts"): the trainer about to apply update `step + 1` holds weights `step`;
a group made with weights `w` has staleness `step - w` and is usable while `0 <= step - w <=
max_staleness`. A group from the future (`w > step`) is never trained on.

Exactly-once across restarts (docs/replay.md): `state_dict()` stores the reader's cursor with the
files that still hold usable groups marked unread, plus the use counts of those groups. A restored
buffer re-reads those files and takes back only the groups listed, with their counts; everything else
in them was used up or dropped before the checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterable, Sequence

import draccus
import numpy as np

from marinrl.storage import RolloutStorageError, step_dir_name
from marinrl.train.advantages import AdvantageKind, advantage_scale, group_advantages, overlong_shaping, token_advantages
from marinrl.train.batching import BatchingConfig, TrainingBatch, make_training_batch
from marinrl.types import Rollout, RolloutBatch, RolloutGroup

logger = logging.getLogger(__name__)

STATE_VERSION = 1
_READER_STATE_VERSION = 1  # the RolloutReader cursor format this module knows how to edit
WAIT_FIRST_POLL_S = 0.01
WAIT_MAX_POLL_S = 0.1
"""While the trainer waits for a batch, the reader is listed after 10 ms, then doubling up to 100 ms."""

RewardFn = Callable[[RolloutGroup], "np.ndarray | tuple[np.ndarray, np.ndarray]"]
"""Maps a group to the rewards its filters and advantages use, one per rollout, or to `(rewards,
trainable)` where `trainable[i] = False` keeps rollout i in its group's baseline but trains none of its
tokens (DAPO's overlong masking). Must be a pure function of the group: it runs again when a file is
re-read after a restart. `overlong_reward_fn` builds one from a loss config."""


class ReplayTimeoutError(TimeoutError):
    """No complete batch within the timeout; the message describes the buffer and its drops."""


class ReplayIngestionError(RuntimeError):
    """The background ingestion thread died; raised by `sample()` with the thread's error as cause."""


# ----------------------------------------------------------------------------- buffered groups


@dataclasses.dataclass(eq=False)
class BufferedGroup:
    """One group in the buffer. Sampling strategies read it; only the buffer changes it."""

    group: RolloutGroup
    advantages: np.ndarray  # float32 [len(group)]
    advantage_scale: float  # advantages.advantage_scale of `rewards`: per-turn credit divides by it
    rewards: np.ndarray  # float64 [len(group)]: after reward_fn, what advantages and filters saw
    trainable: np.ndarray  # bool [len(group)]: False for rollouts whose tokens are not trained
    env_name: str
    weight_step: int
    created_at: float  # earliest created_at of its rollouts
    seq: int  # ingestion order in this buffer
    source: str | None  # "step=XXXXXXXX/<file>.parquet" (or the caller's source), None when unknown
    uses: int = 0

    @property
    def group_id(self) -> str:
        return self.group.group_id


@dataclasses.dataclass(frozen=True)
class SampledGroup:
    """A group as handed to the trainer for one step."""

    group: RolloutGroup
    advantages: np.ndarray  # float32 [len(group)]
    advantage_scale: float
    trainable: np.ndarray  # bool [len(group)]
    env_name: str
    weight_step: int
    staleness: int
    use: int  # 1 the first time the group is trained on, 2 the second time, ...
    source: str | None


@dataclasses.dataclass(frozen=True)
class ReplaySample:
    """The groups of one optimizer step, in batch order."""

    step: int
    groups: tuple[SampledGroup, ...]

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.group.rollouts]

    @property
    def advantages(self) -> np.ndarray:
        return np.concatenate([g.advantages for g in self.groups]).astype(np.float32)

    def token_advantages(self) -> list[np.ndarray]:
        """Per rollout, the advantage of each response token (`advantages.token_advantages`): the
        rollout's advantage, less the rewards its earlier turns already earned."""
        return [token_advantages(float(a), r.token_rewards, g.advantage_scale)
                for g in self.groups for a, r in zip(g.advantages, g.group.rollouts)]

    @property
    def trainable(self) -> np.ndarray:
        return np.concatenate([g.trainable for g in self.groups])

    def training_batch(self, *, batch_size: int, config: BatchingConfig, row_multiple: int = 1) -> TrainingBatch:
        """This step's `TrainingBatch`: `batch_size` rollout slots (n_groups × n_generations; trimmed groups
        leave empty slots), rollouts in group order, rows a multiple of `row_multiple` (batching.py)."""
        return make_training_batch(self.rollouts, self.token_advantages(), batch_size=batch_size, config=config,
                                   trainable=self.trainable, row_multiple=row_multiple)

    def metrics(self) -> dict[str, float]:
        """Per-step numbers for the tracker: staleness, uses, rewards and the env mix of this batch."""
        staleness = np.array([g.staleness for g in self.groups], dtype=np.float64)
        uses = np.array([g.use for g in self.groups], dtype=np.float64)
        rewards = np.array([r.episode_reward for r in self.rollouts], dtype=np.float64)
        out = {
            "batch/groups": float(len(self.groups)),
            "batch/rollouts": float(rewards.size),
            "batch/staleness_mean": float(staleness.mean()),
            "batch/staleness_max": float(staleness.max()),
            "batch/use_mean": float(uses.mean()),
            "batch/reward_mean": float(rewards.mean()),
        }
        for env, n in collections.Counter(g.env_name for g in self.groups).items():
            out[f"batch/groups/{env}"] = float(n)
        by_policy: dict[str, list[float]] = collections.defaultdict(list)
        by_agent: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for r in self.rollouts:  # multi-agent systems: what each policy and each of its agents trained on
            by_policy[r.policy_name].append(r.episode_reward)
            by_agent[(r.policy_name, r.agent_name)].append(r.episode_reward)
        for policy, rewards_of in by_policy.items():
            out[f"batch/rollouts/policy/{policy}"] = float(len(rewards_of))
            out[f"batch/reward_mean/policy/{policy}"] = float(np.mean(rewards_of))
        for (policy, agent), rewards_of in by_agent.items():
            out[f"batch/reward_mean/agent/{policy}/{agent}"] = float(np.mean(rewards_of))
        return out


def _oldest_first(candidates: Sequence[BufferedGroup]) -> list[BufferedGroup]:
    return sorted(candidates, key=lambda g: (g.weight_step, g.seq))


# ----------------------------------------------------------------------------- sampling strategies


@dataclasses.dataclass(frozen=True)
class SamplingConfig(draccus.ChoiceRegistry):
    """Which groups a step may use and which it takes. A registered choice (`type: off_policy`).

    A strategy has `max_staleness` (usable while `0 <= step - weight_step <= max_staleness`),
    `max_uses` (times one group may be trained on) and `choose(candidates, k, step, rng)`, which
    picks `k` of the usable `candidates` of one environment (there are always at least `k`).
    """

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "off_policy"

    @property
    def max_staleness(self) -> int:
        raise NotImplementedError

    @property
    def max_uses(self) -> int:
        raise NotImplementedError

    def choose(
        self, candidates: Sequence[BufferedGroup], k: int, step: int, rng: np.random.Generator
    ) -> list[BufferedGroup]:
        raise NotImplementedError

    def describe(self) -> str:
        name = SamplingConfig.get_choice_name(type(self))
        return f"{name} (max_staleness={self.max_staleness}, max_uses={self.max_uses})"


@SamplingConfig.register_subclass("on_policy")
@dataclasses.dataclass(frozen=True)
class OnPolicyConfig(SamplingConfig):
    """Exact on-policy: only groups of the trainer's current weights, each trained on once; the
    trainer waits for them."""

    @property
    def max_staleness(self) -> int:
        return 0

    @property
    def max_uses(self) -> int:
        return 1

    def choose(self, candidates, k, step, rng):
        return _oldest_first(candidates)[:k]


@SamplingConfig.register_subclass("off_policy")
@dataclasses.dataclass(frozen=True)
class OffPolicyConfig(SamplingConfig):
    """Each group trained on once, up to `max_staleness` weight versions old; oldest first, so the
    groups closest to expiry are used before they expire."""

    staleness: int = 1
    """Largest `step - weight_step` a group may have; 1 overlaps generation of batch N with training on N-1."""

    def __post_init__(self):
        if self.staleness < 0:
            raise ValueError(f"off_policy.staleness must be >= 0, got {self.staleness}")

    @property
    def max_staleness(self) -> int:
        return self.staleness

    @property
    def max_uses(self) -> int:
        return 1

    def choose(self, candidates, k, step, rng):
        return _oldest_first(candidates)[:k]


@SamplingConfig.register_subclass("replay")
@dataclasses.dataclass(frozen=True)
class ReplaySamplingConfig(SamplingConfig):
    """Each group trained on up to `uses` times while at most `staleness` versions old; groups are
    drawn without replacement with probability ∝ `recency_decay ** (step - weight_step)`."""

    staleness: int = 4
    """Largest `step - weight_step` a group may have."""
    uses: int = 2
    """How many steps may train on one group."""
    recency_decay: float = 0.5
    """Weight of a group one version older relative to a fresher one; 1 draws uniformly."""

    def __post_init__(self):
        if self.staleness < 0:
            raise ValueError(f"replay.staleness must be >= 0, got {self.staleness}")
        if self.uses < 1:
            raise ValueError(f"replay.uses must be >= 1, got {self.uses}")
        if not 0 < self.recency_decay <= 1:
            raise ValueError(f"replay.recency_decay must be in (0, 1], got {self.recency_decay}")

    @property
    def max_staleness(self) -> int:
        return self.staleness

    @property
    def max_uses(self) -> int:
        return self.uses

    def choose(self, candidates, k, step, rng):
        ordered = _oldest_first(candidates)
        weights = np.array([self.recency_decay ** (step - g.weight_step) for g in ordered], dtype=np.float64)
        # Weighted sampling without replacement: the k largest u^(1/w) (Efraimidis & Spirakis).
        keys = rng.random(len(ordered)) ** (1.0 / weights)
        picked = np.argsort(-keys, kind="stable")[:k]
        return [ordered[i] for i in sorted(picked)]


# ----------------------------------------------------------------------------- group filters


@dataclasses.dataclass(frozen=True)
class ScoredGroup:
    """A group with the rewards filters and advantages use (after `reward_fn`), and which rollouts train."""

    group: RolloutGroup
    rewards: np.ndarray
    trainable: np.ndarray

    def subset(self, keep: np.ndarray) -> ScoredGroup:
        idx = np.flatnonzero(keep)
        return ScoredGroup(RolloutGroup(tuple(self.group.rollouts[i] for i in idx)), self.rewards[idx],
                           self.trainable[idx])


@dataclasses.dataclass(frozen=True)
class GroupFilterConfig(draccus.ChoiceRegistry):
    """One step of the ingestion filter chain (`filters: [{type: zero_variance}, ...]`).

    `apply` takes the groups of one ingested rollout file and returns those it keeps, possibly with
    fewer rollouts (trimmed). What it leaves out is counted under its registered name.
    """

    def apply(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return GroupFilterConfig.get_choice_name(type(self))


@GroupFilterConfig.register_subclass("zero_variance")
@dataclasses.dataclass(frozen=True)
class ZeroVarianceFilter(GroupFilterConfig):
    """Drops groups whose rewards are all equal (DAPO dynamic sampling): their advantages are all zero."""

    def apply(self, groups):
        return [g for g in groups if np.ptp(g.rewards) > 0]


@GroupFilterConfig.register_subclass("reward_mean")
@dataclasses.dataclass(frozen=True)
class RewardMeanFilter(GroupFilterConfig):
    """Keeps groups whose mean reward lies in [low, high] (e.g. drop prompts that are always or never solved)."""

    low: float = float("-inf")
    high: float = float("inf")

    def __post_init__(self):
        if not self.low <= self.high:
            raise ValueError(f"reward_mean needs low <= high, got low={self.low}, high={self.high}")

    def apply(self, groups):
        return [g for g in groups if self.low <= g.rewards.mean() <= self.high]


@GroupFilterConfig.register_subclass("reward_std_quantile")
@dataclasses.dataclass(frozen=True)
class RewardStdQuantileFilter(GroupFilterConfig):
    """Keeps groups whose reward std lies between the `low` and `high` quantiles of the stds of the
    groups in the same rollout file (e.g. `low: 0.5` keeps the more informative half). Quantiles are
    taken per file so a file always filters the same way, whenever and however often it is read."""

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self):
        if not 0 <= self.low <= self.high <= 1:
            raise ValueError(f"reward_std_quantile needs 0 <= low <= high <= 1, got low={self.low}, high={self.high}")

    def apply(self, groups):
        if not groups:
            return groups
        stds = np.array([g.rewards.std() for g in groups])
        lo, hi = np.quantile(stds, [self.low, self.high])
        return [g for g, s in zip(groups, stds) if lo <= s <= hi]


@GroupFilterConfig.register_subclass("trim_outliers")
@dataclasses.dataclass(frozen=True)
class TrimOutliersFilter(GroupFilterConfig):
    """Removes rollouts whose `metric` is more than `max_z` standard deviations from their group's mean
    (z-scores over the whole group; with G samples no |z| can exceed (G-1)/sqrt(G)). A group left with
    fewer than `min_size` rollouts is dropped. Advantages are computed after trimming."""

    metric: str = "reward"
    """`reward` (after reward_fn) or `response_length`."""
    max_z: float = 3.0
    min_size: int = 2

    def __post_init__(self):
        if self.metric not in ("reward", "response_length"):
            raise ValueError(f"trim_outliers.metric must be 'reward' or 'response_length', got {self.metric!r}")
        if self.max_z <= 0:
            raise ValueError(f"trim_outliers.max_z must be > 0, got {self.max_z}")
        if self.min_size < 1:
            raise ValueError(f"trim_outliers.min_size must be >= 1, got {self.min_size}")

    def apply(self, groups):
        kept = []
        for g in groups:
            if self.metric == "reward":
                x = g.rewards
            else:
                x = np.array([r.response_tokens.size for r in g.group.rollouts], dtype=np.float64)
            std = x.std()
            keep = np.ones(x.size, dtype=bool) if std == 0 else np.abs(x - x.mean()) <= self.max_z * std
            if keep.sum() < self.min_size:
                continue
            kept.append(g if keep.all() else g.subset(keep))
        return kept


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """The trainer's replay buffer."""

    sampling: SamplingConfig = dataclasses.field(default_factory=OffPolicyConfig)
    """Staleness window, reuse and which usable groups a step takes: on_policy, off_policy, replay."""
    env_weights: dict[str, float] | None = None
    """Share of each step's groups per environment. Set: each batch is mixed by these weights
    (cumulatively exact across steps) and groups of other environments are dropped. None: groups are
    taken regardless of environment."""
    filters: list[GroupFilterConfig] = dataclasses.field(default_factory=list)
    """Group filters applied in order at ingestion."""
    capacity_per_env: int = 4096
    """Groups kept per environment; past it the oldest are evicted."""
    max_age_s: float | None = None
    """Groups whose rollouts were created longer ago than this (wall clock) are dropped."""
    timeout_s: float = 600.0
    """How long `sample()` waits for a complete batch by default."""
    poll_interval_s: float = 1.0
    """How often the reader is listed when it had nothing new and the trainer is not waiting (while it
    waits: right away, then from 10 ms doubling up to 100 ms)."""
    max_files_per_poll: int = 64
    """Files read per poll, so the buffer stays responsive while a backlog is read."""
    seed: int = 0
    """Seeds the random draws of strategies (with the step, so a resumed run draws the same)."""

    def __post_init__(self):
        if self.env_weights is not None:
            if not self.env_weights:
                raise ValueError("ReplayConfig.env_weights is empty; use None to take groups regardless of env")
            bad = {e: w for e, w in self.env_weights.items() if not (np.isfinite(w) and w >= 0)}
            if bad or sum(self.env_weights.values()) <= 0:
                raise ValueError(f"ReplayConfig.env_weights must be finite, >= 0 and not all 0, got {self.env_weights}")
        if self.capacity_per_env < 1:
            raise ValueError(f"ReplayConfig.capacity_per_env must be >= 1, got {self.capacity_per_env}")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"ReplayConfig.max_age_s must be > 0 or None, got {self.max_age_s}")
        for name in ("timeout_s", "poll_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ReplayConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_files_per_poll < 1:
            raise ValueError(f"ReplayConfig.max_files_per_poll must be >= 1, got {self.max_files_per_poll}")

    def for_loss(self, loss) -> ReplayConfig:
        """This config with a `zero_variance` filter first when the loss (`losses.LossConfig`) sets
        `drop_zero_variance_groups`. The loss also decides the buffer's `advantage` (pass
        `loss.advantage` to `build`) and its overlong shaping (`overlong_reward_fn(loss)`)."""
        filters = list(self.filters)
        if loss.drop_zero_variance_groups and not any(isinstance(f, ZeroVarianceFilter) for f in filters):
            filters.insert(0, ZeroVarianceFilter())
        return dataclasses.replace(self, filters=filters)

    def build(self, reader=None, *, advantage: AdvantageKind = "group_std", reward_fn: RewardFn | None = None,
              max_tokens: int | None = None, clock: Callable[[], float] = time.time,
              start_step: int = 0) -> ReplayBuffer:
        return ReplayBuffer(self, reader, advantage=advantage, reward_fn=reward_fn, max_tokens=max_tokens,
                            clock=clock, start_step=start_step)


def overlong_reward_fn(loss) -> RewardFn | None:
    """The `reward_fn` of a loss config's overlong shaping (`advantages.overlong_shaping`), None for `none`.

    A response is truncated when its `finish_reason` is `length`; its length is its number of response
    tokens (environment tokens of multi-turn episodes included: they count against the same budget).
    """
    if loss.overlong == "none":
        return None

    def shape(group: RolloutGroup):
        return overlong_shaping(
            group.rewards,
            np.array([r.response_tokens.size for r in group.rollouts], dtype=np.int64),
            np.array([r.finish_reason == "length" for r in group.rollouts]),
            mode=loss.overlong,
            max_response_tokens=loss.max_response_tokens,
            cache_tokens=loss.overlong_cache_tokens,
            penalty=loss.overlong_penalty,
        )

    return shape


# ----------------------------------------------------------------------------- the buffer


def _file_key(source: str, batch: RolloutBatch) -> str:
    """`step=XXXXXXXX/<name>` for a rollout file path: independent of how the root URL was spelled."""
    parts = source.rstrip("/").rsplit("/", 2)
    if len(parts) >= 2 and parts[-2] == step_dir_name(batch.weight_step):
        return f"{parts[-2]}/{parts[-1]}"
    return source


def _parse_file_key(key: str) -> tuple[int, str] | None:
    folder, _, name = key.partition("/")
    if not name or "/" in name or not folder.startswith("step="):
        return None
    try:
        step = int(folder[len("step="):])
    except ValueError:
        return None
    return (step, name) if step_dir_name(step) == folder else None


class ReplayBuffer:
    """Rollout groups waiting to be trained on. Thread-safe: one ingestion thread, one trainer.

    Lifecycle: build (`ReplayConfig.build(reader)`), optionally `load_state_dict(state)`, `start()`
    the ingestion thread (or call `poll()` / `ingest()` yourself), `sample()` once per step,
    `state_dict()` at checkpoints, `stop()`.
    """

    def __init__(self, config: ReplayConfig, reader=None, *, advantage: AdvantageKind = "group_std",
                 reward_fn: RewardFn | None = None, max_tokens: int | None = None,
                 clock: Callable[[], float] = time.time, start_step: int = 0):
        """`advantage` is the estimator applied per group at ingestion (group_std, group_mean or rloo):
        the loss's (`LossConfig.advantage`), so it is configured in one place."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if advantage not in ("group_std", "group_mean", "rloo"):
            raise ValueError(f"advantage must be group_std, group_mean or rloo, got {advantage!r}")
        self.config = config
        self._advantage = advantage
        self.reader = reader
        self._strategy = config.sampling
        self._reward_fn = reward_fn
        self._max_tokens = max_tokens
        self._clock = clock
        weights = config.env_weights
        total = sum(weights.values()) if weights else 0.0
        self._weights = {e: w / total for e, w in sorted(weights.items()) if w > 0} if weights else None

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ingest_lock = threading.RLock()  # one read-and-ingest at a time; state_dict waits for it
        self._groups: dict[str, dict[int, BufferedGroup]] = collections.defaultdict(dict)  # env -> seq -> group
        self._seq = 0
        self._step = start_step
        self._last_sampled_step: int | None = None
        self._timeline_start = clock()
        self._restore: dict[str, dict[str, int]] = {}  # file key -> {group_id: uses}, awaiting re-read
        self._mix_given: collections.Counter[str] = collections.Counter()
        self._mix_total = 0

        # Metrics (counts in groups unless named otherwise).
        self._dropped: collections.Counter[str] = collections.Counter()
        self._dropped_rollouts: collections.Counter[str] = collections.Counter()
        self._retired_uses: collections.Counter[int] = collections.Counter()  # uses a group had when it left
        self._trained_staleness: collections.Counter[int] = collections.Counter()
        self._ingested_groups = 0
        self._ingested_files = 0
        self._sampled_groups = 0
        self._read_errors = 0
        self._reader_totals_before: collections.Counter[str] = collections.Counter()  # from the checkpoint
        self._lags: collections.deque[float] = collections.deque(maxlen=1024)
        self._last_read_at: float | None = None

        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by a waiting sample() and by stop(): poll now
        self._waiting = 0  # sample() calls blocked on a batch (lock held to change)
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ ingestion

    def ingest(self, batches: Iterable[RolloutBatch], sources: Sequence[str | None] | None = None) -> int:
        """Adds the groups of `batches`; returns how many entered the buffer.

        `sources[i]` names where batch i came from (the reader's file path). Groups with a source can
        be rebuilt after a restart (see `state_dict`); groups without one cannot.
        """
        batches = list(batches)
        sources = list(sources) if sources is not None else [None] * len(batches)
        if len(sources) != len(batches):
            raise ValueError(f"got {len(sources)} sources for {len(batches)} batches")
        now = self._clock()
        added = 0
        with self._ingest_lock:
            for batch, source in zip(batches, sources):
                added += self._ingest_one(batch, source, now)
        return added

    def _ingest_one(self, batch: RolloutBatch, source: str | None, now: float) -> int:
        key = _file_key(source, batch) if source is not None else None
        with self._lock:
            restore = self._restore.get(key) if key is not None else None
        # Filters run on the whole file even when it is re-read after a restart, so that a filter that
        # looks at all of a file's groups (quantiles) decides exactly as it did the first time.
        kept, dropped, dropped_rollouts = self._prepare(batch)
        if restore is None:
            uses = [0] * len(kept)
        else:  # re-read after a restart: only what was still usable comes back, with its use count
            kept = [s for s in kept if s.group.group_id in restore]
            uses = [restore[s.group.group_id] for s in kept]
        added = 0
        with self._cond:
            if restore is None:  # a re-read file was counted before the checkpoint
                self._dropped.update(dropped)
                self._dropped_rollouts.update(dropped_rollouts)
                self._lags.append(now - batch.metadata.created_at)
                self._ingested_groups += len(kept)
            else:
                del self._restore[key]
            self._ingested_files += 1
            for scored, n_uses in zip(kept, uses):
                added += self._insert(scored, batch.weight_step, key, n_uses, now)
            self._cond.notify_all()
        return added

    def _prepare(self, batch: RolloutBatch):
        """Rewards, validity and filters of one batch: (kept groups, group drops, rollout drops) by reason."""
        dropped: collections.Counter[str] = collections.Counter()
        dropped_rollouts: collections.Counter[str] = collections.Counter()

        def drop(g: RolloutGroup, reason: str):
            dropped[reason] += 1
            dropped_rollouts[reason] += len(g)

        scored = []
        for g in batch.groups:
            envs = {r.env_name for r in g.rollouts}
            if len(envs) != 1:
                logger.error("group %r mixes environments %s; dropped", g.group_id, sorted(envs))
                drop(g, "invalid")
                continue
            if self._weights is not None and next(iter(envs)) not in self._weights:
                drop(g, "unweighted_env")
                continue
            if any(r.prompt_tokens.size == 0 for r in g.rollouts):
                logger.error("group %r has a rollout with an empty prompt; dropped", g.group_id)
                drop(g, "invalid")
                continue
            if self._max_tokens is not None and max(r.num_tokens for r in g.rollouts) > self._max_tokens:
                drop(g, "too_long")
                continue
            scored.append(self._score(g))
        for f in self.config.filters:
            before = {s.group.group_id: len(s.group) for s in scored}
            scored = f.apply(scored)
            after = {s.group.group_id: len(s.group) for s in scored}
            for gid, n in before.items():
                if gid not in after:
                    dropped[f.name] += 1
                    dropped_rollouts[f.name] += n
                elif after[gid] < n:
                    dropped_rollouts[f.name] += n - after[gid]
        return scored, dropped, dropped_rollouts

    def _score(self, g: RolloutGroup) -> ScoredGroup:
        out = g.rewards if self._reward_fn is None else self._reward_fn(g)
        rewards, trainable = out if isinstance(out, tuple) else (out, np.ones(len(g), dtype=bool))
        rewards, trainable = np.asarray(rewards, dtype=np.float64), np.asarray(trainable)
        if rewards.shape != (len(g),) or not np.all(np.isfinite(rewards)):
            raise ValueError(f"reward_fn returned rewards {rewards!r} for group {g.group_id!r} of {len(g)} rollouts; "
                             f"expected {len(g)} finite numbers")
        if trainable.shape != (len(g),) or trainable.dtype != np.bool_:
            raise ValueError(f"reward_fn returned trainable {trainable!r} for group {g.group_id!r}; expected {len(g)} "
                             f"booleans")
        return ScoredGroup(g, rewards, trainable)

    def _insert(self, scored: ScoredGroup, weight_step: int, source: str | None, uses: int, now: float) -> int:
        """Adds one group (lock held); returns 1 if it stayed."""
        group = scored.group
        entry = BufferedGroup(
            group=group,
            advantages=group_advantages(scored.rewards, self._advantage).astype(np.float32),
            advantage_scale=advantage_scale(scored.rewards, self._advantage),
            rewards=scored.rewards,
            trainable=scored.trainable,
            env_name=group.rollouts[0].env_name,
            weight_step=weight_step,
            created_at=min(r.metadata.created_at for r in group.rollouts),
            seq=self._seq,
            source=source,
            uses=uses,
        )
        self._seq += 1
        reason = self._unusable_reason(entry, self._step, now)
        if reason is None and entry.weight_step > self._step and entry.created_at < self._timeline_start:
            # Made by weights this run has not trained yet, before this run started: a previous run's
            # future (after a restart from an older checkpoint). Newer weights of this run only appear
            # after `sample()` has moved the step on, so such a group is held until then.
            reason = "future"
        if reason is None and uses >= self._strategy.max_uses:
            reason = "used_up"  # restored under a config with fewer max_uses
        if reason is not None:
            self._retire(entry, reason, in_buffer=False)
            return 0
        env = self._groups[entry.env_name]
        env[entry.seq] = entry
        if len(env) > self.config.capacity_per_env:
            oldest = min(env.values(), key=lambda g: (g.weight_step, g.seq))
            self._retire(oldest, "evicted")
            return 0 if oldest is entry else 1
        return 1

    def _unusable_reason(self, g: BufferedGroup, step: int, now: float) -> str | None:
        """Why `g` can never be used at `step` or later (lock held); None if it still may be."""
        if step - g.weight_step > self._strategy.max_staleness:
            return "stale"
        if self.config.max_age_s is not None and now - g.created_at > self.config.max_age_s:
            return "too_old"
        return None

    def _retire(self, g: BufferedGroup, reason: str, in_buffer: bool = True) -> None:
        """Takes `g` out (lock held). A group that was never trained on counts as dropped for `reason`;
        one that was in the buffer adds its use count to the uses histogram."""
        if in_buffer:
            del self._groups[g.env_name][g.seq]
            self._retired_uses[g.uses] += 1
        if g.uses == 0:
            self._dropped[reason] += 1
            self._dropped_rollouts[reason] += len(g.group)

    def _purge(self, step: int, now: float) -> None:
        """Drops everything unusable at `step` (lock held): stale, too old, or from the future."""
        for env in self._groups.values():
            for g in list(env.values()):
                reason = self._unusable_reason(g, step, now)
                if reason is None and g.weight_step > step:
                    reason = "future"  # weights newer than the trainer's: never trained on (docs/architecture.md, "The contracts")
                if reason is not None:
                    self._retire(g, reason)

    # ------------------------------------------------------------------ reading

    def poll(self) -> int:
        """Reads new files from the reader (at most `max_files_per_poll`) into the buffer; returns the count."""
        if self.reader is None:
            raise RuntimeError("this ReplayBuffer has no reader to poll; use ingest()")
        with self._ingest_lock:
            min_step = max(0, self._step - self._strategy.max_staleness)
            pairs = self.reader.read_new_with_paths(min_step=min_step, max_files=self.config.max_files_per_poll)
            self._last_read_at = self._clock()
            if pairs:
                self.ingest([b for _, b in pairs], sources=[p for p, _ in pairs])
        return len(pairs)

    def start(self) -> ReplayBuffer:
        """Starts the background ingestion thread."""
        if self.reader is None:
            raise RuntimeError("this ReplayBuffer has no reader to ingest from")
        if self.running:
            raise RuntimeError("the ingestion thread is already running")
        self._stop.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="replay-ingest", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stops the ingestion thread after its current read; raises if it does not stop in time."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the replay ingestion thread did not stop within {timeout_s} s")
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> ReplayBuffer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        """Reads new files every `poll_interval_s`; while a `sample()` waits for a batch, sooner: right
        away, then every 10 ms doubling up to 100 ms (an on-policy trainer waits on every step, and half
        an idle interval of listing latency each time was a third of its step on a CPU)."""
        interval = WAIT_FIRST_POLL_S
        while not self._stop.is_set():
            try:
                n = self.poll()
            except RolloutStorageError as e:  # retried inside storage already; try again next interval
                self._read_errors += 1
                logger.warning("reading rollouts failed, will retry: %s", e)
                n = 0
            except BaseException as e:
                logger.exception("replay ingestion thread failed")
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            if n:
                interval = WAIT_FIRST_POLL_S
                continue
            if self._waiting:
                self._wake.wait(interval)
                interval = min(interval * 2, WAIT_MAX_POLL_S, self.config.poll_interval_s)
            else:
                self._wake.wait(self.config.poll_interval_s)
            self._wake.clear()

    # ------------------------------------------------------------------ sampling

    def sample(self, step: int, n_groups: int, timeout_s: float | None = None) -> ReplaySample:
        """Whole groups for the update the trainer applies to weights `step`.

        Waits until `n_groups` usable groups are there, mixed per `env_weights`; raises
        `ReplayTimeoutError` after `timeout_s` (default `config.timeout_s`), `ReplayIngestionError`
        if the ingestion thread died. Without a running thread it polls the reader itself.
        """
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if step < self._step:
                raise ValueError(f"sample(step={step}) after the buffer reached step {self._step}: steps only go up "
                                 f"(a restarted trainer builds a new buffer)")
            self._step = step
            quotas = self._quotas(n_groups)
        polled = False
        while True:
            with self._cond:
                self._raise_if_failed()
                self._purge(step, self._clock())
                picked = self._pick(step, n_groups, quotas)
                if picked is not None:
                    return self._commit(step, picked, quotas)
                remaining = deadline - time.monotonic()
                self_polling = self.reader is not None and not self.running
                if remaining <= 0 and (polled or not self_polling):
                    raise ReplayTimeoutError(self._describe_wait(step, n_groups, quotas, timeout_s))
                if not self_polling:
                    self._waiting += 1
                    self._wake.set()  # the ingestion thread lists the reader now, and often while we wait
                    try:
                        self._cond.wait(remaining)  # ingestion notifies, and so does a dying thread
                    finally:
                        self._waiting -= 1
                    continue
            # No thread: read ourselves (at least once, even with no time left), and list again after
            # an interval when nothing new came.
            new_files = self.poll()
            polled = True
            if new_files == 0 and deadline > time.monotonic():
                with self._cond:
                    self._cond.wait(min(deadline - time.monotonic(), self.config.poll_interval_s))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ReplayIngestionError(f"the replay ingestion thread died: {self._error!r}") from self._error

    def _quotas(self, n: int) -> dict[str, int] | None:
        """Groups per env for the next batch (lock held): each slot to the env furthest below its share
        of all groups handed out so far, so the mix is exact over steps, not just in expectation."""
        if self._weights is None:
            return None
        alloc = dict.fromkeys(self._weights, 0)
        for i in range(n):
            total = self._mix_total + i + 1
            env = max(self._weights, key=lambda e: self._weights[e] * total - self._mix_given[e] - alloc[e])
            alloc[env] += 1
        return {e: k for e, k in alloc.items() if k}

    def _usable(self, env: str, step: int) -> list[BufferedGroup]:
        s = self._strategy
        return [g for g in self._groups.get(env, {}).values()
                if 0 <= step - g.weight_step <= s.max_staleness and g.uses < s.max_uses]

    def _pick(self, step: int, n: int, quotas: dict[str, int] | None) -> list[BufferedGroup] | None:
        rng = np.random.default_rng([self.config.seed, step])
        if quotas is None:
            usable = [g for env in sorted(self._groups) for g in self._usable(env, step)]
            return self._strategy.choose(usable, n, step, rng) if len(usable) >= n else None
        usable = {env: self._usable(env, step) for env in quotas}
        if any(len(usable[env]) < k for env, k in quotas.items()):
            return None
        return [g for env, k in quotas.items() for g in self._strategy.choose(usable[env], k, step, rng)]

    def _commit(self, step: int, picked: list[BufferedGroup], quotas: dict[str, int] | None) -> ReplaySample:
        out = []
        for g in picked:
            g.uses += 1
            staleness = step - g.weight_step
            self._trained_staleness[staleness] += 1
            out.append(SampledGroup(g.group, g.advantages, g.advantage_scale, g.trainable, g.env_name, g.weight_step,
                                    staleness, g.uses, g.source))
            if g.uses >= self._strategy.max_uses:
                self._retire(g, "used_up")
        if quotas is not None:
            self._mix_given.update(quotas)
            self._mix_total += len(picked)
        self._sampled_groups += len(picked)
        self._last_sampled_step = step
        return ReplaySample(step, tuple(out))

    def _describe_wait(self, step: int, n: int, quotas: dict[str, int] | None, timeout_s: float) -> str:
        s = self._strategy
        lo = max(0, step - s.max_staleness)
        lines = [f"no batch of {n} groups for trainer step {step} within {timeout_s:g} s; sampling "
                 f"{s.describe()} accepts weight steps {lo}..{step}"]
        if quotas is not None:
            need = ", ".join(f"{e}={k} (usable {len(self._usable(e, step))})" for e, k in quotas.items())
            lines.append(f"needed per env: {need}")
        held = sum(len(env) for env in self._groups.values())
        lines.append(f"buffer holds {held} groups" + (":" if held else ""))
        for env in sorted(self._groups):
            # After the purge every group left is usable at `step`; what is missing is more of them.
            by_step: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
            for g in self._groups[env].values():
                by_step[g.weight_step][0] += 1
                by_step[g.weight_step][1] += g.uses > 0
            if by_step:
                parts = ", ".join(f"weight_step {w}: {n} groups ({used} used before)"
                                  for w, (n, used) in sorted(by_step.items()))
                lines.append(f"  {env}: {parts}")
        drops = ", ".join(f"{r}={k}" for r, k in self._dropped.most_common()) or "none"
        lines.append(f"groups dropped unused so far: {drops}")
        if self.reader is None:
            lines.append("ingestion: no reader; groups come only from ingest()")
        else:
            thread = "running" if self.running else "not running (sample() polls)"
            since = ("never read" if self._last_read_at is None
                     else f"last read {self._clock() - self._last_read_at:.1f} s ago")
            lines.append(f"ingestion: thread {thread}, {self._ingested_files} files ingested, {since}, "
                         f"{self._read_errors} read errors; reader {getattr(self.reader, 'url', self.reader)!s}")
        if self._restore:
            lines.append(f"{len(self._restore)} files from the checkpoint are not re-read yet")
        return "\n".join(lines)

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float]:
        """Flat `replay/...` numbers for the tracker; counters are cumulative over the run."""
        with self._lock:
            out: dict[str, float] = {
                "replay/groups": float(sum(len(env) for env in self._groups.values())),
                "replay/ingested_groups": float(self._ingested_groups),
                "replay/ingested_files": float(self._ingested_files),
                "replay/sampled_groups": float(self._sampled_groups),
                "replay/read_errors": float(self._read_errors),
                "replay/restore_files_pending": float(len(self._restore)),
                "replay/step": float(self._step),
            }
            for env, groups in sorted(self._groups.items()):
                out[f"replay/size/{env}"] = float(len(groups))
                out[f"replay/size_rollouts/{env}"] = float(sum(len(g.group) for g in groups.values()))
            out.update({f"replay/{k}": float(v) for k, v in self._reader_totals().items()})
            for reason, k in self._dropped.items():
                out[f"replay/dropped/{reason}"] = float(k)
            for reason, k in self._dropped_rollouts.items():
                out[f"replay/dropped_rollouts/{reason}"] = float(k)
            for s, k in self._trained_staleness.items():
                out[f"replay/trained_staleness/{s}"] = float(k)
            for u, k in self._retired_uses.items():
                out[f"replay/uses/{u}"] = float(k)
            if self._lags:
                lags = np.array(self._lags)
                out["replay/ingestion_lag_s/mean"] = float(lags.mean())
                out["replay/ingestion_lag_s/max"] = float(lags.max())
        return out

    def _reader_totals(self) -> dict[str, int]:
        """The reader's unreadable-file counts as running totals over the run, restarts included:
        files quarantined, and file reads that failed after retries."""
        counts = getattr(self.reader, "metrics", None) or {}
        now = {"quarantined_files": counts.get("quarantined_files", 0),
               "file_read_errors": counts.get("read_errors", 0)}
        return {k: self._reader_totals_before[k] + v for k, v in now.items()}

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self, next_step: int | None = None) -> dict:
        """JSON-able state for the trainer checkpoint of the weights the restored run samples next.

        Take it after the last sampled batch was trained and before the next `sample()`. With
        `next_step` (the step the restored run will sample first) it raises if a batch for that step
        or later was already handed out, i.e. if the caller prefetched across the checkpoint.

        It holds the reader's cursor with every file that still has usable groups marked unread, and
        the use counts of those groups; the rest of each such file was used up or dropped already.
        """
        with self._ingest_lock, self._lock:
            if next_step is not None and self._last_sampled_step is not None and self._last_sampled_step >= next_step:
                raise ValueError(f"a batch for step {self._last_sampled_step} was sampled before the checkpoint for "
                                 f"step {next_step}: snapshot the replay state before sampling past it")
            step = self._step if next_step is None else max(self._step, next_step)
            pending: dict[str, dict[str, int]] = {k: dict(v) for k, v in self._restore.items()}
            unrecoverable = 0
            # Groups unusable at `step` are left out; the counters record them as the next sample()
            # of an uninterrupted run would.
            dropped, dropped_rollouts = collections.Counter(self._dropped), collections.Counter(self._dropped_rollouts)
            retired_uses = collections.Counter(self._retired_uses)
            now = self._clock()
            for env in self._groups.values():
                for g in env.values():
                    reason = self._unusable_reason(g, step, now)
                    if reason is not None:
                        retired_uses[g.uses] += 1
                        if g.uses == 0:
                            dropped[reason] += 1
                            dropped_rollouts[reason] += len(g.group)
                        continue
                    if g.source is None:
                        unrecoverable += 1
                        continue
                    pending.setdefault(g.source, {})[g.group_id] = g.uses
            reader_state = self.reader.state_dict() if self.reader is not None else None
            if reader_state is not None:
                reader_state, lost = _mark_unread(reader_state, pending)
                for key in lost:
                    unrecoverable += len(pending.pop(key))
            if unrecoverable:
                logger.warning("%d usable buffered groups cannot be restored after a restart (ingested without a "
                               "source, or below the reader's floor)", unrecoverable)
            return {
                "version": STATE_VERSION,
                "step": step,
                "reader": reader_state,
                "pending": {k: dict(sorted(v.items())) for k, v in sorted(pending.items())},
                "unrecoverable_groups": unrecoverable,
                "mix": {"given": dict(self._mix_given), "total": self._mix_total},
                "counters": {
                    "dropped": dict(dropped),
                    "dropped_rollouts": dict(dropped_rollouts),
                    "retired_uses": {str(k): v for k, v in retired_uses.items()},
                    "trained_staleness": {str(k): v for k, v in self._trained_staleness.items()},
                    "ingested_groups": self._ingested_groups,
                    "ingested_files": self._ingested_files,
                    "sampled_groups": self._sampled_groups,
                    **self._reader_totals(),
                },
            }

    def load_state_dict(self, state: dict) -> None:
        """Restores a fresh buffer (before `start()` and any ingestion) from `state_dict()`.

        The reader gets the saved cursor; the files listed as pending are read again through it, and
        only their listed groups come back, with their use counts.
        """
        if self.running or self._ingested_files or any(self._groups.values()):
            raise RuntimeError("load_state_dict() needs a fresh buffer: call it before start() and ingestion")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"replay state version {state.get('version')!r} is not {STATE_VERSION}")
        try:
            step = int(state["step"])
            pending = {str(k): {str(g): int(u) for g, u in v.items()} for k, v in state["pending"].items()}
            counters = state["counters"]
            mix = state["mix"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"replay state is malformed ({e!r})") from e
        if state.get("reader") is not None:
            if self.reader is None:
                raise ValueError("the replay state holds a reader cursor but this buffer has no reader")
            self.reader.load_state_dict(state["reader"])
        with self._lock:
            self._step = step
            self._restore = pending
            self._timeline_start = self._clock()
            self._mix_given = collections.Counter({str(k): int(v) for k, v in mix["given"].items()})
            self._mix_total = int(mix["total"])
            self._dropped = collections.Counter(counters["dropped"])
            self._dropped_rollouts = collections.Counter(counters["dropped_rollouts"])
            self._retired_uses = collections.Counter({int(k): v for k, v in counters["retired_uses"].items()})
            self._trained_staleness = collections.Counter({int(k): v for k, v in counters["trained_staleness"].items()})
            self._ingested_groups = int(counters["ingested_groups"])
            self._sampled_groups = int(counters["sampled_groups"])
            self._reader_totals_before = collections.Counter(
                {k: int(counters.get(k, 0)) for k in ("quarantined_files", "file_read_errors")})
            # ingested_files restarts at 0: it marks whether this buffer has read anything yet


def _mark_unread(reader_state: dict, pending: dict[str, dict[str, int]]) -> tuple[dict, list[str]]:
    """A copy of a RolloutReader cursor in which the `pending` files count as not yet read, and the
    pending files the reader will never list again (below its floor)."""
    if reader_state.get("format_version") != _READER_STATE_VERSION:
        raise ValueError(f"RolloutReader cursor format {reader_state.get('format_version')!r} is not "
                         f"{_READER_STATE_VERSION}; the replay buffer cannot mark files unread in it")
    consumed = {step: list(names) for step, names in reader_state["consumed"].items()}
    floor = int(reader_state["floor"])
    lost = []
    for key in pending:
        parsed = _parse_file_key(key)
        if parsed is None:
            continue  # a caller-named source: the caller ingests it again itself
        step, name = parsed
        if step < floor:
            lost.append(key)
            continue
        names = consumed.get(str(step))
        if names is not None and name in names:
            names.remove(name)
    return {**reader_state, "consumed": consumed}, lost
