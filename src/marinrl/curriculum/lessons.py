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

`Curriculum` is pure (no Ray, no I/O); its config is `curriculum_config`. `curriculum_actor.CurriculumActor`
wraps it in a restartable Ray named actor whose state saves to and loads from an fsspec path as JSON;
`CurriculumClient` is a synchronous handle on it for the rollout manager, the rollout worker and the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal, Optional, Sequence

import numpy as np

from marinrl.config.curriculum import CurriculumConfig, LessonConfig

logger = logging.getLogger(__name__)

STATE_VERSION = 1
Status = Literal["locked", "active", "graduated"]
_STATUS_CODE = {"locked": 0.0, "active": 1.0, "graduated": 2.0}


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
        return sample_from_weights(self.weights(), rng)

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


def sample_from_weights(weights: dict[str, float], rng: np.random.Generator) -> str:
    """A lesson drawn with `weights` (`Curriculum.weights()`): the curriculum's draw, which a client holding
    a copy of the weights makes without a call (`curriculum.actor.CurriculumClient.sample_lesson`)."""
    ids = [i for i, p in weights.items() if p > 0]
    return str(ids[int(rng.choice(len(ids), p=np.array([weights[i] for i in ids]) / sum(weights[i] for i in ids)))])
