"""The curriculum: which lesson to train on next (docs/architecture.md, "The contracts").

A lesson is an environment plus sampling settings. Lessons form a dependency graph: a lesson is
*locked* until every prerequisite's performance reaches that dependency's threshold, then *active*
(sampled for training), and *graduated* once its performance has reached `graduate_at` and stopped
moving (a plateau). Unlocking and graduating are final.

Clock. The curriculum's clock is the trainer step: one optimizer step is one curriculum iteration,
whatever the number of generations per prompt, gradient accumulation or rollout workers. Rewards
arrive tagged with a step; each lesson keeps two decayed means (training rewards and evaluation
rewards) whose weights halve every `half_life` *steps*, so all rewards of one step count as one
step's estimate however many calls delivered them.

Performance of a lesson (for unlocking and graduation) is its evaluation mean once it has been
evaluated, its training mean before that. Its success for sampling is its training mean (the
success of the policy as it samples, which is what the group-relative loss learns from).

Sampling weights. A lesson with success p gets weight max(min_weight, 4·p·(1−p)): for 0/1 rewards
p·(1−p) is the expected within-group reward variance, i.e. how much signal a group-relative loss
gets from the lesson; lessons not yet tried get weight 1; `min_weight` keeps every active lesson
sampled. Weights are normalized over active lessons (over graduated ones once every lesson has
graduated). Rewards are assumed to lie in [0, 1]; p is clipped to it.

`Curriculum` is pure (no Ray, no I/O). `CurriculumActor` wraps it in a restartable Ray named actor
whose state saves to and loads from an fsspec path as JSON; `CurriculumClient` is a synchronous
handle on it for the rollout manager, the rollout worker and the trainer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import uuid
from typing import Any, Literal, Optional, Sequence

import fsspec
import numpy as np

from marinrl.envs.base import EnvConfig
from marinrl.inference.context import SamplingParams, stop_sequences

logger = logging.getLogger(__name__)

STATE_VERSION = 1
Status = Literal["locked", "active", "graduated"]
_STATUS_CODE = {"locked": 0.0, "active": 1.0, "graduated": 2.0}


@dataclasses.dataclass(frozen=True)
class LessonDependency:
    """`lesson_id` must reach `reward_threshold` (its performance) before the dependent unlocks."""

    lesson_id: str
    reward_threshold: float = 0.5


@dataclasses.dataclass(frozen=True)
class LessonConfig:
    """One lesson: an environment, how to sample it, what it needs first, and when it is done."""

    lesson_id: str
    env: EnvConfig
    dependencies: tuple[LessonDependency, ...] = ()
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    max_tokens: int = 32
    """Budget of new tokens per response."""
    stop: tuple[str, ...] = ()
    """Stop strings (EOS always stops)."""
    eval_temperature: float = 0.0
    """Sampling temperature of evaluations (0: greedy)."""
    graduate_at: Optional[float] = 0.9
    """Performance a plateau must be at to graduate the lesson; None: never graduates."""
    plateau_window: int = 20
    """Trainer steps over which performance must stay within `plateau_tolerance` to count as a plateau."""
    plateau_tolerance: float = 0.02

    def __post_init__(self):
        where = f"lesson {self.lesson_id!r}"
        if not isinstance(self.lesson_id, str) or not self.lesson_id:
            raise ValueError(f"LessonConfig.lesson_id must be a non-empty string, got {self.lesson_id!r}")
        if not isinstance(self.env, EnvConfig):
            raise ValueError(f"{where}: env must be an EnvConfig, got {type(self.env).__name__}")
        if self.temperature < 0 or self.eval_temperature < 0:
            raise ValueError(f"{where}: temperatures must be >= 0")
        if self.max_tokens < 1:
            raise ValueError(f"{where}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.plateau_window < 1:
            raise ValueError(f"{where}: plateau_window must be >= 1, got {self.plateau_window}")
        if self.plateau_tolerance < 0:
            raise ValueError(f"{where}: plateau_tolerance must be >= 0, got {self.plateau_tolerance}")
        if self.graduate_at is not None and not math.isfinite(self.graduate_at):
            raise ValueError(f"{where}: graduate_at must be finite or None, got {self.graduate_at}")
        for d in self.dependencies:
            if not isinstance(d, LessonDependency):
                raise ValueError(f"{where}: dependencies must be LessonDependency, got {type(d).__name__}")
            if not math.isfinite(d.reward_threshold):
                raise ValueError(f"{where}: dependency {d.lesson_id!r} has a non-finite reward_threshold")

    def sampling_params(self, tokenizer, mode: Literal["train", "eval"] = "train") -> SamplingParams:
        """`SamplingParams` of this lesson for training or evaluation (stop strings encoded by `tokenizer`)."""
        if mode not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        return SamplingParams(
            temperature=self.temperature if mode == "train" else self.eval_temperature,
            max_tokens=self.max_tokens,
            stop_sequences=stop_sequences(tokenizer, self.stop) if self.stop else (),
        )


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
    lessons: tuple[LessonConfig, ...]
    half_life: float = 10.0
    """Trainer steps after which a reward's weight in a lesson's means has halved."""
    min_weight: float = 0.1
    """Floor on an active lesson's sampling weight (the largest weight is 1)."""

    def __post_init__(self):
        if not self.lessons:
            raise ValueError("CurriculumConfig.lessons is empty")
        if not self.half_life > 0:
            raise ValueError(f"CurriculumConfig.half_life must be > 0, got {self.half_life}")
        if not 0 < self.min_weight <= 1:
            raise ValueError(f"CurriculumConfig.min_weight must be in (0, 1], got {self.min_weight}")
        ids = [lesson.lesson_id for lesson in self.lessons]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"CurriculumConfig: duplicate lesson ids {dup}")
        known = set(ids)
        for lesson in self.lessons:
            for d in lesson.dependencies:
                if d.lesson_id not in known:
                    raise ValueError(f"lesson {lesson.lesson_id!r} depends on unknown lesson {d.lesson_id!r}; "
                                     f"known: {sorted(known)}")
        cycle = _find_cycle({lesson.lesson_id: [d.lesson_id for d in lesson.dependencies] for lesson in self.lessons})
        if cycle:
            raise ValueError(f"lesson dependencies form a cycle: {' -> '.join(cycle)}")

    def lesson(self, lesson_id: str) -> LessonConfig:
        for lesson in self.lessons:
            if lesson.lesson_id == lesson_id:
                return lesson
        raise KeyError(f"unknown lesson {lesson_id!r}; known: {[x.lesson_id for x in self.lessons]}")

    def fingerprint(self) -> str:
        """Stable hash of the configuration (to tell whether an existing actor runs this config)."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _find_cycle(graph: dict[str, list[str]]) -> Optional[list[str]]:
    """A dependency cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


