"""Multi-agent episodes: named agents take turns in a fixed order, each sees its own view of the
episode, and each agent maps to a policy name.

Every agent turn is one training rollout: its prompt is the agent's view at that turn (built from
the task's text and other agents' moves), its response the tokens the agent sampled, its reward
what the environment paid for that move. Rollouts are tagged with `agent_name` and `policy_name`,
and grouped per (problem, turn, agent): the n_generations episodes of one problem at turn t form one
group, so group-relative advantages compare the same agent in the same situation, never a solver
with a checker. With one shared policy (agents differ only by their prompts) every agent's turns
train that policy; with separate policy models (`policies:`, docs/policies.md) each agent's turns are
sampled by its policy's model (`policy_context`) and train only that model.

Token-in/token-out: a move quoted in another agent's view is inserted as the exact tokens the
mover sampled (without the EOS or stop sequence that ended its turn), never re-tokenized text.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, Union

import numpy as np

from marinrl.envs.base import (
    Mode,
    Problem,
    check_sample_args,
    completion_text,
    make_rollout,
    new_group_id,
    register_env,
)
from marinrl.envs.episode import Feedback
from marinrl.inference.context import Generation, InferenceContext, SamplingParams, policy_context
from marinrl.types import DEFAULT_POLICY, Rollout, RolloutGroup


@dataclasses.dataclass(frozen=True)
class Agent:
    """A participant: its name (in rollouts and metrics) and the policy that plays it."""

    name: str
    policy: str = DEFAULT_POLICY

    def __post_init__(self):
        for field in ("name", "policy"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value or "/" in value:
                raise ValueError(f"Agent.{field} must be a non-empty string without '/', got {value!r}")


@dataclasses.dataclass(frozen=True)
class Move:
    """One agent turn: what the agent sampled (`tokens`, without the EOS or stop sequence that ended
    it) and its text."""

    agent: str
    tokens: tuple[int, ...]
    text: str


Segment = Union[str, Move]
"""A piece of an agent's view: text (encoded raw) or another move (inserted as its exact tokens)."""


