"""reasoning-gym's procedural tasks as a single-turn environment (docs/environments.md, "reasoning-gym").

    env: {name: reasoning_gym, args: {task: basic_arithmetic, config: {min_terms: 2, max_terms: 3}}}
    env: {name: reasoning_gym, args: {tasks: [{task: chain_sum, weight: 2}, {task: countdown, level: 1}]}}

Prompts come from the task's generator (`reasoning_gym.create_dataset`), an item being a pure function
of (dataset seed, index): the lesson's `rng` picks the indices, so a run is reproducible. Eval items are
a fixed set (`eval_size` items of a dataset seeded apart from training); a training item whose question
is in that set is drawn again, so training never sees an eval question. The reward is the task's own
`score_answer(answer, entry)` on the answer the response gives (`<answer>…</answer>`, reasoning-gym's
convention and its `extract_answer`, or the whole response with `answer_format: raw`).

Difficulty: `level` sets every knob of the task's reasoning-gym curriculum (its `RangeAttributeDefinition`s:
number of terms, digits, ...) to that level (clamped to each knob's last level), or one level per knob
(`level: {num_terms: 2}`); `config` sets the rest. A chain of lessons at rising levels, each unlocked
when the one below reaches its graduation threshold (`config.curriculum.level_lessons`), raises the
knobs as the lessons graduate.

reasoning_gym is imported when such an environment is built, never when marinrl is imported (it is the
optional extra `marinrl[reasoning_gym]`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from marinrl.envs.base import Grade, Mode, Problem, SingleTurnEnv, encode_prompt, optional_package, register_env
from marinrl.inference.context import chat_prompt_tokens

EVAL_SEED_OFFSET = 1_000_003
"""The eval datasets' seed is the training seed plus this (a different stream of items)."""
MAX_REDRAWS = 64
"""Training draws per item before giving up on finding a question outside the eval set."""


def import_reasoning_gym():
    """The reasoning_gym package, or an error that says how to install it."""
    return optional_package("reasoning_gym", "reasoning_gym", "reasoning-gym", "reasoning_gym")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One reasoning-gym task of a lesson (a lesson mixes one or more, by weight)."""

    task: str
    """A reasoning-gym dataset name (`basic_arithmetic`, `countdown`, `propositional_logic`, ...)."""
    weight: float = 1.0
    """Relative share of this task's prompts in a mix."""
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Fields of the task's config dataclass (`min_terms`, `max_digits`, ...); `seed` and `size` are ours."""
    level: Union[None, int, Mapping[str, int]] = None
    """Curriculum level of every difficulty knob, or {knob: level}; None: the config as given."""


@dataclasses.dataclass(frozen=True)
class GymProblem(Problem):
    """A problem with the reasoning-gym entry its task scores against."""

    task_index: int = 0
    """Which of the lesson's tasks made it."""
    split: str = "train"
    entry: Any = dataclasses.field(default=None, compare=False, repr=False)


def task_config(task: TaskSpec, seed: int, size: int) -> Any:
    """The task's config dataclass for `seed` and `size`, with its curriculum knobs at `task.level`.
    Errors name the task and the field."""
    import_reasoning_gym()
    from reasoning_gym.factory import CURRICULA, DATASETS, create_curriculum

    if task.task not in DATASETS:
        raise ValueError(f"reasoning_gym: unknown task {task.task!r}; tasks: {sorted(DATASETS)}")
    _, config_cls = DATASETS[task.task]
    for reserved in ("seed", "size"):
        if reserved in task.config:
            raise ValueError(f"reasoning_gym: task {task.task!r}: config.{reserved} is set by the environment "
                             f"(use the env's `seed`, `train_size`, `eval_size`)")
    args = {**dict(task.config), "seed": seed, "size": size}
    if task.level is not None:
        if task.task not in CURRICULA:
            raise ValueError(f"reasoning_gym: task {task.task!r} has no curriculum, so no `level`")
        curriculum = create_curriculum(task.task)
        levels = task.level if isinstance(task.level, Mapping) else {k: task.level for k in curriculum.attributes}
        unknown = sorted(set(levels) - set(curriculum.attributes))
        if unknown:
            raise ValueError(f"reasoning_gym: task {task.task!r} has no difficulty knob {unknown}; "
                             f"knobs: {sorted(curriculum.attributes)}")
        for name, level in levels.items():
            if isinstance(level, bool) or not isinstance(level, int) or level < 0:
                raise ValueError(f"reasoning_gym: task {task.task!r}: level of {name!r} must be an int >= 0, "
                                 f"got {level!r}")
            curriculum.set_attr_level(name, min(level, len(curriculum.attributes[name].levels) - 1))
        config = curriculum.generate_configuration(defaults=args)
    else:
        try:
            config = config_cls(**args)
        except TypeError as e:
            fields = sorted(f.name for f in dataclasses.fields(config_cls))
            raise ValueError(f"reasoning_gym: task {task.task!r}: bad config {dict(task.config)!r} ({e}); "
                             f"fields: {fields}") from e
    try:
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError) as e:
        raise ValueError(f"reasoning_gym: task {task.task!r}: invalid config {dict(task.config)!r}: {e}") from e
    return config


