"""What `marinrl report` reads from a run directory (`<run_root>/<run_id>/`, as RLJob writes it).

- `rollouts/`: the Parquet rollout files (read with `marinrl.storage.rollouts`): reward and response length per
  lesson and weight step.
- `tensorboard/trainer` and `tensorboard/rollout-N`: the tensorboardX event files of the trainer and of
  each rollout worker, read with a small TFRecord reader over tensorboardX's protobufs (no TensorFlow or
  TensorBoard needed).
- `logs/*.log`: Levanter's JSON logger lines (`levanter.json_logger ... {json}`), used for the trainer's
  metrics when no event file holds them. Only the trainer's JSON lines land there; the rollout workers'
  JSON loggers write to their own (Ray worker) logs, so the rollout workers' numbers come from
  TensorBoard.

Steps: the trainer logs Levanter's 0-based step of the update just taken; `load_run` numbers trainer
steps from 1 (step s publishes weight version s), as `TrainWorker.history` does. Rollout workers log at
the weight step they hold.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import struct
from collections import defaultdict
from typing import Iterable

Series = dict[int, float]
"""step -> value (the last value logged at that step wins, e.g. after a restart)."""

# ---------------------------------------------------------------------- tracker readers


def _records(data: bytes) -> Iterable[bytes]:
    """The records of one TFRecord file: u64 length, u32 crc, data, u32 crc. A truncated tail is skipped."""
    i = 0
    while i + 12 <= len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        if i + 12 + n + 4 > len(data):
            return  # a writer still appending
        yield data[i + 12:i + 12 + n]
        i += 12 + n + 4


def read_event_scalars(logdir: pathlib.Path) -> dict[str, Series]:
    """Every scalar in the event files under `logdir` (recursively), by tag."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[float, int, float]]] = defaultdict(list)
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        for record in _records(path.read_bytes()):
            event = Event()
            try:
                event.ParseFromString(record)
            except Exception:  # a corrupt record: skip it, keep the rest
                continue
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    out[value.tag].append((event.wall_time, event.step, float(value.simple_value)))
    series: dict[str, Series] = {}
    for tag, points in out.items():
        points.sort()
        series[tag] = {step: v for _, step, v in points}
    return series


def read_event_wall_times(logdir: pathlib.Path, tag: str) -> dict[int, float]:
    """step -> wall time (seconds since the epoch) at which `tag` was first logged at that step."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[int, float] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        for record in _records(path.read_bytes()):
            event = Event()
            try:
                event.ParseFromString(record)
            except Exception:
                continue
            if any(v.tag == tag for v in event.summary.value):
                out[event.step] = min(out.get(event.step, math.inf), event.wall_time)
    return out


_JSON_LINE = re.compile(r"levanter\.json_logger.*? :: (\{.*\})\s*$")


def read_json_logs(log_dir: pathlib.Path) -> dict[str, Series]:
    """Scalars from Levanter JSON logger lines (`"event": "log"`) in `log_dir/*.log`, by metric name."""
    series: dict[str, Series] = defaultdict(dict)
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _JSON_LINE.search(line)
            if not m:
                continue
            try:
                record = json.loads(m.group(1))
            except ValueError:
                continue
            if record.get("event") != "log" or "step" not in record:
                continue
            for key, value in record.get("metrics", {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    series[key][int(record["step"])] = float(value)
    return dict(series)


# ---------------------------------------------------------------------- rollout files


@dataclasses.dataclass
class LessonStats:
    rewards: dict[int, list[float]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    lengths: dict[int, list[int]] = dataclasses.field(default_factory=lambda: defaultdict(list))

    @property
    def n(self) -> int:
        return sum(len(v) for v in self.rewards.values())


def read_rollouts(root: str) -> tuple[dict[str, LessonStats], list[str]]:
    """Per lesson: rewards and response lengths by weight step; plus the files that could not be read."""
    from marinrl.storage.format import RolloutFormatError
    from marinrl.storage.rollouts import iter_batches

    lessons: dict[str, LessonStats] = defaultdict(LessonStats)
    unreadable = []
    for step, _path, batch in iter_batches(root):
        if isinstance(batch, RolloutFormatError):
            unreadable.append(str(batch))
            continue
        for r in batch.rollouts:
            lesson = lessons[r.lesson_id]
            lesson.rewards[step].append(r.episode_reward)
            lesson.lengths[step].append(int(r.response_tokens.size))
    return dict(sorted(lessons.items())), unreadable


# ---------------------------------------------------------------------- the report


@dataclasses.dataclass
class RunData:
    run_dir: pathlib.Path
    trainer: dict[str, Series]
    """Trainer metrics keyed by 1-based trainer step."""
    trainer_source: str
    workers: dict[str, dict[str, Series]]
    """Per rollout worker (`rollout-0`, ...): metrics keyed by weight step."""
    lessons: dict[str, LessonStats]
    unreadable: list[str]


RUN_PARTS = ("rollouts", "tensorboard", "logs", "checkpoints")
"""What a job writes under its run folder: a folder with none of them is not one (nothing is written into it)."""


def load_run(run_dir: str | pathlib.Path) -> RunData:
    run = pathlib.Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is not a directory")
    if not any((run / part).is_dir() for part in RUN_PARTS):
        runs = sorted(d.name for d in run.iterdir() if d.is_dir() and any((d / p).is_dir() for p in RUN_PARTS))
        hint = (f"; the runs in it: {', '.join(runs[:5])}{', …' if len(runs) > 5 else ''}" if runs
                else "; give <run_root>/<run_id>")
        raise FileNotFoundError(f"{run} is not a run folder (it has none of {', '.join(p + '/' for p in RUN_PARTS)})"
                                + hint)
    tb = run / "tensorboard"
    trainer, source = {}, "none"
    if (tb / "trainer").is_dir():
        trainer, source = read_event_scalars(tb / "trainer"), "TensorBoard event files (tensorboard/trainer)"
    if not trainer.get("train/step_s") and (run / "logs").is_dir():
        trainer, source = read_json_logs(run / "logs"), "Levanter JSON logs (logs/*.log)"
    trainer = {tag: {step + 1: v for step, v in s.items()} for tag, s in trainer.items()}  # 1-based steps
    workers = {}
    if tb.is_dir():
        for d in sorted(tb.glob("rollout-*")):
            if d.is_dir():
                workers[d.name] = read_event_scalars(d)
    rollout_root = run / "rollouts"
    lessons, unreadable = read_rollouts(str(rollout_root)) if rollout_root.is_dir() else ({}, [])
    return RunData(run, trainer, source, workers, lessons, unreadable)
