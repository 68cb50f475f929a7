"""The curriculum's config: lessons (an environment plus sampling settings), their dependency graph,
and the statistics' half-life (docs/curriculum.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Optional, Sequence

from marinrl.config.env import EnvConfig


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


def level_lessons(lesson: LessonConfig, levels: Sequence[Any], arg: str = "level") -> tuple[LessonConfig, ...]:
    """A chain of copies of `lesson` at rising difficulty: copy k sets the environment argument `arg` to
    `levels[k]` and is named `<lesson_id>-l<k>`; the first keeps the lesson's dependencies, each next one
    unlocks when the one before reaches its `graduate_at`. Once a level graduates it is no longer
    sampled, so training moves up a level as each graduates (docs/curriculum.md, "Levels")."""
    if not levels:
        raise ValueError(f"level_lessons: lesson {lesson.lesson_id!r} needs at least one level")
    if lesson.graduate_at is None and len(levels) > 1:
        raise ValueError(f"level_lessons: lesson {lesson.lesson_id!r} never graduates (graduate_at null), "
                         "so its next level would never unlock")
    out: list[LessonConfig] = []
    for k, level in enumerate(levels):
        env = EnvConfig(lesson.env.name, {**dict(lesson.env.args), arg: level})
        deps = lesson.dependencies if k == 0 else (LessonDependency(out[-1].lesson_id, lesson.graduate_at),)
        out.append(dataclasses.replace(lesson, lesson_id=f"{lesson.lesson_id}-l{k}", env=env, dependencies=deps))
    return tuple(out)


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
        encoded = json.dumps(dataclasses.asdict(self), sort_keys=True, default=repr).encode()
        return hashlib.sha256(encoded).hexdigest()[:16]


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