# ---------------------------------------------------------------------------------- statistics


@dataclasses.dataclass
class DecayedMean:
    """Mean of rewards whose weights halve every `half_life` trainer steps (all rewards of one step
    weigh the same, however many calls deliver them)."""

    mean: float = 0.0
    weight: float = 0.0
    last_step: int = -1
    count: int = 0
    """Rewards seen in total (not decayed)."""

    def add(self, rewards: Sequence[float], step: int, half_life: float) -> None:
        r = np.asarray(rewards, dtype=np.float64)
        if r.size == 0:
            return
        if self.weight > 0 and step > self.last_step:
            self.weight *= 0.5 ** ((step - self.last_step) / half_life)
        total = self.weight + r.size
        self.mean = (self.mean * self.weight + float(r.sum())) / total
        self.weight = total
        self.last_step = max(self.last_step, int(step))
        self.count += int(r.size)

    @property
    def seen(self) -> bool:
        return self.count > 0


@dataclasses.dataclass
class LessonState:
    status: Status = "locked"
    unlocked_at: Optional[int] = None
    graduated_at: Optional[int] = None
    train: DecayedMean = dataclasses.field(default_factory=DecayedMean)
    eval: DecayedMean = dataclasses.field(default_factory=DecayedMean)
    history: list[list[float]] = dataclasses.field(default_factory=list)
    """[step, performance] points, one per step, trimmed to the plateau window."""

    @property
    def performance(self) -> Optional[float]:
        if self.eval.seen:
            return self.eval.mean
        return self.train.mean if self.train.seen else None


