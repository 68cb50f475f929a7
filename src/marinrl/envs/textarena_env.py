"""textarena's two-player text games as a multi-agent environment (docs/environments.md, "textarena").

    env: {name: textarena, args: {game: TicTacToe-v0, policies: {player1: opponent}}}

Each of the game's players is an agent (`player0`, `player1`) played by a policy (`policies`, agent ->
policy name; `policy` by default, the job's `policies:` defines them, docs/policies.md). The game says
whose turn it is; every turn of all live episodes of one player is one `generate` call on that player's
policy (`policy_context`, the policy router), so with a model per policy each player's turns are
sampled and trained by its own model. A turn is one rollout: its prompt the player's observation (the
game's text, through the chat template as a user turn, or raw with `chat: false`), its response the
tokens the player sampled; the response text (without EOS) is the game action.

Rewards: when a game ends, the game's reward of each player (textarena's `close()`: 1 win, -1 loss,
0 draw for most games) is the reward of every turn that player took; an episode still running after
`max_turns` turns ends with `truncated_reward` for both. Groups are per (problem, turn, agent) as in
envs/multiagent.py: the n_generations games of one seed at turn t.

Games that fetch data or call a model over the network (nltk corpora, an LLM jury) cannot run here
and are refused when the environment is built, before their module is imported (its import would
start the download). textarena is imported when such an environment is built, never when marinrl is
imported (the optional extra `marinrl[textarena]`).
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re
from typing import Any, Mapping, Optional

import numpy as np

from marinrl.envs.base import (
    Mode,
    Problem,
    check_sample_args,
    completion_text,
    encode_prompt,
    make_rollout,
    new_group_id,
    optional_package,
    register_env,
)
from marinrl.envs.multiagent import Agent
from marinrl.inference.context import InferenceContext, SamplingParams, policy_context
from marinrl.types import DEFAULT_POLICY, Rollout, RolloutGroup

NETWORK_MARKERS = re.compile(r"\bnltk\b|\brequests\.|urlopen|\bjury\b|OpenRouter|EnglishDictionary|load_dataset|"
                             r"hf_hub_download")
"""Source text of a game's package that means it downloads data or calls a remote model."""
EVAL_SEEDS = 1 << 30
"""Eval games use seeds from here up, training games seeds below it."""


def import_textarena():
    """The textarena package, or an error that says how to install it."""
    return optional_package("textarena", "textarena", "textarena", "textarena")


def network_use(module_name: str) -> Optional[str]:
    """What in a textarena game's package (the folder of its module, read from disk without importing
    it) fetches data or calls a remote model, or None."""
    ta = import_textarena()
    parts = module_name.split(".")
    if parts[:2] != ["textarena", "envs"] or len(parts) < 3:
        return None  # a game of your own: yours to keep offline
    folder = pathlib.Path(ta.envs.__path__[0], parts[2])
    files = sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
    for path in files:
        if path.is_file():
            found = NETWORK_MARKERS.search(path.read_text(errors="replace"))
            if found:
                return f"{path.relative_to(folder.parent)} uses {found.group(0)!r}"
    return None


def make_game(game: str, game_args: Mapping[str, Any]):
    """A fresh textarena game: a registered id (`TicTacToe-v0`, with its default wrappers) or a dotted
    path to a `textarena.Env` class of your own (`my_pkg.games:MyGame`, wrapped in textarena's
    `LLMObservationWrapper` so its observations are text)."""
    ta = import_textarena()
    if ":" in game:
        module_name, _, attr = game.partition(":")
        cls = getattr(importlib.import_module(module_name), attr, None)
        if not (isinstance(cls, type) and issubclass(cls, ta.Env)):
            raise ValueError(f"textarena: game {game!r} is not a textarena.Env class")
        return ta.wrappers.LLMObservationWrapper(cls(**dict(game_args)))
    return ta.make(game, **dict(game_args))