class MultiAgentEnv:
    """Base for multi-agent tasks: subclasses give `agents` (the turn order), `problems`, `view`
    and `judge`. An episode runs `max_rounds` rounds of every agent in order, or until `judge` says
    done; each turn of all live episodes is one `ctx.generate` call.

    Metrics: `reward_mean` over all agent turns, `episode_reward_mean`, `turns_mean` (per episode),
    `truncated_frac` (turns cut by the token budget), `zero_variance_groups_frac`, `n_samples`
    (rollouts), `n_episodes`, `generate_calls`; per agent `<agent>/reward_mean`, `<agent>/turns`, and
    `<agent>/<indicator>_frac` of every indicator its judgements reported (the last value per
    episode counts; `success` by convention)."""

    env_name: str = "multi_agent"
    indicator_names: tuple[str, ...] = ("success",)
    """Indicators always reported for every agent (0 when none was reported), so metrics never disappear."""
    agents: tuple[Agent, ...] = ()
    max_rounds: int = 1

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        raise NotImplementedError

    def view(self, problem: Problem, agent: Agent, moves: Sequence[Move]) -> Sequence[Segment]:
        """What `agent` sees before its turn, given the moves so far; encoded after BOS."""
        raise NotImplementedError

    def judge(self, problem: Problem, agent: Agent, moves: Sequence[Move]) -> Feedback:
        """Reward of `moves[-1]`, the move `agent` just made; `done` ends the episode for everyone.
        Observations are not used: the next agent's `view` says what it sees."""
        raise NotImplementedError

    def settle(self, problem: Problem, moves: Sequence[Move]) -> Sequence[Feedback] | None:
        """Credit known only when the episode has ended: one Feedback per move, whose reward is added
        to that move's and whose indicators count for that move's agent (a speaker rewarded for what
        its listener did). None: nothing to add."""
        return None

    def check_agents(self) -> None:
        if not self.agents:
            raise ValueError(f"{self.env_name}: no agents")
        names = [a.name for a in self.agents]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.env_name}: agent names must be unique, got {names}")
        if self.max_rounds < 1:
            raise ValueError(f"{self.env_name}: max_rounds must be >= 1, got {self.max_rounds}")

    def encode_view(self, tokenizer, segments: Sequence[Segment]) -> list[int]:
        ids = [] if tokenizer.bos_token_id is None else [int(tokenizer.bos_token_id)]
        for s in segments:
            if isinstance(s, Move):
                ids += list(s.tokens)
            elif isinstance(s, str):
                ids += [int(t) for t in tokenizer.encode(s, add_special_tokens=False)]
            else:
                raise TypeError(f"{self.env_name}: a view holds text or Moves, got {type(s).__name__}")
        return ids

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
        self.check_agents()
        tokenizer = ctx.tokenizer
        problems = self.problems(n_examples, rng, mode)
        n_episodes = len(problems) * n_generations
        moves: list[list[Move]] = [[] for _ in range(n_episodes)]  # episode i * n_generations + j
        turns: list[list[tuple]] = [[] for _ in range(n_episodes)]  # (turn, agent, prompt, generation, feedback)
        live = [True] * n_episodes
        calls = 0
        turn = 0
        for _ in range(self.max_rounds):
            for agent in self.agents:
                slots = [e for e in range(n_episodes) if live[e]]
                if not slots:
                    break
                problem_of = [problems[e // n_generations] for e in slots]
                prompts = [self.encode_view(tokenizer, self.view(p, agent, moves[e]))
                           for p, e in zip(problem_of, slots)]
                generations = policy_context(ctx, agent.policy).generate(prompts, 1, sampling,
                                                                         int(rng.integers(0, 2**31 - 1)))
                calls += 1
                if len(generations) != len(slots) or any(len(row) != 1 for row in generations):
                    raise RuntimeError(f"ctx.generate returned {len(generations)} rows for {len(slots)} prompts "
                                       "(or not one sample each)")
                for e, problem, prompt, (gen,) in zip(slots, problem_of, prompts, generations):
                    moves[e].append(Move(agent.name, content_tokens(tokenizer, gen, sampling),
                                         completion_text(tokenizer, gen, sampling)))
                    feedback = self.judge(problem, agent, moves[e])
                    if not isinstance(feedback, Feedback):
                        raise TypeError(f"judge() must return a Feedback, got {type(feedback).__name__}")
                    turns[e].append((turn, agent, prompt, gen, feedback))
                    live[e] = not (feedback.done or feedback.truncated)
                turn += 1
        # Rollouts once every episode has ended: `settle` may credit earlier moves with later outcomes.
        by_group: dict[tuple[int, int], list[Rollout]] = {}
        group_ids: dict[tuple[int, int], str] = {}
        per_agent: dict[str, list[float]] = {a.name: [] for a in self.agents}
        indicators: dict[str, list[dict[str, float]]] = {a.name: [{} for _ in range(n_episodes)] for a in self.agents}
        episode_rewards = np.zeros(n_episodes)
        truncated = 0
        for e in range(n_episodes):
            problem = problems[e // n_generations]
            settled = self.settle(problem, moves[e])
            if settled is not None and len(settled) != len(moves[e]):
                raise ValueError(f"{self.env_name}: settle() returned {len(settled)} Feedbacks for "
                                 f"{len(moves[e])} moves")
            for k, (t, agent, prompt, gen, feedback) in enumerate(turns[e]):
                reward = feedback.reward
                marks = dict(feedback.indicators)
                if settled is not None:
                    reward += settled[k].reward
                    marks.update(settled[k].indicators)
                key = (t, e // n_generations)  # one group per (turn, problem): one agent in one situation
                if key not in group_ids:
                    group_ids[key] = new_group_id(self.env_name, f"{problem.example_id}:t{t}:{agent.name}")
                by_group.setdefault(key, []).append(make_rollout(
                    prompt, gen, reward=reward, temperature=sampling.temperature, env_name=self.env_name,
                    group_id=group_ids[key], agent_name=agent.name, policy_name=agent.policy))
                per_agent[agent.name].append(float(reward))
                indicators[agent.name][e].update({key: float(v) for key, v in marks.items()})
                episode_rewards[e] += reward
                truncated += gen.finish_reason == "length"
        groups = [RolloutGroup(tuple(by_group[key])) for key in sorted(by_group)]
        rewards = np.array([x for xs in per_agent.values() for x in xs])
        metrics = {
            "reward_mean": float(rewards.mean()),
            "episode_reward_mean": float(episode_rewards.mean()),
            "turns_mean": float(np.mean([len(m) for m in moves])),
            "truncated_frac": truncated / rewards.size,
            "zero_variance_groups_frac": float(np.mean([np.all(g.rewards == g.rewards[0]) for g in groups])),
            "n_samples": float(rewards.size),
            "n_episodes": float(episode_rewards.size),
            "generate_calls": float(calls),
        }
        for agent in self.agents:
            if per_agent[agent.name]:
                metrics[f"{agent.name}/reward_mean"] = float(np.mean(per_agent[agent.name]))
            metrics[f"{agent.name}/turns"] = float(len(per_agent[agent.name]))
            played = indicators[agent.name]
            for k in sorted(set(self.indicator_names) | {k for d in played for k in d}):
                metrics[f"{agent.name}/{k}_frac"] = float(np.mean([d.get(k, 0.0) for d in played]))
        return groups, metrics


def content_tokens(tokenizer, generation: Generation, sampling: SamplingParams) -> tuple[int, ...]:
    """The generated tokens without the EOS or stop sequence that ended the turn."""
    tokens = [int(t) for t in np.asarray(generation.tokens).tolist()]
    if generation.finish_reason == "stop" and tokens:
        if tokenizer.eos_token_id is not None and tokens[-1] == tokenizer.eos_token_id:
            return tuple(tokens[:-1])
        for stop in sampling.stop_sequences:
            if len(stop) <= len(tokens) and tuple(tokens[-len(stop):]) == tuple(stop):
                return tuple(tokens[: -len(stop)])
    return tuple(tokens)


@register_env("solve_check")
class SolveCheckEnv(MultiAgentEnv):
    """Two agents on one-digit arithmetic: a `solver` answers `a+b=` with a digit, then a `checker`
    sees the solver's answer (its exact tokens) in `a+b=x?` and says `y` (right) or `n` (wrong).

    Rewards: the solver 1 for a right answer; the checker 1 for a right verdict. Indicators (reported
    per agent): `success` (the solver's answer is right; the checker's verdict is right), and for
    the checker `accepted` (it said `y`). By default both agents are played by one shared policy
    (`policy`); `policies` maps agent names to other policy names. max_tokens 1 per turn suits it."""

    env_name = "solve_check"

    def __init__(self, max_operand: int = 4, policies: Mapping[str, str] | None = None):
        if not 1 <= max_operand <= 9:
            raise ValueError(f"solve_check: max_operand must be in [1, 9], got {max_operand}")
        policies = dict(policies or {})
        unknown = set(policies) - {"solver", "checker"}
        if unknown:
            raise ValueError(f"solve_check: policies names unknown agents {sorted(unknown)}; agents: solver, checker")
        self.max_operand = max_operand
        self.agents = tuple(Agent(name, policies.get(name, DEFAULT_POLICY)) for name in ("solver", "checker"))
        self.check_agents()

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        out = []
        while len(out) < n:
            a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, 2))
            if a + b <= 9:
                out.append(Problem(prompt=f"{a}+{b}=", answer=str(a + b), example_id=f"{a}+{b}"))
        return out

    def view(self, problem: Problem, agent: Agent, moves: Sequence[Move]) -> Sequence[Segment]:
        if agent.name == "solver":
            return [problem.prompt]
        return [problem.prompt, moves[-1], "?"]

    def judge(self, problem: Problem, agent: Agent, moves: Sequence[Move]) -> Feedback:
        if agent.name == "solver":
            right = moves[-1].text == problem.answer
            return Feedback(reward=float(right), indicators={"success": float(right)})
        solver_right = moves[-2].text == problem.answer
        verdict = moves[-1].text
        right = (verdict == "y" and solver_right) or (verdict == "n" and not solver_right)
        return Feedback(reward=float(right), done=True,
                        indicators={"success": float(right), "accepted": float(verdict == "y")})


@register_env("roles")
class RolesEnv(MultiAgentEnv):
    """Agents that see the same prompt (`<digit>?`), each paid for answering its own character: `targets` maps
    each agent's name to it, in turn order (default: `first` answers `0`, `second` answers `z`). One model that
    plays every agent cannot satisfy them all; one policy per agent (`policies:` with `full` or `lora` policies,
    docs/policies.md) can.

    The reward is dense so that a tiny random model learns it in tens of steps: an answer whose first
    byte is `b` earns `max(0, 1 - |b - target| / 64)`; an empty answer, or one that begins with a
    special token (`<|…|>`: the byte-level tokenizer's reserved tokens are half its vocabulary), earns 0.
    Indicator `success`: the answer is exactly the target. `policies` maps agent names to policy names."""

    env_name = "roles"

    def __init__(self, targets: Mapping[str, str] | None = None, policies: Mapping[str, str] | None = None):
        targets = dict(targets or {"first": "0", "second": "z"})
        policies = dict(policies or {})
        if not targets:
            raise ValueError("roles: targets must name at least one agent")
        unknown = set(policies) - set(targets)
        if unknown:
            raise ValueError(f"roles: policies names unknown agents {sorted(unknown)}; agents: {', '.join(targets)}")
        for agent, target in targets.items():
            if not isinstance(target, str) or len(target.encode()) != 1:
                raise ValueError(f"roles: targets.{agent} must be one ASCII character, got {target!r}")
        self.targets = targets
        self.agents = tuple(Agent(name, policies.get(name, DEFAULT_POLICY)) for name in targets)
        self.check_agents()

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        digits = rng.integers(0, 10, n)
        return [Problem(prompt=f"{d}?", answer="", example_id=f"{d}") for d in digits]

    def view(self, problem: Problem, agent: Agent, moves: Sequence[Move]) -> Sequence[Segment]:
        return [problem.prompt]

    def judge(self, problem: Problem, agent: Agent, moves: Sequence[Move]) -> Feedback:
        answer = moves[-1].text.encode("utf-8", "replace")
        target = self.targets[agent.name].encode()[0]
        clean = answer and not answer.startswith(b"<|")
        reward = max(0.0, 1.0 - abs(answer[0] - target) / 64) if clean else 0.0
        return Feedback(reward=reward, done=agent.name == self.agents[-1].name,
                        indicators={"success": float(answer == bytes([target]))})
