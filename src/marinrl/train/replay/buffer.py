"""The replay buffer: rollout groups between the rollout files and the trainer's batches.

Groups come in from a `RolloutReader` (a background thread, or `poll()`), or from `ingest()`. At
ingestion each group gets its rewards (optionally reshaped by a `reward_fn`), passes the configured
group filters, and gets its group-relative advantages (`advantages.group_advantages`). It stays in
the buffer until it is used up (`max_uses`), too stale, too old, or evicted by its environment's
capacity. `sample(step, n_groups)` hands the trainer whole groups for one optimizer step, mixing
environments by configured weights; it waits for a complete batch and, if none comes in time, raises
an error that says what the buffer holds and why groups were dropped.

Weight steps follow docs/architecture.md ("The contracts"): the trainer about to apply update `step + 1`
holds weights `step`; a group made with weights `w` has staleness `step - w` and is usable while
`0 <= step - w <= max_staleness`. A group from the future (`w > step`) is never trained on.

Around it, one module per concept in this folder: `sampling` (the strategies' choosers), `filters` (group filters),
`groups` (the group records and `ReplaySample`), `staleness` (the window of usable weight steps), `ingest`
(what a file's groups go through before they enter), `report` (metrics and the timeout's description) and
`state` (checkpoints: exactly once across restarts, docs/replay.md); its config, `replay:`, is
config/replay.py.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Collection, Iterable, Sequence

import numpy as np

from marinrl.config.replay import ReplayConfig, RewardFn
from marinrl.storage.fs import RolloutStorageError
from marinrl.train.advantages import AdvantageKind, advantage_scale, group_advantages
from marinrl.train.replay.filters import ScoredGroup
from marinrl.train.replay.groups import BufferedGroup, ReplaySample, SampledGroup
from marinrl.train.replay.ingest import UnknownPolicyError, prepare_batch  # noqa: F401  (UnknownPolicyError: API)
from marinrl.train.replay.report import ReplayReporting
from marinrl.train.replay.sampling import choose
from marinrl.train.replay.staleness import StalenessWindow, group_weight_step, newest_weight_step
from marinrl.train.replay.state import ReplayCheckpointing, file_key
from marinrl.types import RolloutBatch

logger = logging.getLogger(__name__)

WAIT_FIRST_POLL_S = 0.01
WAIT_MAX_POLL_S = 0.1
STOP_CHECK_S = 0.25
"""How often a waiting `sample()` looks at its stop event: Ctrl-C ends a trainer's wait within this."""
"""While the trainer waits for a batch, the reader is listed after 10 ms, then doubling up to 100 ms."""


class ReplayTimeoutError(TimeoutError):
    """No complete batch within the timeout; the message describes the buffer and its drops."""


class ReplayIngestionError(RuntimeError):
    """The background ingestion thread died; raised by `sample()` with the thread's error as cause."""


