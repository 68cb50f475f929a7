"""Math with verifiable answers: generated arithmetic (a difficulty knob) and word problems from a
GSM8K-style JSONL file, a Parquet file, a folder of either, or a local Hugging Face `datasets` folder.

Grading is `math-verify`'s: the final answer is extracted from the response (`\\boxed{}` first,
then LaTeX, then a plain expression such as the last number) and compared symbolically with the
gold answer, so `1,234`, `1234.0` and `\\boxed{1234}` all match `1234`. A response with no answer
to extract scores 0 and is counted (`extraction_failed_count`).

math-verify bounds its parsing time with `signal.alarm`, which only works on the main thread; off
the main thread (a rollout worker's thread) grading runs without that bound, on at most the last
`MAX_GRADED_CHARS` characters of the response.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Optional, Sequence

import fsspec
import numpy as np
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from marinrl.data import data_path
from marinrl.envs.base import Grade, Mode, Problem, SingleTurnEnv, register_env

logger = logging.getLogger(__name__)

INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."
MAX_GRADED_CHARS = 4000
TIMEOUT_SECONDS = 5
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def _timeout() -> Optional[int]:
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def parse_answer(text: str) -> list:
    """math-verify's parse of the final answer in `text` (an empty list when there is none)."""
    return parse(text[-MAX_GRADED_CHARS:], list(_EXTRACTION), parsing_timeout=_timeout())


def parse_gold(answer: str) -> list:
    """Parse a gold answer (`72`, `1,234`, `\\frac{1}{2}`, `x+1`); ValueError if nothing parses."""
    parsed = parse(f"\\boxed{{{answer}}}", list(_EXTRACTION), parsing_timeout=_timeout())
    if not parsed:
        raise ValueError(f"gold answer {answer!r} cannot be parsed")
    return parsed


def grade_math(response: str, gold: list) -> Grade:
    """1 if the answer extracted from `response` equals the parsed `gold`, else 0. Indicators:
    `correct`, and `extraction_failed` when the response holds no answer at all."""
    pred = parse_answer(response)
    if not pred:
        return Grade(0.0, {"correct": 0.0, "extraction_failed": 1.0})
    ok = bool(verify(gold, pred, timeout_seconds=_timeout()))
    return Grade(float(ok), {"correct": float(ok), "extraction_failed": 0.0})


def final_answer(answer_field: str) -> str:
    """The final answer of a GSM8K answer field (the text after the last `####`), or the whole field."""
    text = answer_field.rsplit("####", 1)[-1] if "####" in answer_field else answer_field
    return text.strip()


class _MathEnv(SingleTurnEnv):
    """Shared grading with a cache of parsed gold answers."""

    def __init__(self, chat: bool, instruction: str):
        self.chat = chat
        self.instruction = instruction
        self._gold: dict[str, list] = {}

    def _prompt(self, question: str) -> str:
        return f"{question}\n{self.instruction}" if self.instruction else question

    def grade(self, problem: Problem, response: str) -> Grade:
        gold = self._gold.get(problem.answer)
        if gold is None:
            gold = self._gold[problem.answer] = parse_gold(problem.answer)
        return grade_math(response, gold)


# ------------------------------------------------------------------------------- arithmetic


def arithmetic_problem(difficulty: int, rng: np.random.Generator) -> tuple[str, int]:
    """An integer expression and its value. Difficulty 1: `a + b` with digits; 2: `a ± b` below 100;
    3: three terms with `+ - *`; 4 and up: `difficulty` terms (at most 6) below 1000 with parentheses.
    A `*` always has a one-digit right operand, so values stay readable."""
    if difficulty < 1:
        raise ValueError(f"arithmetic: difficulty must be >= 1, got {difficulty}")
    n_terms = 2 if difficulty <= 2 else min(difficulty, 6)
    high = 10 if difficulty == 1 else 100 if difficulty <= 3 else 1000
    ops = "+" if difficulty == 1 else "+-" if difficulty == 2 else "+-*"
    items: list[Any] = [int(rng.integers(0, high))]
    for _ in range(n_terms - 1):
        op = ops[int(rng.integers(len(ops)))]
        items += [op, int(rng.integers(2, 10)) if op == "*" else int(rng.integers(0, high))]
    if difficulty >= 4:  # parenthesize a run of 2..n-1 terms
        k = int(rng.integers(2, n_terms))
        start = int(rng.integers(0, n_terms - k + 1))
        items = items[: 2 * start] + [items[2 * start: 2 * (start + k) - 1]] + items[2 * (start + k) - 1:]
    return _render(items), _evaluate(items)


def _render(items: list) -> str:
    return " ".join(f"({_render(x)})" if isinstance(x, list) else str(x) for x in items)


def _evaluate(items: list) -> int:
    """Value of [term, op, term, ...] (a term may be a nested list) with `*` before `+ -`."""
    values = [_evaluate(x) if isinstance(x, list) else x for x in items[0::2]]
    sums, ops = [values[0]], []
    for op, v in zip(items[1::2], values[1:]):
        if op == "*":
            sums[-1] *= v
        else:
            sums.append(v)
            ops.append(op)
    total = sums[0]
    for op, v in zip(ops, sums[1:]):
        total = total + v if op == "+" else total - v
    return total


