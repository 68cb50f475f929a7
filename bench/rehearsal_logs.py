"""What bench/rehearsal.py reads back from a run folder: the actors' `startup:` lines and JSON log metrics
(marinrl/startup.py, Levanter's json_logger), the committed trainer checkpoints, and the published weight
versions (marinrl/transfer/checkpoint.py's folders, transfer/packed.py's header)."""

from __future__ import annotations

import json
import pathlib
import re
import struct
from typing import Optional

_STARTUP = re.compile(r"startup: (?P<phases>.*?) total=(?P<total>[\d.]+)s; rss MB: (?P<rss>.*?) peak=(?P<peak>[\d.]+)")
_PAIR = re.compile(r"(\w+)=([\d.]+)s?")
_ROLE_FILES = {"trainer": "trainer.log", "rollout": "rollout-0.log"}


class RunLogs:
    """One job's lines of the run's actor logs (the files are appended to by every job on the run)."""

    def __init__(self, lines: dict[str, list[str]], offsets: dict[str, int]):
        self.lines = lines
        self.offsets = offsets
        """Lines per file up to the end of this job: where the next job's lines start."""

    def _startup(self, role: str) -> dict:
        for line in self.lines.get(_ROLE_FILES[role], []):
            m = _STARTUP.search(line)
            if m:
                phases = {k: float(v) for k, v in _PAIR.findall(m["phases"])}
                rss = {k: float(v) for k, v in _PAIR.findall(m["rss"])}
                return {**phases, "total": float(m["total"]), "rss_mb": rss, "peak_mb": float(m["peak"])}
        return {}

    def trainer_startup(self) -> dict:
        """Phase seconds of the trainer's `startup:` line (ready, init, state, reference, publish, first_*)."""
        return self._startup("trainer")

    def rollout_startup(self) -> dict:
        """Phase seconds of the rollout worker's `startup:` line (ready, model, server, warm_up, ...)."""
        return self._startup("rollout")

    def rss_before_model_mb(self, role: str) -> Optional[float]:
        """The process's RSS just before it built its model: after `init` (the trainer: Levanter's
        initialize; its model is built in `state`), after `ready` (a rollout worker: imports done)."""
        rss = self._startup(role).get("rss_mb", {})
        return rss.get("init" if role == "trainer" else "ready")

    def count(self, text: str, role: str) -> int:
        """Lines of `role`'s log that contain `text`."""
        return sum(text in line for line in self.lines.get(_ROLE_FILES[role], []))

    def metric(self, name: str) -> list[float]:
        """Every value of `name` in the JSON log lines of the trainer's and the rollout worker's logs."""
        out = []
        for lines in self.lines.values():
            for line in lines:
                if '"tracker": "json_logger"' in line:  # `<time> INFO <logger name>: {JSON}`
                    try:
                        record = json.loads(line[line.index("{"):])
                    except ValueError:
                        continue
                    value = record.get("metrics", record).get(name)
                    if isinstance(value, (int, float)):
                        out.append(float(value))
        return out


def run_logs(log_dir: pathlib.Path, after: Optional[RunLogs] = None, until: Optional[dict] = None) -> RunLogs:
    """The lines of the role logs after those of `after` (the previous job's), up to line `until[file]`."""
    lines, offsets = {}, {}
    for name in _ROLE_FILES.values():
        path = log_dir / name
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        start = after.offsets.get(name, 0) if after is not None else 0
        end = until.get(name, len(text)) if until is not None else len(text)
        lines[name], offsets[name] = text[start:end], end
    return RunLogs(lines, offsets)


def newest_checkpoint(root: pathlib.Path, marker: str) -> Optional[int]:
    """The weight step of the newest committed checkpoint (Levanter's `step-N` holds step N + 1)."""
    steps = [int(p.name.split("-", 1)[1]) + 1 for p in root.glob("step-*") if (p / marker).exists()]
    return max(steps) if steps else None


def checkpoint_seconds(folder: pathlib.Path) -> Optional[float]:
    """How long the save took: the sidecar is written first, Levanter's metadata.json commits last."""
    first, last = folder / "marinrl.json", folder / "metadata.json"
    if not (first.exists() and last.exists()):
        return None
    return round(last.stat().st_mtime - first.stat().st_mtime, 2)


def _packed_leaves(path: pathlib.Path) -> list[dict]:
    """A packed file's leaves (name, dtype, shape, ...), from its header alone (MAGIC, length, JSON)."""
    with pathlib.Path(path).open("rb") as f:
        head = f.read(16)
        (length,) = struct.unpack("<Q", head[8:16])
        return json.loads(f.read(length)).get("leaves", [])


def _packed_float_dtypes(path: pathlib.Path) -> list[str]:
    return sorted({leaf["dtype"] for leaf in _packed_leaves(path) if "float" in leaf["dtype"]})


def packed_elements(path: pathlib.Path) -> int:
    """Elements of a packed snapshot's floating leaves: the model's parameter count."""
    total = 0
    for leaf in _packed_leaves(path):
        if "float" in leaf["dtype"]:
            n = 1
            for d in leaf["shape"]:
                n *= d
            total += n
    return total


def published_versions(root: pathlib.Path) -> list[dict]:
    """The weight versions left in the weights folder, oldest first: kind (snapshot | delta), bytes, and
    a snapshot's float dtypes."""
    out = []
    for folder in sorted(p for p in root.glob("step-*") if p.is_dir()):
        snapshot, delta = folder / "weights.bin", folder / "delta.bin"
        if snapshot.exists():
            out.append({"version": folder.name, "kind": "snapshot", "bytes": snapshot.stat().st_size,
                        "path": str(snapshot), "float_dtypes": _packed_float_dtypes(snapshot)})
        elif delta.exists():
            out.append({"version": folder.name, "kind": "delta", "bytes": delta.stat().st_size})
    return out


def process_stats(result: dict) -> dict[str, dict]:
    """The actors' `process` stats in a job's result (trainer; rollout: the first worker), where present."""
    out = {}
    trainer = (result.get("train") or {}).get("process")
    if trainer:
        out["trainer"] = trainer
    rollouts = [r.get("process") for r in result.get("rollouts") or [] if r.get("process")]
    if rollouts:
        out["rollout"] = rollouts[0]
    return out
