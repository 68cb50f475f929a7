"""Tasks a tiny random-init model learns on a CPU in minutes with GRPO: copy (or reverse) a short
string, and the parity of a few bits. Each has difficulty knobs, so they make curriculum lessons.

Why these and why this grading (measured; see docs/environments.md, "Learnability"): a random
model samples its whole vocabulary (512 tokens for the byte tokenizer) almost uniformly, so an exact
answer is hit about once per 500 samples. Adam turns those rare hits into full-size steps, and with
16 samples per prompt `echo` (10 letters, one character) reaches a greedy reward of 0.8 in 25-100
optimizer steps of a 2-layer, hidden-64 Llama. Partial credit for answering *some* letter of the
alphabet looks helpful but is not: it rewards the same output for every prompt, the policy
collapses onto one letter, and the groups lose all variance. The only partial credit here is per
position of the right answer, which always depends on the prompt.

Prompts are raw text (BOS + a few characters) by default: short prompts are easier for a tiny model
to attend over than a chat template. Each task writes its own prompt shape, so lessons of different
tasks never ask the same question with different answers.
"""

from __future__ import annotations

import zlib

import numpy as np

from marinrl.envs.base import Grade, Mode, Problem, SingleTurnEnv, register_env

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def grade_answer(response: str, answer: str) -> Grade:
    """Reward of a response to a task with one exact answer, in [0, 1].

    The credit is the fraction of the answer's positions the response gets right (position i of the
    response against position i of the answer). Text after the answer's length halves the credit,
    so that with a token budget longer than the answer the policy learns to stop. Indicator
    `correct`: the response is exactly the answer."""
    if not answer:
        raise ValueError("grade_answer: the answer is empty")
    credit = sum(a == b for a, b in zip(response, answer)) / len(answer)
    reward = credit if len(response) <= len(answer) else 0.5 * credit
    return Grade(reward=reward, indicators={"correct": float(response == answer)})


@register_env("echo")
class EchoEnv(SingleTurnEnv):
    """Copy (or reverse) the last `length` letters of a random string drawn from the first
    `alphabet_size` letters. Prompt `abc=` answers `abc`; with `reverse`, `abc<` answers `cba`; with
    `context` 2 and length 1, `xyc=` answers `c` (the `context` letters before it are distractors).

    Difficulty grows with `alphabet_size` (2..26), `length` and `reverse`. For a first lesson:
    alphabet_size 10, length 1, max_tokens 1, 16 generations per prompt.

    `holdout` reserves that fraction of all prompts for evaluation (a stable hash of the string
    decides): train never draws them, eval draws only them, so an eval measures the rule learned, not
    the prompts memorized. With `context` 2 and 10 letters (or 10 digits as context) there are 1,000
    prompts, every answer letter in both parts."""

    env_name = "echo"

    def __init__(self, alphabet_size: int = 10, length: int = 1, reverse: bool = False,
                 template: str | None = None, chat: bool = False, context: int = 0,
                 context_alphabet: str | None = None, holdout: float = 0.0):
        if not 2 <= alphabet_size <= len(ALPHABET):
            raise ValueError(f"echo: alphabet_size must be in [2, {len(ALPHABET)}], got {alphabet_size}")
        if length < 1:
            raise ValueError(f"echo: length must be >= 1, got {length}")
        if context < 0:
            raise ValueError(f"echo: context must be >= 0, got {context}")
        if context_alphabet is not None and (not context_alphabet
                                             or len(set(context_alphabet)) != len(context_alphabet)):
            raise ValueError(f"echo: context_alphabet must be distinct characters, got {context_alphabet!r}")
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"echo: holdout must be in [0, 1), got {holdout}")
        template = template if template is not None else ("{s}<" if reverse else "{s}=")
        if "{s}" not in template:
            raise ValueError(f"echo: template must contain '{{s}}', got {template!r}")
        self.alphabet = ALPHABET[:alphabet_size]
        self.length = length
        self.context = context
        self.context_alphabet = context_alphabet if context_alphabet is not None else self.alphabet
        self.reverse = reverse
        self.template = template
        self.chat = chat
        self.holdout = holdout
        n_prompts = len(self.context_alphabet) ** context * alphabet_size ** length
        if holdout and n_prompts * min(holdout, 1 - holdout) < 10:
            raise ValueError(f"echo: holdout={holdout} of only {n_prompts} prompts leaves fewer than 10 on one side; "
                             "raise context or alphabet_size")

    def is_held_out(self, s: str) -> bool:
        """Whether the string `s` (context + answer letters) is reserved for evaluation."""
        return zlib.crc32(s.encode()) % 10_000 < self.holdout * 10_000

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        out = []
        while len(out) < n:
            s = "".join(self.context_alphabet[i] for i in rng.integers(0, len(self.context_alphabet), self.context))
            s += "".join(self.alphabet[i] for i in rng.integers(0, len(self.alphabet), self.length))
            if self.holdout and self.is_held_out(s) != (mode == "eval"):
                continue
            answer = s[-self.length:]
            out.append(Problem(prompt=self.template.format(s=s), answer=answer[::-1] if self.reverse else answer,
                               example_id=s))
        return out

    def grade(self, problem: Problem, response: str) -> Grade:
        return grade_answer(response, problem.answer)


@register_env("parity")
class ParityEnv(SingleTurnEnv):
    """The parity of `n_bits` random bits: prompt `0110=` answers `0` (an even number of ones).

    Difficulty grows with `n_bits`; parity needs every bit, so it is much harder than copying:
    2 bits is a reachable second lesson for a tiny model, 4 or more a stretch."""

    env_name = "parity"

    def __init__(self, n_bits: int = 2, template: str = "{bits}=", chat: bool = False):
        if n_bits < 1:
            raise ValueError(f"parity: n_bits must be >= 1, got {n_bits}")
        if "{bits}" not in template:
            raise ValueError(f"parity: template must contain '{{bits}}', got {template!r}")
        self.n_bits = n_bits
        self.template = template
        self.chat = chat

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        out = []
        for _ in range(n):
            bits = "".join("1" if b else "0" for b in rng.integers(0, 2, self.n_bits))
            out.append(Problem(prompt=self.template.format(bits=bits), answer=str(bits.count("1") % 2),
                               example_id=bits))
        return out

    def grade(self, problem: Problem, response: str) -> Grade:
        return grade_answer(response, problem.answer)
