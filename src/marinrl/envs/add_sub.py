"""Two-operand integer arithmetic for a chat model: the real-model task of docs/real_model.md.

A question is `a + b` or `a - b` with a, b uniform in `low..high` (1..50) and the operator uniform, asked as
the user message `What is {a} {op} {b}? Answer with just the number.` through the tokenizer's chat template;
the reward is 1 when the last integer in the response equals the answer, else 0. Generation stops at the
tokenizer's EOS, which for a chat model is its end-of-turn token (SmolLM2's `<|im_end|>`).

Held out: `heldout_size` distinct questions drawn from `heldout_seed`, a generator no training draw uses.
Eval calls walk that list in order and wrap, so calls that ask for `heldout_size` questions in all (one call,
or `marinrl eval`'s batches) see each once, in the same order in every process; training draws come from the
caller's generator and skip the held-out questions.
"""

from __future__ import annotations

import re
import threading

import numpy as np

from marinrl.envs.base import Grade, Mode, Problem, SingleTurnEnv, register_env

QUESTION = "What is {a} {op} {b}? Answer with just the number."
HELDOUT_SEED = 40_000
"""The held-out questions' seed: the job's generators are seeded from its `seed` field, never from this."""

_INTEGER = re.compile(r"[-\u2212]?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (a leading `-` or `−` makes it negative), or None."""
    found = _INTEGER.findall(text)
    return None if not found else int(found[-1].replace("\u2212", "-"))


def grade_answer(response: str, answer: int) -> Grade:
    """1 when the last integer of `response` is `answer`. Indicators: `correct`, `no_integer`."""
    value = last_integer(response)
    ok = value == answer
    return Grade(float(ok), {"correct": float(ok), "no_integer": float(value is None)})


@register_env("add_sub")
class AddSubEnv(SingleTurnEnv):
    """`a ± b` asked through the chat template, graded by the last integer of the response (module docstring)."""

    env_name = "add_sub"

    def __init__(self, low: int = 1, high: int = 50, ops: str = "+-", heldout_size: int = 200,
                 heldout_seed: int = HELDOUT_SEED, chat: bool = True):
        if low > high:
            raise ValueError(f"add_sub: low ({low}) must be <= high ({high})")
        if not ops or set(ops) - set("+-"):
            raise ValueError(f"add_sub: ops must be made of '+' and '-', got {ops!r}")
        n_questions = (high - low + 1) ** 2 * len(set(ops))
        if not 1 <= heldout_size <= n_questions // 2:
            raise ValueError(f"add_sub: heldout_size must be in 1..{n_questions // 2} (half of the {n_questions} "
                             f"questions), got {heldout_size}")
        self.low, self.high, self.ops, self.chat = low, high, "".join(sorted(set(ops), key=ops.index)), chat
        self.heldout = self._draw_heldout(heldout_size, np.random.default_rng(heldout_seed))
        self._heldout_ids = set(self.heldout)
        self._cursor = 0
        self._lock = threading.Lock()

    def _draw(self, rng: np.random.Generator) -> tuple[int, str, int]:
        a, b = (int(x) for x in rng.integers(self.low, self.high + 1, size=2))
        return a, self.ops[int(rng.integers(len(self.ops)))], b

    def _draw_heldout(self, n: int, rng: np.random.Generator) -> list[tuple[int, str, int]]:
        out: dict[tuple[int, str, int], None] = {}
        while len(out) < n:
            out.setdefault(self._draw(rng))
        return list(out)

    def problem(self, a: int, op: str, b: int) -> Problem:
        return Problem(prompt=QUESTION.format(a=a, op=op, b=b), answer=str(a + b if op == "+" else a - b),
                       example_id=f"{a}{op}{b}")

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        if mode == "eval":
            with self._lock:
                start, self._cursor = self._cursor, (self._cursor + n) % len(self.heldout)
            return [self.problem(*self.heldout[(start + i) % len(self.heldout)]) for i in range(n)]
        out = []
        while len(out) < n:
            question = self._draw(rng)
            if question not in self._heldout_ids:
                out.append(self.problem(*question))
        return out

    def grade(self, problem: Problem, response: str) -> Grade:
        return grade_answer(response, int(problem.answer))
