"""Multi-turn episodes on top of the `Env` protocol: the environment gives a prompt, the policy
takes a turn, the environment answers with `Feedback` (a reward, an observation, done or
truncated), and so on, up to a turn budget and a token budget.

A subclass of `MultiTurnEnv` writes only the task: `problems` (the prompts) and `step` (the
environment's answer to the episode's latest turn, given all its turns so far). `MultiTurnEnv.sample`
runs n_examples × n_generations episodes side by side and batches each turn of all live episodes
into one `ctx.generate` call.

The whole episode is one rollout, in one token sequence:

    prompt    = encoded prompt (BOS + text)
    response  = turn 1 tokens + observation 1 tokens + turn 2 tokens + ... + last turn tokens
    loss_mask = 1 on turn tokens (with their sampler logprobs), 0 on observation tokens
    token_rewards: each turn's reward on that turn's last token; episode_reward = their sum

Token-in/token-out: the prompt of turn k+1 is exactly the prompt, the tokens sampled so far and
the encoded observations, never a re-tokenization of decoded text (a tokenizer does not round-trip
in general, and the trainer must score the very tokens the sampler produced). The observation
after the last turn is not appended: no model token follows it, so it would teach nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from marinrl.envs.base import (
    Mode,
    Problem,
    check_sample_args,
    completion_text,
    encode_prompt,
    make_rollout,
    new_group_id,
)
from marinrl.inference.context import Generation, InferenceContext, SamplingParams, policy_context
from marinrl.types import DEFAULT_AGENT, DEFAULT_POLICY, FinishReason, RolloutGroup


@dataclasses.dataclass(frozen=True)
class Feedback:
    """The environment's answer to one turn."""

    reward: float = 0.0
    """Reward earned by this turn; it sits on the turn's last token."""
    observation: str = ""
    """Text the environment appends before the next turn (encoded by `encode_observation`)."""
    done: bool = False
    """The episode reached its end (solved, failed for good): finish_reason "stop"."""
    truncated: bool = False
    """The environment cut the episode short without an end (a malformed action it will not answer):
    finish_reason "length", like a budget that ran out."""
    indicators: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """0/1 facts about the episode so far (`success`, ...); the last value reported for a key counts,
    an episode that never reports a key counts 0. Reported as `<key>_frac` and `<key>_count`."""

    def __post_init__(self):
        if not np.isfinite(self.reward):
            raise ValueError(f"Feedback.reward must be finite, got {self.reward}")


