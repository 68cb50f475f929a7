"""The trained-groups audit trail: which rollout groups each optimizer step trained, in the run folder,
written before that step's checkpoint commits, so that "was every group trained exactly once?" has an
answer after any crash, a SIGKILL included (docs/training.md, "The audit trail").

Each trainer process that runs (a fresh start or a resume) is one *trainer incarnation* with its own
folder; nothing is ever overwritten, so the steps a dead trainer took past its last checkpoint stay
visible as rolled back:

    <run_dir>/trained/<trainer>/start.json          {"trainer", "started_at", "first_step", "resumed_from", "parent"}
    <run_dir>/trained/<trainer>/step-00000001.json  {"step", "time", "groups": [[group_id, weight_step], ...]}

`parent` is the incarnation that wrote the checkpoint this one resumed from (the checkpoint's sidecar
names it), so the lineage of the final weights is a chain: the last incarnation's steps, then its
parent's steps up to the resume point, and so on back to step 1 (`lineage`). `audit` counts what that
lineage lost or trained twice. `python -m marinrl.train.audit <run_dir>` prints the counts as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import uuid
from typing import Optional

import fsspec

from marinrl.storage.fs import list_names, with_retries

START = "start.json"


def new_trainer_id() -> str:
    """A sortable, unique name for one trainer incarnation: its UTC start time and a random suffix."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def _step_name(step: int) -> str:
    return f"step-{step:08d}.json"


class AuditTrail:
    """One trainer incarnation's writer: `start` once the state is restored, `record` after every
    update and before that step's checkpoint (one small object per step: no append, any fsspec store)."""

    def __init__(self, root: str, trainer_id: str, storage_options: Optional[dict] = None):
        self.trainer_id = trainer_id
        self._fs, plain = fsspec.core.url_to_fs(root, **(storage_options or {}))
        self._dir = f"{plain.rstrip('/')}/{trainer_id}"

    def _put(self, name: str, record: dict) -> None:
        path, data = f"{self._dir}/{name}", json.dumps(record).encode()
        self._fs.makedirs(self._dir, exist_ok=True)
        with_retries(lambda: self._fs.pipe_file(path, data), "writing", path)

    def start(self, first_step: int, resumed_from: Optional[str], parent: Optional[str]) -> None:
        self._put(START, {"trainer": self.trainer_id, "started_at": time.time(), "first_step": int(first_step),
                          "resumed_from": resumed_from, "parent": parent})

    def record(self, step: int, groups: list[tuple[str, int]]) -> None:
        self._put(_step_name(step), {"step": int(step), "time": time.time(),
                                     "groups": [[str(g), int(w)] for g, w in groups]})


@dataclasses.dataclass
class Incarnation:
    start: dict
    """Its `start.json`."""
    steps: dict[int, dict]
    """Step -> its record, for every step it trained (past its last checkpoint included)."""


def read_trail(root: str, storage_options: Optional[dict] = None) -> dict[str, Incarnation]:
    """Every incarnation under `root` (`<run_dir>/trained`) by trainer id; {} if there is none. An
    incarnation killed before its `start.json` (it trained nothing) is left out."""
    fs, plain = fsspec.core.url_to_fs(root, **(storage_options or {}))
    plain = plain.rstrip("/")
    if not fs.exists(plain):
        return {}
    out = {}
    for trainer in sorted(list_names(fs, plain)):
        names = list_names(fs, f"{plain}/{trainer}")
        if START not in names:
            continue
        start = json.loads(fs.cat_file(f"{plain}/{trainer}/{START}"))
        steps = {}
        for name in names:
            if name.startswith("step-") and name.endswith(".json"):
                record = json.loads(fs.cat_file(f"{plain}/{trainer}/{name}"))
                steps[int(record["step"])] = record
        out[trainer] = Incarnation(start, steps)
    return out


@dataclasses.dataclass
class Lineage:
    steps: dict[int, dict]
    """Step -> the record of the incarnation whose update the final weights descend from."""
    chain: list[str]
    """The incarnations of the lineage, last first."""
    resumes: list[int]
    """The step each incarnation but the first resumed from (last first)."""
    rolled_back: list[dict]
    """Records of steps outside the lineage: taken past a checkpoint by a trainer that then died, or by
    an incarnation whose checkpoints no later one resumed from."""
    broken: Optional[str] = None
    """Why the chain could not be followed back to step 1 (a parent missing), or None."""


