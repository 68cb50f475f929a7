"""What the replay buffer reports (`marinrl/train/replay/buffer.py`): its `replay/...` metrics, and the
description a `ReplayTimeoutError` carries of what the buffer holds and why groups were dropped."""

from __future__ import annotations

import collections

import numpy as np


class ReplayReporting:
    """Mixin of `ReplayBuffer`: reads its state under its lock; owns no state of its own."""

    def _describe_wait(self, step: int, n: int, quotas: dict[str, int] | None, timeout_s: float) -> str:
        s = self._strategy
        lo = self._window.oldest_step(step)
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