@dataclasses.dataclass
class EpisodeRecord:
    """One episode in progress: the exact tokens so far and what each token is."""

    problem: Problem
    prompt: list[int]
    response: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    token_rewards: list[float] = dataclasses.field(default_factory=list)
    weight_steps: list[int | None] = dataclasses.field(default_factory=list)
    """Weight step that sampled each response token (None where the server did not say); observation
    tokens carry the step of the token before them."""
    actions: list[str] = dataclasses.field(default_factory=list)
    """The text of each turn (without the EOS or stop sequence that ended it)."""
    rewards: list[float] = dataclasses.field(default_factory=list)
    """Each turn's reward."""
    indicators: dict[str, float] = dataclasses.field(default_factory=dict)
    finish_reason: FinishReason | None = None
    """None while the episode runs."""

    @property
    def tokens(self) -> list[int]:
        """The next turn's prompt: everything so far."""
        return self.prompt + self.response

    def add_turn(self, generation: Generation, text: str) -> None:
        self.response += [int(t) for t in np.asarray(generation.tokens).tolist()]
        self.logprobs += [float(x) for x in np.asarray(generation.logprobs).tolist()]
        self.loss_mask += [True] * len(generation.tokens)
        self.token_rewards += [0.0] * len(generation.tokens)
        steps = generation.weight_steps
        self.weight_steps += [None] * len(generation.tokens) if steps is None else [int(x) for x in steps]
        self.actions.append(text)

    def add_reward(self, reward: float) -> None:
        self.token_rewards[-1] += float(reward)
        self.rewards.append(float(reward))

    def add_observation(self, tokens: Sequence[int]) -> None:
        self.response += list(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.loss_mask += [False] * len(tokens)
        self.token_rewards += [0.0] * len(tokens)
        self.weight_steps += [self.weight_steps[-1] if self.weight_steps else None] * len(tokens)

    def token_weight_steps(self) -> np.ndarray | None:
        """`weight_steps` as the rollout wants them: None if no turn had any; turns without take the
        step of the token before them (the first ones: the first known step)."""
        known = [s for s in self.weight_steps if s is not None]
        if not known:
            return None
        out, last = [], known[0]
        for s in self.weight_steps:
            last = last if s is None else s
            out.append(last)
        return np.asarray(out, np.int64)


class MultiTurnEnv:
    """Base for multi-turn tasks: subclasses give `problems` and `step`.

    Budgets (constructor arguments of the subclasses, usually): `max_turns` model turns per episode,
    and `max_episode_tokens` response tokens per episode (turns and observations together, so a
    rollout always fits `max_episode_tokens` + prompt positions in the trainer). Each turn may use
    `sampling.max_tokens` tokens, shrunk to what the episode's token budget leaves; an episode whose
    budget runs out (turns or tokens) is truncated, finish_reason "length".

    Metrics: `reward_mean`, `reward_std`, `turns_mean`, `response_tokens_mean`, `truncated_frac`,
    `zero_variance_groups_frac`, `n_samples`, `generate_calls`, and `<indicator>_frac` /
    `<indicator>_count` of every indicator in `indicator_names` and every other one the environment
    reported."""

    env_name: str = "multi_turn"
    indicator_names: tuple[str, ...] = ("success",)
    """Indicators always reported (0 when no episode reported them), so a metric never disappears."""
    max_turns: int = 4
    max_episode_tokens: int = 64
    chat: bool = False
    agent_name: str = DEFAULT_AGENT
    policy_name: str = DEFAULT_POLICY

    # ---------------------------------------------------------------- what a task writes

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        raise NotImplementedError

    def step(self, problem: Problem, actions: Sequence[str]) -> Feedback:
        """The environment's answer to `actions[-1]`, the latest turn of an episode of `problem`
        whose turns so far are `actions` (the text of each, without the EOS or stop sequence that
        ended it). A pure function of its arguments: every episode keeps its own history."""
        raise NotImplementedError

    def encode_observation(self, tokenizer, text: str) -> list[int]:
        """Tokens of an observation, appended as they are: raw text, no special tokens."""
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    # ---------------------------------------------------------------- running episodes

    def check_budgets(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"{self.env_name}: max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 1:
            raise ValueError(f"{self.env_name}: max_episode_tokens must be >= 1, got {self.max_episode_tokens}")

    def sample(
        self,
        ctx: InferenceContext,
        n_examples: int,
        n_generations: int,
        sampling: SamplingParams,
        rng: np.random.Generator,
        mode: Mode,
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        check_sample_args(n_examples, n_generations, mode)
        self.check_budgets()
        problems = self.problems(n_examples, rng, mode)
        tokenizer = ctx.tokenizer
        episodes: list[list[EpisodeRecord]] = []
        for problem in problems:
            prompt = encode_prompt(tokenizer, problem.prompt, chat=self.chat)
            episodes.append([EpisodeRecord(problem, list(prompt)) for _ in range(n_generations)])
        flat = [e for row in episodes for e in row]
        calls = run_turns(policy_context(ctx, self.policy_name), flat, sampling, rng, self.max_turns,
                          self.max_episode_tokens,
                          step=lambda e: self.step(e.problem, e.actions),
                          encode=lambda text: self.encode_observation(tokenizer, text))
        groups = []
        for problem, row in zip(problems, episodes):
            group_id = new_group_id(self.env_name, problem.example_id)
            groups.append(RolloutGroup(tuple(
                episode_rollout(e, sampling, self.env_name, group_id, self.agent_name, self.policy_name)
                for e in row)))
        metrics = episode_metrics(flat, groups, self.indicator_names)
        metrics["generate_calls"] = float(calls)
        return groups, metrics


def run_turns(ctx: InferenceContext, episodes: Sequence[EpisodeRecord], sampling: SamplingParams,
              rng: np.random.Generator, max_turns: int, max_episode_tokens: int, *, step, encode) -> int:
    """Play `episodes` to their end: each round, one `ctx.generate` call (n=1) for every live
    episode, then `step(episode)` for each. Returns the number of generate calls.

    The round's `max_tokens` is the largest any live episode may use; an episode with less budget
    left keeps only the first tokens it may have (the sampler's logprobs of a prefix do not depend on
    what follows it) and its turn counts as cut by the budget."""
    tokenizer = ctx.tokenizer
    calls = 0
    for _ in range(max_turns):
        live = [e for e in episodes if e.finish_reason is None]
        if not live:
            break
        budgets = [min(sampling.max_tokens, max_episode_tokens - len(e.response)) for e in live]
        turn_sampling = dataclasses.replace(sampling, max_tokens=max(budgets))
        seed = int(rng.integers(0, 2**31 - 1))
        generations = ctx.generate([e.tokens for e in live], 1, turn_sampling, seed)
        calls += 1
        if len(generations) != len(live):
            raise RuntimeError(f"ctx.generate returned {len(generations)} rows for {len(live)} prompts")
        for e, budget, row in zip(live, budgets, generations):
            if len(row) != 1:
                raise RuntimeError(f"ctx.generate returned {len(row)} samples, asked for 1")
            gen = row[0]
            if len(gen.tokens) > budget:
                gen = gen.truncated(budget)
            e.add_turn(gen, completion_text(tokenizer, gen, sampling))
            feedback = step(e)
            if not isinstance(feedback, Feedback):
                raise TypeError(f"step() must return a Feedback, got {type(feedback).__name__}")
            e.add_reward(feedback.reward)
            e.indicators.update({k: float(v) for k, v in feedback.indicators.items()})
            if feedback.done:
                e.finish_reason = "stop"
                continue
            observation = encode(feedback.observation) if feedback.observation else []
            room = max_episode_tokens - len(e.response) - len(observation)
            if feedback.truncated or room < 1 or len(e.actions) == max_turns:
                e.finish_reason = "length"  # cut short: by the environment, the token budget or the turn budget
                continue
            e.add_observation(observation)
    for e in episodes:
        if e.finish_reason is None:
            e.finish_reason = "length"
    return calls


def episode_rollout(e: EpisodeRecord, sampling: SamplingParams, env_name: str, group_id: str,
                    agent_name: str, policy_name: str):
    """The rollout of one finished episode (unstamped)."""
    gen = Generation(np.asarray(e.response, np.int32), np.asarray(e.logprobs, np.float32), e.finish_reason,
                     e.token_weight_steps())
    return make_rollout(e.prompt, gen, reward=float(sum(e.rewards)), temperature=sampling.temperature,
                        env_name=env_name, group_id=group_id, loss_mask=np.asarray(e.loss_mask, bool),
                        token_rewards=np.asarray(e.token_rewards, np.float32), agent_name=agent_name,
                        policy_name=policy_name)


def episode_metrics(episodes: Sequence[EpisodeRecord], groups: Sequence[RolloutGroup],
                    indicator_names: Sequence[str] = ()) -> dict[str, float]:
    rewards = np.array([sum(e.rewards) for e in episodes], dtype=np.float64)
    keys = sorted(set(indicator_names) | {k for e in episodes for k in e.indicators})
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "turns_mean": float(np.mean([len(e.actions) for e in episodes])),
        "response_tokens_mean": float(np.mean([len(e.response) for e in episodes])),
        "truncated_frac": float(np.mean([e.finish_reason == "length" for e in episodes])),
        "zero_variance_groups_frac": float(np.mean([np.all(g.rewards == g.rewards[0]) for g in groups])),
        "n_samples": float(len(episodes)),
    }
    for k in keys:
        values = np.array([e.indicators.get(k, 0.0) for e in episodes])
        metrics[f"{k}_frac"] = float(values.mean())
        metrics[f"{k}_count"] = float(values.sum())
    return metrics