class ReplayBuffer(ReplayCheckpointing, ReplayReporting):
    """Rollout groups waiting to be trained on. Thread-safe: one ingestion thread, one trainer.

    Lifecycle: build (`ReplayBuffer(config, reader)`), optionally `load_state_dict(state)`, `start()`
    the ingestion thread (or call `poll()` / `ingest()` yourself), `sample()` once per step,
    `state_dict()` at checkpoints, `stop()`.
    """

    def __init__(self, config: ReplayConfig, reader=None, *, advantage: AdvantageKind = "group_std",
                 reward_fn: RewardFn | None = None, max_tokens: int | None = None,
                 clock: Callable[[], float] = time.time, start_step: int = 0,
                 policies: Collection[str] | None = None):
        """`advantage` is the estimator applied per group at ingestion (group_std, group_mean or rloo):
        the loss's (`LossConfig.advantage`), so it is configured in one place. `policies`: the policy
        names trained here; a group of another raises `UnknownPolicyError` at ingestion (None: any)."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if advantage not in ("group_std", "group_mean", "rloo"):
            raise ValueError(f"advantage must be group_std, group_mean or rloo, got {advantage!r}")
        self.config = config
        self._advantage = advantage
        self.reader = reader
        self._strategy = config.sampling
        self._window = StalenessWindow(config.sampling.max_staleness, config.max_age_s)
        self._reward_fn = reward_fn
        self._max_tokens = max_tokens
        self._policies = None if policies is None else frozenset(policies)
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
        key = file_key(source, batch) if source is not None else None
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
                added += self._insert(scored, key, n_uses, now)
            self._cond.notify_all()
        return added

    def _prepare(self, batch: RolloutBatch):
        return prepare_batch(batch, filters=self.config.filters, env_weights=self._weights,
                             max_tokens=self._max_tokens, reward_fn=self._reward_fn, policies=self._policies)

    def _insert(self, scored: ScoredGroup, source: str | None, uses: int, now: float) -> int:
        """Adds one group (lock held); returns 1 if it stayed."""
        group = scored.group
        weight_step = group_weight_step(group, self.config.token_version_reduction)
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
            newest_step=newest_weight_step(group),
        )
        self._seq += 1
        reason = self._unusable_reason(entry, self._step, now)
        if reason is None and self._window.from_previous_run(entry.newest_step, entry.created_at, self._step,
                                                             self._timeline_start):
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
        return self._window.expired(g.weight_step, g.created_at, step, now)

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
                if reason is None and g.newest_step > step:
                    # weights newer than the trainer's: never trained on (docs/architecture.md, "The contracts")
                    reason = "future"
                if reason is not None:
                    self._retire(g, reason)

    # ------------------------------------------------------------------ reading

    def poll(self) -> int:
        """Reads new files from the reader (at most `max_files_per_poll`) into the buffer; returns the count."""
        if self.reader is None:
            raise RuntimeError("this ReplayBuffer has no reader to poll; use ingest()")
        with self._ingest_lock:
            min_step = self._window.oldest_step(self._step)
            # Only folders up to the trainer's next weights (published before it samples that step) can
            # hold new files of this run; the reader lists those, and the whole root only now and then.
            pairs = self.reader.read_new_with_paths(min_step=min_step, max_files=self.config.max_files_per_poll,
                                                    max_step=self._step + 1)
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
        """Stops the ingestion thread after its current read, then the reader's read threads (which are not
        daemons: left running, they would keep the process from exiting); raises if it does not stop in time."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the replay ingestion thread did not stop within {timeout_s} s")
            self._thread = None
        close = getattr(self.reader, "close", None)  # a later poll starts them again
        if close is not None:
            close()

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

    def sample(self, step: int, n_groups: int, timeout_s: float | None = None,
               stop: threading.Event | None = None) -> ReplaySample | None:
        """Whole groups for the update the trainer applies to weights `step`.

        Waits until `n_groups` usable groups are there, mixed per `env_weights`; raises
        `ReplayTimeoutError` after `timeout_s` (default `config.timeout_s`), `ReplayIngestionError`
        if the ingestion thread died. Without a running thread it polls the reader itself. Returns None
        once `stop` is set: a trainer asked to stop (Ctrl-C) must not wait out the timeout for rollouts
        that may never come (a stalled environment).
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
            if stop is not None and stop.is_set():
                return None
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
                        # ingestion notifies, and so does a dying thread; `stop` is looked at in between
                        self._cond.wait(remaining if stop is None else min(remaining, STOP_CHECK_S))
                    finally:
                        self._waiting -= 1
                    continue
            # No thread: read ourselves (at least once, even with no time left), and list again after
            # an interval when nothing new came.
            new_files = self.poll()
            polled = True
            if new_files == 0 and deadline > time.monotonic():
                with self._cond:
                    wait = min(deadline - time.monotonic(), self.config.poll_interval_s)
                    self._cond.wait(wait if stop is None else min(wait, STOP_CHECK_S))

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
                if self._window.contains(g.weight_step, step) and g.uses < s.max_uses]

    def _pick(self, step: int, n: int, quotas: dict[str, int] | None) -> list[BufferedGroup] | None:
        rng = np.random.default_rng([self.config.seed, step])
        if quotas is None:
            usable = [g for env in sorted(self._groups) for g in self._usable(env, step)]
            return choose(self._strategy, usable, n, step, rng) if len(usable) >= n else None
        usable = {env: self._usable(env, step) for env in quotas}
        if any(len(usable[env]) < k for env, k in quotas.items()):
            return None
        return [g for env, k in quotas.items() for g in choose(self._strategy, usable[env], k, step, rng)]

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
