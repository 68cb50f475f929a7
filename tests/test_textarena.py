"""The textarena environment against the real textarena package: its games as two agents whose turns go
through the policy router, the game's rewards per agent, refused games, and jobs with one shared model
(L1) and a model per player (L3)."""

from __future__ import annotations

import numpy as np
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.envs import EnvConfig, safe_sample
from marinrl.envs.base import make_env
from marinrl.inference.context import SamplingParams
from marinrl.inference.server import InferenceServer, InferenceServerConfig
from marinrl.models.policy_model import ModelConfig, build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.types import RolloutMetadata

pytest.importorskip("textarena")  # the `textarena` extra (in `dev`: CI has it)

HIGH_CARD = "textarena_games:HighCard"  # tests/textarena_games.py


@pytest.fixture(scope="module")
def server():
    arch = LlamaConfig(seq_len=1024, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2,
                       gradient_checkpointing=False)
    with InferenceServer(InferenceServerConfig(serve_http=False), build_model(ModelConfig(model=arch, vocab_size=512)),
                         byte_tokenizer(512)) as s:
        yield s


def _sample(env, server, n_examples=3, n_generations=4, max_tokens=1, seed=0):
    return safe_sample(env, server, lesson_id="game", n_examples=n_examples, n_generations=n_generations,
                       sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens), rng=np.random.default_rng(seed),
                       mode="train", metadata=RolloutMetadata(worker_id="test", weight_step=0))


def test_each_player_earns_the_game_outcome_on_its_own_turns(server):
    """HighCard: player 0 then player 1 name a character, the higher byte wins. Rollout j of the turn-0
    group and of the turn-1 group are one game, so the rewards must follow from the two responses."""
    env = make_env(EnvConfig("textarena", {"game": HIGH_CARD, "policies": {"player1": "rival"}}))
    groups, metrics = _sample(env, server)
    assert metrics["game/env_failures"] == 0 and len(groups) == 6
    tok = server.tokenizer
    for first, second in zip(groups[0::2], groups[1::2]):
        assert {(r.agent_name, r.policy_name) for r in first.rollouts} == {("player0", "policy")}
        assert {(r.agent_name, r.policy_name) for r in second.rollouts} == {("player1", "rival")}
        assert ":t0:player0:" in first.group_id and ":t1:player1:" in second.group_id
        for a, b in zip(first.rollouts, second.rollouts):
            assert "[GAME] card?" in tok.decode(list(a.prompt_tokens))
            card = lambda r: (tok.decode(list(r.response_tokens)).encode("utf-8", "replace")[:1] or b"\x00")
            want = 0.0 if card(a) == card(b) else (1.0 if card(a) > card(b) else -1.0)
            assert (a.episode_reward, b.episode_reward) == (want, -want)
            assert tok.decode(list(b.prompt_tokens)).count("[Player 0]") == 1  # player 1 sees player 0's move
    assert metrics["game/player0/turns"] == metrics["game/player1/turns"] == 12
    assert metrics["game/player0/win_frac"] + metrics["game/player1/win_frac"] + metrics["game/draw_frac"] == 1.0


def test_a_shipped_game_runs_its_rules_on_the_model_moves(server):
    """TicTacToe-v0 as textarena ships it: a random model's moves are mostly invalid, which textarena
    answers with a warning and a second chance, then a loss; the loser gets -1 and the other player +1."""
    env = make_env(EnvConfig("textarena", {"game": "TicTacToe-v0", "max_turns": 4}))
    groups, metrics = _sample(env, server, max_tokens=3)
    assert metrics["game/env_failures"] == 0 and groups
    first = groups[0].rollouts[0]
    assert "You are Player 0 in Tic Tac Toe" in server.tokenizer.decode(list(first.prompt_tokens))
    assert metrics["game/player0/invalid_move_frac"] > 0.5  # random bytes are rarely `[0-8]`
    for g in groups:
        assert set(g.rewards.tolist()) <= {-1.0, 0.0, 1.0}
    assert metrics["game/n_episodes"] == 12 and metrics["game/generate_calls"] >= 2