# ---------------------------------------------------------------------------------- curriculum


class Curriculum:
    """Lessons, their dependency graph, statistics and sampling weights. Pure: no Ray, no I/O."""

    def __init__(self, config: CurriculumConfig):
        self.config = config
        self._lessons = {lesson.lesson_id: lesson for lesson in config.lessons}
        self._state = {lesson_id: LessonState() for lesson_id in self._lessons}
        self._step = 0
        self._refresh()

    # -------------------------------------------------------------- reading

    @property
    def step(self) -> int:
        """The trainer step the curriculum has reached."""
        return self._step

    @property
    def lesson_ids(self) -> list[str]:
        return list(self._lessons)

    def lesson(self, lesson_id: str) -> LessonConfig:
        self._check(lesson_id)
        return self._lessons[lesson_id]

    def status(self, lesson_id: str) -> Status:
        self._check(lesson_id)
        return self._state[lesson_id].status

    def performance(self, lesson_id: str) -> Optional[float]:
        """Evaluation mean once evaluated, else training mean; None before any reward."""
        self._check(lesson_id)
        return self._state[lesson_id].performance

    def weights(self) -> dict[str, float]:
        """Sampling probability of every lesson (0 for locked lessons and, while any lesson is active,
        for graduated ones). Sums to 1."""
        active = [i for i, s in self._state.items() if s.status == "active"]
        pool = active or [i for i, s in self._state.items() if s.status == "graduated"]
        raw = {i: self._raw_weight(i) for i in pool}
        total = sum(raw.values())
        return {i: raw.get(i, 0.0) / total for i in self._lessons}

    def _raw_weight(self, lesson_id: str) -> float:
        s = self._state[lesson_id]
        source = s.train if s.train.seen else s.eval
        if not source.seen:
            return 1.0
        p = min(max(source.mean, 0.0), 1.0)
        return max(self.config.min_weight, 4.0 * p * (1.0 - p))

    def sample_lesson(self, rng: np.random.Generator) -> str:
        """A lesson to train on, drawn with `weights()`."""
        w = self.weights()
        ids = [i for i, p in w.items() if p > 0]
        return str(ids[int(rng.choice(len(ids), p=np.array([w[i] for i in ids]) / sum(w[i] for i in ids)))])

    def metrics(self) -> dict[str, float]:
        """`curriculum/...` numbers for the tracker (status: 0 locked, 1 active, 2 graduated)."""
        w = self.weights()
        out = {
            "curriculum/step": float(self._step),
            "curriculum/active_lessons": float(sum(s.status == "active" for s in self._state.values())),
            "curriculum/graduated_lessons": float(sum(s.status == "graduated" for s in self._state.values())),
        }
        for i, s in self._state.items():
            p = f"curriculum/{i}/"
            out[p + "weight"] = w[i]
            out[p + "status"] = _STATUS_CODE[s.status]
            if s.train.seen:
                out[p + "train_reward"] = s.train.mean
            if s.eval.seen:
                out[p + "eval_reward"] = s.eval.mean
            out[p + "train_samples"] = float(s.train.count)
        return out

    # -------------------------------------------------------------- updating

    def update_from_training(self, lesson_id: str, rewards: Sequence[float], step: int) -> None:
        """Rewards of training rollouts of `lesson_id` used at trainer step `step`."""
        self._update(lesson_id, rewards, step, "train")

    def update_from_eval(self, lesson_id: str, rewards: Sequence[float], step: int) -> None:
        """Rewards of a full evaluation of `lesson_id` at trainer step `step`."""
        self._update(lesson_id, rewards, step, "eval")

    def set_step(self, step: int) -> None:
        """The trainer reached `step` (a restarted trainer may report a lower one: it is believed)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self._step = int(step)
        self._refresh()

    def _update(self, lesson_id: str, rewards: Sequence[float], step: int, kind: str) -> None:
        self._check(lesson_id)
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        r = np.asarray(list(rewards), dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(r)):
            raise ValueError(f"lesson {lesson_id!r}: rewards must be finite, got {r[~np.isfinite(r)][:3]}")
        if r.size == 0:
            return
        s = self._state[lesson_id]
        getattr(s, kind).add(r, int(step), self.config.half_life)
        self._step = max(self._step, int(step))
        self._record(lesson_id)
        self._refresh()

    def _record(self, lesson_id: str) -> None:
        s = self._state[lesson_id]
        perf = s.performance
        if perf is None:
            return
        if s.history and s.history[-1][0] == self._step:
            s.history[-1][1] = perf
        else:
            s.history.append([self._step, perf])
        # keep the newest point at or before the window's start (it carries into the window), and all after
        window_start = self._step - self._lessons[lesson_id].plateau_window
        older = [k for k, (st, _) in enumerate(s.history) if st <= window_start]
        if older:
            del s.history[: older[-1]]

    def _plateaued(self, lesson_id: str) -> bool:
        s, lesson = self._state[lesson_id], self._lessons[lesson_id]
        window_start = self._step - lesson.plateau_window
        if not s.history or s.history[0][0] > window_start:
            return False  # the history does not cover a whole window yet
        values = [v for _, v in s.history]
        return max(values) - min(values) <= lesson.plateau_tolerance

    def _refresh(self) -> None:
        """Unlock lessons whose prerequisites are met, graduate those on a plateau at `graduate_at`."""
        changed = True
        while changed:
            changed = False
            for lesson_id, lesson in self._lessons.items():
                s = self._state[lesson_id]
                if s.status == "locked" and all(
                    self._state[d.lesson_id].performance is not None
                    and self._state[d.lesson_id].status != "locked"
                    and self._state[d.lesson_id].performance >= d.reward_threshold
                    for d in lesson.dependencies
                ):
                    s.status, s.unlocked_at, changed = "active", self._step, True
                    logger.info("curriculum: lesson %r unlocked at step %d", lesson_id, self._step)
                if (s.status == "active" and lesson.graduate_at is not None and s.performance is not None
                        and s.performance >= lesson.graduate_at and self._plateaued(lesson_id)):
                    s.status, s.graduated_at, changed = "graduated", self._step, True
                    logger.info("curriculum: lesson %r graduated at step %d (performance %.3f)",
                                lesson_id, self._step, s.performance)

    def _check(self, lesson_id: str) -> None:
        if lesson_id not in self._lessons:
            raise KeyError(f"unknown lesson {lesson_id!r}; known: {list(self._lessons)}")

    # -------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state (statistics, statuses, clock), not the configuration."""
        return {
            "version": STATE_VERSION,
            "step": self._step,
            "config_fingerprint": self.config.fingerprint(),
            "lessons": {i: dataclasses.asdict(s) for i, s in self._state.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`. Lessons the state does not know start fresh; lessons the
        configuration no longer has are ignored with a warning."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"curriculum state: expected version {STATE_VERSION}, "
                             f"got {state.get('version') if isinstance(state, dict) else type(state).__name__}")
        try:
            lessons = state["lessons"]
            fresh = {i: LessonState() for i in self._lessons}
            for i, s in lessons.items():
                if i not in self._lessons:
                    logger.warning("curriculum state: lesson %r is not in the configuration; ignored", i)
                    continue
                if s["status"] not in _STATUS_CODE:
                    raise ValueError(f"lesson {i!r}: unknown status {s['status']!r}")
                fresh[i] = LessonState(
                    status=s["status"], unlocked_at=s["unlocked_at"], graduated_at=s["graduated_at"],
                    train=DecayedMean(**s["train"]), eval=DecayedMean(**s["eval"]),
                    history=[[int(a), float(b)] for a, b in s["history"]],
                )
            step = int(state["step"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"curriculum state is malformed: {type(e).__name__}: {e}") from e
        self._state, self._step = fresh, step
        self._refresh()


# ---------------------------------------------------------------------------------- persistence

_ATOMIC_PUT = {"gs", "gcs", "s3", "s3a", "memory", "az", "abfs", "abfss"}


def save_state(state: dict[str, Any], path: str, storage_options: Optional[dict] = None) -> None:
    """Write `state` as JSON at `path` (any fsspec URL) atomically: object stores put one object,
    local disks write a temporary file and rename it, so a reader sees the old file or the new one."""
    data = json.dumps(state, allow_nan=False, sort_keys=True).encode()
    fs, plain = fsspec.core.url_to_fs(path, **(storage_options or {}))
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    parent = plain.rsplit("/", 1)[0] if "/" in plain else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if protocols & _ATOMIC_PUT:
        fs.pipe_file(plain, data)
        return
    tmp = f"{plain}.tmp-{uuid.uuid4().hex}"
    fs.pipe_file(tmp, data)
    if "file" in protocols or "local" in protocols:
        os.replace(tmp, plain)
    else:
        fs.mv(tmp, plain)


def load_state(path: str, storage_options: Optional[dict] = None) -> Optional[dict[str, Any]]:
    """The JSON state at `path`, or None if there is none. A file that is not JSON is a ValueError."""
    fs, plain = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if not fs.exists(plain):
        return None
    raw = fs.cat_file(plain)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"curriculum state {path} is not JSON: {e}") from e


# ---------------------------------------------------------------------------------- Ray actor


class CurriculumActor:
    """A `Curriculum` in a Ray named actor (create it with `curriculum_actor`).

    On (re)start it loads `state_path` if the file exists, so an actor Ray restarts after a crash
    resumes from the last saved state. It saves to `state_path` on `save()` and, if `save_every` > 0,
    whenever the clock has moved `save_every` steps past the last save."""

    def __init__(self, config: CurriculumConfig, state_path: Optional[str] = None, save_every: int = 0,
                 storage_options: Optional[dict] = None):
        self._curriculum = Curriculum(config)
        self._state_path = state_path
        self._save_every = save_every
        self._storage_options = storage_options
        self._saved_step = 0
        self._incarnation = uuid.uuid4().hex
        if state_path:
            state = load_state(state_path, storage_options)
            if state is not None:
                self._curriculum.load_state_dict(state)
                self._saved_step = self._curriculum.step
                logger.info("curriculum actor resumed from %s at step %d", state_path, self._curriculum.step)

    def config_fingerprint(self) -> str:
        return self._curriculum.config.fingerprint()

    def incarnation(self) -> str:
        """A new id every time the actor (re)starts: tells a caller that Ray restarted it."""
        return self._incarnation

    def lesson_ids(self) -> list[str]:
        return self._curriculum.lesson_ids

    def lesson(self, lesson_id: str) -> LessonConfig:
        return self._curriculum.lesson(lesson_id)

    def status(self, lesson_id: str) -> str:
        return self._curriculum.status(lesson_id)

    def sample_lesson(self, seed: int) -> str:
        return self._curriculum.sample_lesson(np.random.default_rng(seed))

    def weights(self) -> dict[str, float]:
        return self._curriculum.weights()

    def metrics(self) -> dict[str, float]:
        return self._curriculum.metrics()

    def step(self) -> int:
        return self._curriculum.step

    def update_from_training(self, lesson_id: str, rewards: list[float], step: int) -> None:
        self._curriculum.update_from_training(lesson_id, rewards, step)
        self._maybe_save()

    def update_from_eval(self, lesson_id: str, rewards: list[float], step: int) -> None:
        self._curriculum.update_from_eval(lesson_id, rewards, step)
        self._maybe_save()

    def set_step(self, step: int) -> None:
        self._curriculum.set_step(step)
        self._maybe_save()

    def state_dict(self) -> dict[str, Any]:
        return self._curriculum.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._curriculum.load_state_dict(state)

    def save(self, path: Optional[str] = None) -> str:
        """Write the state to `path` (default: `state_path`); returns where it went."""
        target = path or self._state_path
        if not target:
            raise ValueError("CurriculumActor.save: no path given and the actor has no state_path")
        save_state(self._curriculum.state_dict(), target, self._storage_options)
        if target == self._state_path:
            self._saved_step = self._curriculum.step
        return target

    def load(self, path: str) -> None:
        """Restore the state saved at `path` (FileNotFoundError if there is none)."""
        state = load_state(path, self._storage_options)
        if state is None:
            raise FileNotFoundError(f"no curriculum state at {path}")
        self._curriculum.load_state_dict(state)

    def _maybe_save(self) -> None:
        if self._state_path and self._save_every > 0 and self._curriculum.step - self._saved_step >= self._save_every:
            self.save()


def curriculum_actor(
    config: CurriculumConfig,
    *,
    name: str = "curriculum",
    namespace: str = "marinrl",
    state_path: Optional[str] = None,
    save_every: int = 0,
    storage_options: Optional[dict] = None,
    max_restarts: int = 10,
    detached: bool = False,
):
    """Get the curriculum actor `name` in `namespace`, creating it if it does not exist (Ray must be
    initialized). Ray restarts it up to `max_restarts` times after a crash, and retries calls that
    were in flight. An existing actor running another configuration is a ValueError."""
    import ray

    actor_cls = ray.remote(CurriculumActor)
    handle = actor_cls.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        max_restarts=max_restarts,
        max_task_retries=3,
        lifetime="detached" if detached else None,
        num_cpus=0,
    ).remote(config, state_path, save_every, storage_options)
    theirs = ray.get(handle.config_fingerprint.remote())
    if theirs != config.fingerprint():
        raise ValueError(f"curriculum actor {namespace}/{name} already exists with another configuration "
                         f"(fingerprint {theirs}, this one {config.fingerprint()}); kill it or choose another name")
    return handle


class CurriculumClient:
    """Synchronous calls on a curriculum actor: what the RolloutManager (`update_from_training`,
    `update_from_eval`), the RolloutWorker (`sample_lesson(seed)`) and the TrainWorker (`set_step`,
    `save`, `load`) need."""

    def __init__(self, handle):
        self.handle = handle

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.handle, method).remote(*args))

    def sample_lesson(self, seed: int) -> str:
        return self._call("sample_lesson", seed)

    def update_from_training(self, lesson_id: str, rewards: Sequence[float], step: int) -> None:
        self._call("update_from_training", lesson_id, [float(r) for r in rewards], int(step))

    def update_from_eval(self, lesson_id: str, rewards: Sequence[float], step: int) -> None:
        self._call("update_from_eval", lesson_id, [float(r) for r in rewards], int(step))

    def set_step(self, step: int) -> None:
        self._call("set_step", int(step))

    def save(self, path: Optional[str] = None) -> str:
        return self._call("save", path)

    def load(self, path: str) -> None:
        self._call("load", path)

    def weights(self) -> dict[str, float]:
        return self._call("weights")

    def metrics(self) -> dict[str, float]:
        return self._call("metrics")

    def status(self, lesson_id: str) -> str:
        return self._call("status", lesson_id)

    def lesson(self, lesson_id: str) -> LessonConfig:
        return self._call("lesson", lesson_id)

    def lesson_ids(self) -> list[str]:
        return self._call("lesson_ids")

    def step(self) -> int:
        return self._call("step")

    def incarnation(self) -> str:
        return self._call("incarnation")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)
