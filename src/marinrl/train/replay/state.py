"""The replay buffer's checkpoint state: exactly-once training across restarts (docs/replay.md).

`state_dict()` stores the reader's cursor with the files that still hold usable groups marked unread,
plus the use counts of those groups. A restored buffer re-reads those files and takes back only the
groups listed, with their counts; everything else in them was used up or dropped before the
checkpoint. These are `ReplayBuffer` methods, kept here apart from ingestion and sampling.
"""

from __future__ import annotations

import collections
import logging

from marinrl.storage.rollouts import step_dir_name
from marinrl.types import RolloutBatch

logger = logging.getLogger(__name__)

STATE_VERSION = 1
_READER_STATE_VERSION = 1  # the RolloutReader cursor format this module knows how to edit


def file_key(source: str, batch: RolloutBatch) -> str:
    """`step=XXXXXXXX/<name>` for a rollout file path: independent of how the root URL was spelled."""
    parts = source.rstrip("/").rsplit("/", 2)
    if len(parts) >= 2 and parts[-2] == step_dir_name(batch.weight_step):
        return f"{parts[-2]}/{parts[-1]}"
    return source


def parse_file_key(key: str) -> tuple[int, str] | None:
    folder, _, name = key.partition("/")
    if not name or "/" in name or not folder.startswith("step="):
        return None
    try:
        step = int(folder[len("step="):])
    except ValueError:
        return None
    return (step, name) if step_dir_name(step) == folder else None


class ReplayCheckpointing:
    """`state_dict` and `load_state_dict` of `ReplayBuffer` (which holds the fields they read)."""

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
        parsed = parse_file_key(key)
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