@register_env("arithmetic")
class ArithmeticEnv(_MathEnv):
    """Generated integer arithmetic ("What is 37 - 5 * 4?"), graded by math-verify.
    Knob: `difficulty` (1..; see `arithmetic_problem`)."""

    env_name = "arithmetic"

    def __init__(self, difficulty: int = 1, chat: bool = True, instruction: str = INSTRUCTION):
        if difficulty < 1:
            raise ValueError(f"arithmetic: difficulty must be >= 1, got {difficulty}")
        super().__init__(chat, instruction)
        self.difficulty = difficulty

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        out = []
        for _ in range(n):
            expr, value = arithmetic_problem(self.difficulty, rng)
            out.append(Problem(prompt=self._prompt(f"What is {expr}?"), answer=str(value),
                               example_id=expr.replace(" ", "")))
        return out


# ------------------------------------------------------------------------------- datasets


def load_math_problems(path: str, question_field: str = "question", answer_field: str = "answer") -> list[Problem]:
    """Problems from a JSONL/JSON-lines file, a Parquet file, a folder of such files, or a folder written
    by `datasets.Dataset.save_to_disk` (local). Each answer field may be GSM8K-style (`... #### 72`) or a
    bare final answer. Every gold answer is parsed here: a row without a gradable answer is a ValueError
    naming the file and row."""
    fs, plain = fsspec.core.url_to_fs(path)
    if not fs.exists(plain):
        raise FileNotFoundError(f"math dataset not found: {path}")
    if fs.isdir(plain):
        names = set(os.path.basename(p) for p in fs.ls(plain, detail=False))
        if names & {"dataset_info.json", "state.json", "dataset_dict.json"}:
            sources = [(path, _hf_rows(path))]
        else:
            files = sorted(p for p in fs.ls(plain, detail=False) if p.endswith((".jsonl", ".json", ".parquet")))
            if not files:
                raise ValueError(f"math dataset folder {path} holds no .jsonl, .json or .parquet file "
                                 "and is not a `datasets` save_to_disk folder")
            sources = [(f, _file_rows(fs, f)) for f in files]
    else:
        sources = [(path, _file_rows(fs, plain))]
    problems = []
    for source, rows in sources:
        name = os.path.basename(source.rstrip("/"))
        for i, row in enumerate(rows):
            where = f"{source}: row {i}"
            for field in (question_field, answer_field):
                if field not in row:
                    raise ValueError(f"{where}: no field {field!r} (fields: {sorted(row)})")
            question, answer = row[question_field], row[answer_field]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: {question_field!r} must be a non-empty string, got {question!r}")
            if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
                raise ValueError(f"{where}: {answer_field!r} must be a string or a number, got {answer!r}")
            gold = final_answer(str(answer))
            try:
                parse_gold(gold)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            problems.append(Problem(prompt=question.strip(), answer=gold, example_id=f"{name}#{i}"))
    if not problems:
        raise ValueError(f"math dataset {path} is empty")
    return problems


def _file_rows(fs, path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            return pq.read_table(f).to_pylist()
    rows = []
    with fs.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {i + 1} is not a JSON object")
            rows.append(row)
    return rows


def _hf_rows(path: str) -> list[dict]:
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"{path} is a DatasetDict with splits {sorted(ds)}; point at one split's folder "
                         f"(for example {path.rstrip('/')}/{next(iter(ds))})")
    return ds.to_list()


@register_env("math")
class MathDatasetEnv(_MathEnv):
    """Word problems from a dataset (see `load_math_problems`), graded by math-verify.

    With no `path`, the shipped GSM8K-style mini set (25 train, 8 eval problems). Eval mode draws from
    `eval_path`; without one, from the training problems (a warning says so). Each call draws distinct
    problems while it can (with replacement only when asked for more than the set holds)."""

    env_name = "math"

    def __init__(self, path: Optional[str] = None, eval_path: Optional[str] = None, question_field: str = "question",
                 answer_field: str = "answer", chat: bool = True, instruction: str = INSTRUCTION):
        super().__init__(chat, instruction)
        if path is None:
            if eval_path is not None:
                raise ValueError("math: eval_path without path; give both, or neither for the shipped set")
            path, eval_path = data_path("gsm8k_mini_train.jsonl"), data_path("gsm8k_mini_eval.jsonl")
        self.train = load_math_problems(path, question_field, answer_field)
        if eval_path is None:
            logger.warning("math: no eval_path; evaluations draw from the training problems of %s", path)
            self.eval = self.train
        else:
            self.eval = load_math_problems(eval_path, question_field, answer_field)

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        pool: Sequence[Problem] = self.eval if mode == "eval" else self.train
        idx = rng.choice(len(pool), size=n, replace=n > len(pool))
        return [Problem(self._prompt(pool[i].prompt), pool[i].answer, pool[i].example_id) for i in idx]