def lineage(trail: dict[str, Incarnation], last: Optional[str] = None) -> Lineage:
    """The chain of steps the final weights descend from, ending in incarnation `last` (default: the
    one that started last)."""
    if not trail:
        return Lineage({}, [], [], [])
    current: Optional[str] = last or max(trail, key=lambda t: (trail[t].start["started_at"], t))
    end = max(trail[current].steps, default=trail[current].start["first_step"])
    steps: dict[int, dict] = {}
    chain, resumes, broken = [], [], None
    used: set[tuple[str, int]] = set()
    while current is not None:
        if current not in trail or current in chain:
            broken = f"incarnation {current} is {'missing' if current not in trail else 'its own ancestor'}"
            break
        inc = trail[current]
        first = int(inc.start["first_step"])
        chain.append(current)
        for s in range(first + 1, end + 1):
            if s in inc.steps:
                steps[s] = inc.steps[s]
                used.add((current, s))
        if first == 0:
            break
        resumes.append(first)
        end, current = first, inc.start.get("parent")
        if current is None:
            broken = f"incarnation {chain[-1]} resumed from step {first} of a checkpoint that names no trainer"
    rolled_back = [r for t, inc in trail.items() for s, r in inc.steps.items() if (t, s) not in used]
    return Lineage(steps, chain, resumes, rolled_back, broken)


@dataclasses.dataclass
class AuditCounts:
    steps: int
    """Lineage steps with a record (of 1..num_steps)."""
    groups_trained: int
    """Group slots trained along the lineage (a duplicate counts each time)."""
    groups_duplicated: int
    """Lineage training of a group beyond its first (each group may be trained `max_uses` times)."""
    groups_lost: int
    """Slots of missing or short lineage steps, plus rolled-back groups the lineage skipped (see `audit`)."""
    missing_steps: list[int]
    max_stall_s: float
    """The longest wall-clock gap between consecutive trained steps of any incarnation (restarts
    included: what a user watching the run sees); 0 with fewer than two steps."""


def audit(trail: dict[str, Incarnation], *, num_steps: int, groups_per_step: int, max_staleness: int,
          max_uses: int = 1) -> AuditCounts:
    """Counts over `lineage(trail)`, steps 1..`num_steps`:

    - duplicated: trainings of a group id past `max_uses` along the lineage (rolled-back steps do not
      count: their updates were discarded with the weights, so training their groups again is right);
    - lost: `groups_per_step` for each step missing from the lineage and the shortfall of each short
      step; plus each group a rolled-back step trained, made with weights the lineage shares (weight
      step <= the resume point after it), that no lineage step trained although a lineage step took a
      strictly newer group while it was still fresh enough (weight step w <= s - 1 <= w + max_staleness
      for the update to weights s). With oldest-first sampling (on- and off-policy) the buffer takes
      such a group before any newer one, so it was gone from the resumed buffer: the resume lost it.
      A group merely left over (the newer ones taken had the same weight step) is not counted.
    """
    lin = lineage(trail)
    missing = [s for s in range(1, num_steps + 1) if s not in lin.steps]
    lost = groups_per_step * len(missing)
    uses: dict[str, int] = {}
    trained_at: dict[int, list[tuple[str, int]]] = {}
    for s in range(1, num_steps + 1):
        groups = [(g, int(w)) for g, w in lin.steps.get(s, {}).get("groups", [])]
        trained_at[s] = groups
        lost += max(0, groups_per_step - len(groups)) if s in lin.steps else 0
        for g, _ in groups:
            uses[g] = uses.get(g, 0) + 1
    duplicated = sum(max(0, n - max_uses) for n in uses.values())
    resume_points = sorted(lin.resumes)
    skipped: set[str] = set()
    for record in lin.rolled_back:
        later = [k for k in resume_points if k < record["step"]]
        if not later:  # a step before any resume point cannot have been rolled back by one
            continue
        resumed_at = later[-1]
        for g, w in record["groups"]:
            w = int(w)
            if g in uses or g in skipped or w > resumed_at:
                continue
            fresh = range(max(w, resumed_at) + 1, w + max_staleness + 2)  # updates s with w <= s - 1 <= w + staleness
            if any(nw > w for s in fresh for _, nw in trained_at.get(s, [])):
                skipped.add(g)
    lost += len(skipped)
    times = sorted(r["time"] for inc in trail.values() for r in inc.steps.values())
    stall = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    return AuditCounts(steps=num_steps - len(missing), groups_trained=sum(len(g) for g in trained_at.values()),
                       groups_duplicated=duplicated, groups_lost=lost, missing_steps=missing,
                       max_stall_s=round(stall, 2))


def main(argv: list[str]) -> int:
    """`python -m marinrl.train.audit RUN_DIR NUM_STEPS GROUPS_PER_STEP MAX_STALENESS [MAX_USES]`."""
    if len(argv) not in (4, 5):
        print(main.__doc__, file=sys.stderr)
        return 2
    run_dir, *numbers = argv
    num_steps, groups_per_step, max_staleness, *rest = (int(n) for n in numbers)
    counts = audit(read_trail(f"{run_dir.rstrip('/')}/trained"), num_steps=num_steps, groups_per_step=groups_per_step,
                   max_staleness=max_staleness, max_uses=rest[0] if rest else 1)
    print(json.dumps(dataclasses.asdict(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
