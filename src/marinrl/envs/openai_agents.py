"""Example agents for `openai_agent` (envs/openai_env.py), written purely against the `openai` client:
what an existing agent looks like when marinrl trains it. Copy one to start your own.

    EnvConfig(name="openai_agent", args={"agent": "marinrl.envs.openai_agents:EchoChatAgent",
                                         "agent_args": {"alphabet_size": 4}})
"""

from __future__ import annotations

import numpy as np
import openai

from marinrl.envs.base import Grade, Problem
from marinrl.envs.toy import ALPHABET, grade_answer


class EchoChatAgent:
    """Copy a string of letters, as one chat turn: the user says `abc=`, the answer is `abc`."""

    def __init__(self, alphabet_size: int = 10, length: int = 1):
        if not 2 <= alphabet_size <= len(ALPHABET):
            raise ValueError(f"EchoChatAgent: alphabet_size must be in [2, {len(ALPHABET)}], got {alphabet_size}")
        if length < 1:
            raise ValueError(f"EchoChatAgent: length must be >= 1, got {length}")
        self.alphabet = ALPHABET[:alphabet_size]
        self.length = length

    def problems(self, n: int, rng: np.random.Generator, mode: str) -> list[Problem]:
        out = []
        for _ in range(n):
            s = "".join(self.alphabet[i] for i in rng.integers(0, len(self.alphabet), self.length))
            out.append(Problem(prompt=f"{s}=", answer=s, example_id=s))
        return out

    async def run_episode(self, client: openai.AsyncOpenAI, model: str, problem: Problem) -> Grade:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": problem.prompt}])
        return grade_answer(reply.choices[0].message.content or "", problem.answer)


class TwoTurnEchoAgent(EchoChatAgent):
    """Answer, hear "again", answer again: two calls whose second prompt re-renders the first turn, so
    the episode is one stitched sequence (two trained answers, the template tokens between masked).
    The reward is the mean of the two answers' grades."""

    async def run_episode(self, client: openai.AsyncOpenAI, model: str, problem: Problem) -> Grade:
        messages = [{"role": "user", "content": problem.prompt}]
        first = await client.chat.completions.create(model=model, messages=messages)
        first_text = first.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": first_text}, {"role": "user", "content": "again"}]
        second = await client.chat.completions.create(model=model, messages=messages)
        a = grade_answer(first_text, problem.answer)
        b = grade_answer(second.choices[0].message.content or "", problem.answer)
        return Grade(reward=(a.reward + b.reward) / 2,
                     indicators={"correct": a.indicators["correct"] * b.indicators["correct"]})
