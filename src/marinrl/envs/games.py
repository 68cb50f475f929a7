"""Multi-turn tasks a tiny random-init model learns on a CPU: a guessing game answered with
"higher"/"lower", and a calculator tool the model must call before it answers.

Both keep every action one token (one byte) so that a random model, which samples its 512-token
vocabulary almost uniformly, stumbles on a rewarded action about once per 500 samples, as in the
single-turn toy tasks (envs/toy.py); and their observations are one or two bytes. Credit that is the
same for every prompt collapses a policy onto one output (toy.py's docstring): here such credit is
paid only for actions that are right for every prompt (the first guess of a game whose prompt says
nothing, calling the tool), and the rest depends on the hidden number or the tool's answer.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from marinrl.envs.base import Mode, Problem, register_env
from marinrl.envs.episode import Feedback, MultiTurnEnv

DIGITS = "0123456789"


@register_env("guess")
class GuessEnv(MultiTurnEnv):
    """Find a hidden digit in `max_turns` guesses. Prompt `?`; each turn is one digit; the
    environment answers "higher" (the hidden digit is larger), "lower", or ends the episode when the
    guess is right. An answer is one byte that names the direction and the guess: `higher[g]` /
    `lower[g]` for guess g, by default `abcdefghij` / `ABCDEFGHIJ` ("higher than 4" is `e`), so an
    episode reads `?4E1b2c3` (hidden 3). Give one symbol each (`higher="+"`, `lower="-"`) for the
    same answer to every guess: `?4-1+2+3`.

    Why one byte for both: in a binary search each digit is guessed at most once, so "higher than
    g" alone decides the next guess (a bigram: last token -> next guess); with `+`/`-` the next guess
    also depends on the guess two tokens back. Measured (docs/environments.md): with `valid_reward`
    0.1 the tiny model collapses onto a fixed sequence such as `0 9 0 0` that ignores the answers
    (that credit is the same for every hidden digit); with 0, the default, greedy success rises from
    0 to about 0.5 in 110 steps.

    Rewards: `1 - turn_penalty * k` on the guess that finds the digit at turn k (0-based), so fewer
    turns is better; `valid_reward` on each other guess that is a digit consistent with the answers
    so far (a first guess always is); 0 on anything else, which also ends the episode (truncated).
    Indicator `success`: the digit was found. `n_values` digits (2..10) are hidden: 0..n_values-1.

    A binary search finds any of 10 digits in 4 guesses. For a first lesson: n_values 10, max_turns 4,
    max_tokens 1 per turn, 16 generations per prompt."""

    env_name = "guess"

    def __init__(self, n_values: int = 10, max_turns: int = 4, turn_penalty: float = 0.1,
                 valid_reward: float = 0.0, higher: str = "abcdefghij", lower: str = "ABCDEFGHIJ",
                 max_episode_tokens: int = 32):
        if not 2 <= n_values <= 10:
            raise ValueError(f"guess: n_values must be in [2, 10], got {n_values}")
        for name, symbols in (("higher", higher), ("lower", lower)):
            if len(symbols) not in (1, 10):
                raise ValueError(f"guess: {name} must be one symbol or ten (one per digit), got {symbols!r}")
        if set(higher) & set(lower) or set(higher + lower) & set(DIGITS):
            raise ValueError(f"guess: higher {higher!r} and lower {lower!r} must share no symbol and hold no digit")
        self.n_values = n_values
        self.max_turns = max_turns
        self.turn_penalty = turn_penalty
        self.valid_reward = valid_reward
        self.higher = higher
        self.lower = lower
        self.max_episode_tokens = max_episode_tokens
        self.check_budgets()

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        return [Problem(prompt="?", answer=str(int(d)), example_id=str(int(d)))
                for d in rng.integers(0, self.n_values, n)]

    def step(self, problem: Problem, actions: Sequence[str]) -> Feedback:
        hidden, guess, turn = int(problem.answer), actions[-1], len(actions) - 1
        if len(guess) != 1 or guess not in DIGITS[: self.n_values]:
            return Feedback(truncated=True, indicators={"success": 0.0})
        if int(guess) == hidden:
            return Feedback(reward=1.0 - self.turn_penalty * turn, done=True, indicators={"success": 1.0})
        low, high = self.possible(hidden, actions[:-1])
        valid = self.valid_reward if low <= int(guess) <= high else 0.0
        symbols = self.higher if hidden > int(guess) else self.lower
        return Feedback(reward=valid, observation=symbols[int(guess) % len(symbols)])

    def possible(self, hidden: int, guesses: Sequence[str]) -> tuple[int, int]:
        """The range of digits that earlier answers (to `guesses`) leave possible."""
        low, high = 0, self.n_values - 1
        for g in guesses:
            if hidden > int(g):
                low = max(low, int(g) + 1)
            else:
                high = min(high, int(g) - 1)
        return low, high


@register_env("calculator")
class CalculatorEnv(MultiTurnEnv):
    """Tool use: answer `a+b` or `a-b` (one-digit result) after asking a calculator.

    Prompt `3+4:`. The model calls the tool by writing `call` (default `@`); the tool answers `=7`
    and the model answers with the digit. An episode reads `3+4:@=7` + `7`.
    Rewards: `call_reward` on the first call (tool use is right for every prompt), 1 on a right
    answer; a wrong answer earns 0; both end the episode. A second call is answered again and costs
    `call_reward` (calling twice nets nothing): without that cost a policy that has just learned to
    call keeps calling where it should answer, which pays as much as a wrong answer and explores no
    digit. Indicators: `success` (right answer), `called` (the tool was called before the answer).

    The model could learn the arithmetic itself, but repeating the tool's digit is far easier: the
    tool's answer ends with the digit, so the answer is the token the model just read, a bigram a
    tiny model learns in tens of steps (measured: with a `;` after the digit, so that the answer had
    to be fetched one token back past the operands, it did not learn in 150 steps). For a first
    lesson: max_operand 9, max_tokens 1 per turn, max_turns 2, 16 generations per prompt."""

    env_name = "calculator"
    indicator_names = ("success", "called")

    def __init__(self, max_operand: int = 9, ops: str = "+-", call: str = "@", call_reward: float = 0.2,
                 max_turns: int = 3, max_episode_tokens: int = 16):
        if not 1 <= max_operand <= 9:
            raise ValueError(f"calculator: max_operand must be in [1, 9], got {max_operand}")
        if not ops or set(ops) - set("+-"):
            raise ValueError(f"calculator: ops must be a non-empty string of '+' and '-', got {ops!r}")
        if not call or any(c in DIGITS for c in call):
            raise ValueError(f"calculator: call must be a non-empty string without digits, got {call!r}")
        self.max_operand = max_operand
        self.ops = ops
        self.call = call
        self.call_reward = call_reward
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.check_budgets()

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        """The answer is drawn uniformly (then operands that give it): with answers as skewed as
        random operands make them (`a-b` is 0 ten times as often as 9), answering the commonest digit
        to every prompt pays, and a policy collapses onto it instead of reading the tool."""
        out = []
        m = self.max_operand
        for _ in range(n):
            op = self.ops[int(rng.integers(0, len(self.ops)))]
            if op == "+":
                value = int(rng.integers(0, min(9, 2 * m) + 1))
                a = int(rng.integers(max(0, value - m), min(value, m) + 1))
                b = value - a
            else:
                value = int(rng.integers(0, m + 1))
                b = int(rng.integers(0, m - value + 1))
                a = value + b
            out.append(Problem(prompt=f"{a}{op}{b}:", answer=str(value), example_id=f"{a}{op}{b}"))
        return out

    def step(self, problem: Problem, actions: Sequence[str]) -> Feedback:
        action = actions[-1]
        called = any(a == self.call for a in actions[:-1])
        if action == self.call:
            return Feedback(reward=-self.call_reward if called else self.call_reward,
                            observation=f"={problem.answer}", indicators={"called": 1.0})
        right = action == problem.answer
        return Feedback(reward=float(right), done=True,
                        indicators={"success": float(right), "called": float(called)})