def _task_specs(task: Optional[str], config: Optional[Mapping], level, tasks: Optional[Sequence]) -> list[TaskSpec]:
    if (task is None) == (tasks is None):
        raise ValueError("reasoning_gym: give `task` (one task, with `config` and `level`) or `tasks` (a weighted "
                         "mix: a list of {task, weight, config, level}), not both or neither")
    if task is not None:
        return [TaskSpec(task, 1.0, dict(config or {}), level)]
    if config is not None or level is not None:
        raise ValueError("reasoning_gym: with `tasks`, give config and level inside each task")
    specs = []
    for i, t in enumerate(tasks):
        if not isinstance(t, Mapping) or "task" not in t:
            raise ValueError(f"reasoning_gym: tasks[{i}] must be a mapping with a `task`, got {t!r}")
        unknown = set(t) - {f.name for f in dataclasses.fields(TaskSpec)}
        if unknown:
            raise ValueError(f"reasoning_gym: tasks[{i}] has unknown keys {sorted(unknown)}")
        spec = TaskSpec(**{**t, "config": dict(t.get("config") or {})})
        if not (isinstance(spec.weight, (int, float)) and spec.weight > 0):
            raise ValueError(f"reasoning_gym: tasks[{i}].weight must be > 0, got {spec.weight!r}")
        specs.append(spec)
    names = [s.task for s in specs]
    if not specs or len(set(names)) != len(names):
        raise ValueError(f"reasoning_gym: tasks must be non-empty without repeats, got {names}")
    return specs


@register_env("reasoning_gym")
class ReasoningGymEnv(SingleTurnEnv):
    """reasoning-gym tasks (module docstring). Indicators: `correct` (score 1), `extraction_failed`
    (no `<answer>` tag in the response)."""

    env_name = "reasoning_gym"

    def __init__(self, task: Optional[str] = None, config: Optional[Mapping[str, Any]] = None,
                 level: Union[None, int, Mapping[str, int]] = None, tasks: Optional[Sequence[Mapping]] = None,
                 seed: int = 0, train_size: int = 1_000_000, eval_size: int = 256, chat: bool = True,
                 system_prompt: Optional[str] = "default", answer_format: str = "tag"):
        if answer_format not in ("tag", "raw"):
            raise ValueError(f"reasoning_gym: answer_format must be 'tag' or 'raw', got {answer_format!r}")
        if train_size < 1 or eval_size < 1:
            raise ValueError(f"reasoning_gym: train_size and eval_size must be >= 1, got {train_size}, {eval_size}")
        import_reasoning_gym()
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.specs = _task_specs(task, config, level, tasks)
        self.weights = np.array([s.weight for s in self.specs], dtype=np.float64)
        self.weights /= self.weights.sum()
        self.train, self.eval = [], []
        for i, spec in enumerate(self.specs):
            train_config = task_config(spec, seed + i, train_size)  # validates the task's name and config
            dataset_cls = DATASETS[spec.task][0]
            self.train.append(dataset_cls(config=train_config))
            self.eval.append(dataset_cls(config=task_config(spec, seed + i + EVAL_SEED_OFFSET, eval_size)))
        self.system_prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt else None
        self.chat = chat
        self.answer_format = answer_format
        self._eval_questions: Optional[list[set[str]]] = None

    def eval_questions(self, k: int) -> set[str]:
        """The questions of task k's eval set (generated once)."""
        if self._eval_questions is None:
            self._eval_questions = [{d[i]["question"] for i in range(len(d))} for d in self.eval]
        return self._eval_questions[k]

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        out = []
        for k in rng.choice(len(self.specs), size=n, p=self.weights):
            k = int(k)
            if mode == "eval":
                index = int(rng.integers(0, len(self.eval[k])))
                entry = self.eval[k][index]
                out.append(self._problem(k, entry, "eval", index))
                continue
            held_out = self.eval_questions(k)
            for _ in range(MAX_REDRAWS):
                index = int(rng.integers(0, len(self.train[k])))
                entry = self.train[k][index]
                if entry["question"] not in held_out:
                    break
            else:
                raise RuntimeError(f"reasoning_gym: task {self.specs[k].task!r}: {MAX_REDRAWS} training draws in a "
                                   "row were eval questions; the task has too few distinct items for eval_size "
                                   f"{len(self.eval[k])}")
            out.append(self._problem(k, entry, "train", index))
        return out

    def _problem(self, k: int, entry: Mapping[str, Any], split: str, index: int) -> GymProblem:
        example = f"{self.specs[k].task}:{'eval' if split == 'eval' else ''}{index}"
        return GymProblem(prompt=entry["question"], answer=str(entry["answer"]), example_id=example,
                          task_index=k, split=split, entry=entry)

    def encode(self, tokenizer, problem: Problem) -> list[int]:
        if self.chat:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return chat_prompt_tokens(tokenizer, system + [{"role": "user", "content": problem.prompt}])
        text = f"{self.system_prompt}\n\n{problem.prompt}" if self.system_prompt else problem.prompt
        return encode_prompt(tokenizer, text, chat=False)

    def extract(self, response: str) -> Optional[str]:
        if self.answer_format == "raw":
            return response.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(response)

    def grade(self, problem: Problem, response: str) -> Grade:
        answer = self.extract(response)
        dataset = (self.eval if problem.split == "eval" else self.train)[problem.task_index]
        score = float(dataset.score_answer(answer, problem.entry))
        return Grade(reward=score, indicators={"correct": float(score >= 1.0),
                                               "extraction_failed": float(answer is None)})