@pytest.mark.parametrize("args, match", [
    ({"game": "Hangman-v0"}, r"refused: it downloads data .*its episodes would depend on the network"),
    ({"game": "Debate-v0"}, "refused"),
    ({"game": "TicTacToe-v9"}, "did you mean"),
    ({"game": "TicTacToe-v0", "policies": {"player2": "x"}}, "unknown agents"),
    ({"game": "TicTacToe-v0", "num_players": 3}, "two-player"),
    ({"game": "marinrl.envs.base:EnvConfig"}, "not a textarena.Env"),
])
def test_bad_games_are_refused_naming_the_reason(args, match):
    with pytest.raises(ValueError, match=match):
        make_env(EnvConfig("textarena", args))


def _job(tmp_path, ray_session, lesson, **overrides):
    from test_job import _run

    from marinrl.train.batching import BatchingConfig

    model = ModelConfig(model=LlamaConfig(seq_len=1024, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
                                          num_kv_heads=2, gradient_checkpointing=False), vocab_size=512)
    return _run(tmp_path, ray_session, curriculum=CurriculumConfig(lessons=(lesson,)), model=model,
                batching=BatchingConfig(max_length=1024, min_bucket=64), **overrides)


@pytest.mark.timeout(1200)
def test_a_shipped_game_trains_one_shared_model_end_to_end(tmp_path, ray_session):
    """L1: both players of TicTacToe-v0 are the one policy; 3 trainer steps on their turns."""
    from marinrl.storage.rollouts import RolloutReader

    lesson = LessonConfig("ttt", EnvConfig("textarena", {"game": "TicTacToe-v0", "max_turns": 4}), max_tokens=3,
                          graduate_at=None)
    cfg, result = _job(tmp_path, ray_session, lesson, num_train_steps=3, eval_every=3)
    assert result.train["final_step"] == 3 and all(np.isfinite(h["loss"]) for h in result.train["history"])
    agents = {r.agent_name for b in RolloutReader(f"{cfg.run_dir}/rollouts").read_new() for r in b.rollouts}
    assert "player0" in agents
    evals = [e["metrics"] for e in result.rollouts[0]["evals"] if e["kind"] == "eval"]
    assert "eval/ttt/player0/win_frac" in evals[-1]


@pytest.mark.timeout(1200)
def test_a_model_per_player_trains_each_on_its_own_turns(tmp_path, ray_session):
    """L3: player0 and player1 of IteratedPrisonersDilemma-v0 (its chat rounds take any text, so a random
    model's players both move) each have a full model; each trainer trains only its player's groups, read
    from its own rollout files. Two turns per game (the prompts grow past the tiny model's 1024 positions
    after that), so every game is cut and pays truncated_reward: this checks the plumbing, not learning."""
    from marinrl.config.policies import PolicyConfig
    from marinrl.storage.rollouts import RolloutReader

    policies = {"policy": PolicyConfig(specialization="full"), "rival": PolicyConfig(specialization="full")}
    lesson = LessonConfig("ipd", EnvConfig("textarena", {"game": "IteratedPrisonersDilemma-v0", "max_turns": 2,
                                                         "policies": {"player1": "rival"}}),
                          max_tokens=2, graduate_at=None)
    cfg, result = _job(tmp_path, ray_session, lesson, num_train_steps=2, eval_every=2, policies=policies)
    player_of = {"policy": "player0", "rival": "player1"}
    for name, train in result.policies.items():
        assert train["final_step"] == 2
        trained = [g for step in train["trained_groups"] for g in step]
        assert trained and all(f":{player_of[name]}:" in g for g in trained), trained[:4]
        written = [r for b in RolloutReader(f"{cfg.run_dir}/policies/{name}/rollouts").read_new() for r in b.rollouts]
        assert {(r.agent_name, r.policy_name) for r in written} == {(player_of[name], name)}