def check_game(game: str) -> None:
    """Refuse an unknown game id, or one that needs downloads or a remote model (module docstring)."""
    import_textarena()
    if ":" in game:
        return
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        near = sorted(g for g in ENV_REGISTRY if g.split("-")[0].lower() == game.split("-")[0].lower())
        raise ValueError(f"textarena: unknown game {game!r}" + (f"; did you mean {near}?" if near else
                         f"; {len(ENV_REGISTRY)} games are registered (textarena.envs.registration.ENV_REGISTRY)"))
    entry = ENV_REGISTRY[game].entry_point
    module_name = entry.split(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")
    why = network_use(module_name)
    if why:
        raise ValueError(f"textarena: game {game!r} is refused: it downloads data or calls a remote model "
                         f"({why}), so its episodes would depend on the network; choose a game that runs offline, "
                         "or name a game class of your own (`my_pkg.games:MyGame`), which is not checked")


@dataclasses.dataclass
class _Episode:
    game: Any
    problem: int
    turns: list = dataclasses.field(default_factory=list)
    """(turn, agent index, prompt tokens, generation)"""
    rewards: Optional[dict] = None
    info: Optional[dict] = None


@register_env("textarena")
class TextArenaEnv:
    """A textarena game between two agents (module docstring). Metrics: `reward_mean` (all turns),
    `turns_mean`, `draw_frac`, `truncated_frac` (episodes cut at max_turns), `zero_variance_groups_frac`,
    `n_samples`, `n_episodes`, `generate_calls`; per agent `<agent>/reward_mean`, `<agent>/turns`,
    `<agent>/win_frac`, `<agent>/invalid_move_frac` (it lost or was warned for an invalid move)."""

    env_name = "textarena"

    def __init__(self, game: str, game_args: Optional[Mapping[str, Any]] = None,
                 policies: Optional[Mapping[str, str]] = None, num_players: int = 2, max_turns: int = 30,
                 truncated_reward: float = 0.0, chat: bool = True):
        if num_players != 2:
            raise ValueError(f"textarena: only two-player games are supported, got num_players={num_players}")
        if max_turns < 1:
            raise ValueError(f"textarena: max_turns must be >= 1, got {max_turns}")
        check_game(game)
        self.game, self.game_args = game, dict(game_args or {})
        names = [f"player{i}" for i in range(num_players)]
        policies = dict(policies or {})
        unknown = sorted(set(policies) - set(names))
        if unknown:
            raise ValueError(f"textarena: policies names unknown agents {unknown}; agents: {names}")
        self.agents = tuple(Agent(n, policies.get(n, DEFAULT_POLICY)) for n in names)
        self.num_players, self.max_turns = num_players, max_turns
        self.truncated_reward, self.chat = float(truncated_reward), chat
        probe = make_game(game, self.game_args)  # builds now: a bad game_args fails here, not in a rollout
        probe.reset(num_players=num_players, seed=0)
        if not isinstance(probe.state, import_textarena().TwoPlayerState):
            raise ValueError(f"textarena: game {game!r} is not a two-player game ({type(probe.state).__name__})")

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        low = EVAL_SEEDS if mode == "eval" else 0
        seeds = rng.integers(low, low + EVAL_SEEDS, n)
        return [Problem(prompt="", answer="", example_id=f"{self.game}:{int(s)}") for s in seeds]

    def encode(self, tokenizer, observation: Any) -> list[int]:
        if not isinstance(observation, str):  # a game without a text observation wrapper: (from, message, type)
            observation = "\n".join(str(m[1]) if isinstance(m, tuple) else str(m) for m in observation)
        return encode_prompt(tokenizer, observation, chat=self.chat)

    def sample(self, ctx: InferenceContext, n_examples: int, n_generations: int, sampling: SamplingParams,
               rng: np.random.Generator, mode: Mode) -> tuple[list[RolloutGroup], dict[str, float]]:
        check_sample_args(n_examples, n_generations, mode)
        tokenizer = ctx.tokenizer
        problems = self.problems(n_examples, rng, mode)
        episodes = []
        for i, problem in enumerate(problems):
            for _ in range(n_generations):
                game = make_game(self.game, self.game_args)
                game.reset(num_players=self.num_players, seed=int(problem.example_id.rsplit(":", 1)[1]))
                episodes.append(_Episode(game, i))
        calls = 0
        for turn in range(self.max_turns):
            waiting: dict[int, list[tuple[_Episode, Any]]] = {}
            for ep in episodes:
                if ep.rewards is None:
                    player, observation = ep.game.get_observation()
                    waiting.setdefault(int(player), []).append((ep, observation))
            if not waiting:
                break
            for player in sorted(waiting):
                agent = self.agents[player]
                prompts = [self.encode(tokenizer, obs) for _, obs in waiting[player]]
                rows = policy_context(ctx, agent.policy).generate(prompts, 1, sampling, int(rng.integers(0, 2**31 - 1)))
                calls += 1
                if len(rows) != len(prompts) or any(len(r) != 1 for r in rows):
                    raise RuntimeError(f"ctx.generate returned {len(rows)} rows for {len(prompts)} prompts")
                for (ep, _), prompt, (gen,) in zip(waiting[player], prompts, rows):
                    ep.turns.append((turn, player, prompt, gen))
                    done, _ = ep.game.step(completion_text(tokenizer, gen, sampling))
                    if done:
                        rewards, info = ep.game.close()
                        ep.rewards = {int(p): float(r) for p, r in (rewards or {}).items()}
                        ep.info = info or {}
        groups = self._groups(problems, episodes, sampling)
        metrics = self._metrics(episodes, calls)
        metrics["zero_variance_groups_frac"] = float(np.mean([np.all(g.rewards == g.rewards[0]) for g in groups]))
        return groups, metrics

    def _reward(self, ep: _Episode, player: int) -> float:
        return self.truncated_reward if ep.rewards is None else ep.rewards.get(player, 0.0)

    def _groups(self, problems, episodes, sampling) -> list[RolloutGroup]:
        by_group: dict[tuple[int, int], list[Rollout]] = {}
        ids: dict[tuple[int, int], str] = {}
        for ep in episodes:
            for turn, player, prompt, gen in ep.turns:
                key = (ep.problem, turn)
                agent = self.agents[player]
                if key not in ids:
                    ids[key] = new_group_id(self.env_name, f"{problems[ep.problem].example_id}:t{turn}:{agent.name}")
                by_group.setdefault(key, []).append(make_rollout(
                    prompt, gen, reward=self._reward(ep, player), temperature=sampling.temperature,
                    env_name=self.env_name, group_id=ids[key], agent_name=agent.name, policy_name=agent.policy))
        # one agent per group: turn t of one seed may be a different player's in different games (a retry
        # after an invalid move keeps the turn), so split a mixed group by agent
        groups = []
        for key in sorted(by_group):
            for name in sorted({r.agent_name for r in by_group[key]}):
                members = tuple(r for r in by_group[key] if r.agent_name == name)
                if len(members) < len(by_group[key]):
                    gid = new_group_id(self.env_name, f"{problems[key[0]].example_id}:t{key[1]}:{name}")
                    members = tuple(dataclasses.replace(r, group_id=gid) for r in members)
                groups.append(RolloutGroup(members))
        return groups

    def _metrics(self, episodes: list[_Episode], calls: int) -> dict[str, float]:
        turn_rewards = [self._reward(ep, p) for ep in episodes for _, p, _, _ in ep.turns]
        finished = [ep for ep in episodes if ep.rewards is not None]
        m = {
            "reward_mean": float(np.mean(turn_rewards)) if turn_rewards else 0.0,
            "turns_mean": float(np.mean([len(ep.turns) for ep in episodes])),
            "truncated_frac": 1.0 - len(finished) / len(episodes),
            "draw_frac": float(np.mean([len(set(ep.rewards.values())) <= 1 for ep in finished])) if finished else 0.0,
            "n_samples": float(len(turn_rewards)),
            "n_episodes": float(len(episodes)),
            "generate_calls": float(calls),
        }
        for i, agent in enumerate(self.agents):
            mine = [self._reward(ep, i) for ep in episodes for _, p, _, _ in ep.turns if p == i]
            if mine:
                m[f"{agent.name}/reward_mean"] = float(np.mean(mine))
            m[f"{agent.name}/turns"] = float(len(mine))
            m[f"{agent.name}/win_frac"] = float(np.mean([self._reward(ep, i) > max(
                [self._reward(ep, j) for j in range(self.num_players) if j != i]) for ep in episodes]))
            m[f"{agent.name}/invalid_move_frac"] = float(np.mean(
                [bool((ep.info or {}).get(i, {}).get("invalid_move", False)) for ep in episodes]))
        return m
