"""Multi-agent environments (envs/multiagent.py): turn order, one generate call per turn, groups per
(problem, turn, agent), agent and policy tags, per-agent metrics, exact tokens of one agent's move in
another's view, the policy name through storage, eval metrics, and the real server."""

from __future__ import annotations

import numpy as np
import pytest
from test_episodes import LOGPROB, RecordingContext, ScriptedPolicy, text_of

from marinrl.config.env import EnvConfig
from marinrl.envs import Agent, Feedback, MultiAgentEnv, Problem, make_env, safe_sample
from marinrl.envs.multiagent import Move, SolveCheckEnv
from marinrl.eval import lesson_metrics
from marinrl.inference.context import SamplingParams
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.storage.rollouts import RolloutReader, RolloutWriter
from marinrl.types import RolloutBatch, RolloutMetadata

META = RolloutMetadata(worker_id="worker-2", weight_step=5, created_at=1_700_000_000.0)
ONE = SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(512)


def solver_and_checker(text, tokens):
    """The solver is right on even sums and says 0 otherwise; the checker accepts everything."""
    if text.endswith("?"):
        return "y"
    a, b = int(text[0]), int(text[2])
    return str(a + b) if (a + b) % 2 == 0 else "0" if a + b else "1"


def test_solve_check_turns_groups_tags_and_rewards(tokenizer):
    policy = ScriptedPolicy(tokenizer, solver_and_checker)
    env = SolveCheckEnv(max_operand=4)
    groups, metrics = env.sample(policy, 6, 3, ONE, np.random.default_rng(0), "train")
    # two turns, each one call holding every live episode
    assert [(len(c["prompts"]), c["n"]) for c in policy.calls] == [(18, 1), (18, 1)]
    assert len(groups) == 12 and all(len(g) == 3 for g in groups)
    assert len({g.group_id for g in groups}) == 12
    solver_groups, checker_groups = groups[:6], groups[6:]
    for sg, cg in zip(solver_groups, checker_groups):
        expr = sg.group_id.split(":")[1]
        assert sg.group_id.startswith(f"solve_check:{expr}:t0:solver:")
        assert cg.group_id.startswith(f"solve_check:{expr}:t1:checker:")
        right = (eval(expr, {"__builtins__": {}}) % 2) == 0  # our own "a+b" string
        for s, c in zip(sg.rollouts, cg.rollouts):
            assert (s.agent_name, c.agent_name) == ("solver", "checker")
            assert s.policy_name == c.policy_name == "policy"
            assert text_of(tokenizer, s.prompt_tokens) == f"<|bos|>{expr}="
            assert text_of(tokenizer, c.prompt_tokens) == f"<|bos|>{expr}={text_of(tokenizer, s.response_tokens)}?"
            assert text_of(tokenizer, c.response_tokens) == "y"
            assert s.episode_reward == float(right) and c.episode_reward == float(right)
            assert s.token_rewards.tolist() == [float(right)] and s.loss_mask.all()
            assert np.allclose(s.response_logprobs, LOGPROB)
    solver_right = np.mean([g.rollouts[0].episode_reward for g in solver_groups])
    assert metrics["solver/success_frac"] == pytest.approx(solver_right)
    assert metrics["checker/success_frac"] == pytest.approx(solver_right)  # "y" is right when the solver is
    assert metrics["checker/accepted_frac"] == 1.0 and metrics["solver/turns"] == 18
    assert metrics["n_samples"] == 36 and metrics["n_episodes"] == 18 and metrics["turns_mean"] == 2.0
    assert metrics["generate_calls"] == 2


def test_checker_sees_the_solvers_exact_tokens(tokenizer):
    # token 300 decodes to "<|reserved_37|>"; re-encoded text would be 15 byte tokens
    policy = ScriptedPolicy(tokenizer, lambda text, tokens: "n" if text.endswith("?") else [300], eos=True)
    groups, metrics = SolveCheckEnv().sample(policy, 2, 2, SamplingParams(max_tokens=4), np.random.default_rng(0),
                                             "train")
    for s, c in zip(groups[0].rollouts, groups[2].rollouts):
        assert s.response_tokens.tolist() == [300, tokenizer.eos_token_id]  # the EOS is trained
        assert c.prompt_tokens.tolist() == s.prompt_tokens.tolist() + [300, ord("?")]  # ... but not quoted
    assert metrics["checker/success_frac"] == 1.0 and metrics["solver/success_frac"] == 0.0


class RoundsEnv(MultiAgentEnv):
    """Three agents (two policies) for `max_rounds` rounds; `b` ends the episode when it says `stop`."""

    env_name = "rounds"

    def __init__(self, max_rounds):
        self.agents = (Agent("a"), Agent("b", policy="second"), Agent("c"))
        self.max_rounds = max_rounds

    def problems(self, n, rng, mode):
        return [Problem(prompt=f"p{i}", answer="", example_id=f"p{i}") for i in range(n)]

    def view(self, problem, agent, moves):
        return [problem.prompt, agent.name, *moves]

    def judge(self, problem, agent, moves):
        return Feedback(reward=float(len(moves)), done=moves[-1].text == "stop")


def test_turn_order_rounds_early_end_and_per_agent_policies(tokenizer):
    # in problem p1, agent b says "stop" in round 1: its episodes end there
    policy = ScriptedPolicy(tokenizer, lambda text, tokens: "stop" if text.startswith("p1b") else "x")
    groups, metrics = RoundsEnv(max_rounds=2).sample(policy, 2, 2, SamplingParams(max_tokens=4),
                                                      np.random.default_rng(0), "train")
    order = [(g.rollouts[0].agent_name, g.group_id.split(":")[1], g.group_id.split(":")[2]) for g in groups]
    assert order == [("a", "p0", "t0"), ("a", "p1", "t0"), ("b", "p0", "t1"), ("b", "p1", "t1"),
                     ("c", "p0", "t2"), ("a", "p0", "t3"), ("b", "p0", "t4"), ("c", "p0", "t5")]
    assert [len(c["prompts"]) for c in policy.calls] == [4, 4, 2, 2, 2, 2]
    assert {g.rollouts[0].policy_name for g in groups if g.rollouts[0].agent_name == "b"} == {"second"}
    assert {g.rollouts[0].policy_name for g in groups if g.rollouts[0].agent_name != "b"} == {"policy"}
    last = groups[-1].rollouts[0]  # agent c, round 2: sees every earlier move's exact tokens
    assert text_of(tokenizer, last.prompt_tokens) == "<|bos|>p0cxxxxx" and last.episode_reward == 6.0
    assert metrics["b/turns"] == 6 and metrics["c/turns"] == 4 and metrics["turns_mean"] == 4.0
    assert metrics["b/reward_mean"] == pytest.approx((2 + 2 + 2 + 2 + 5 + 5) / 6)
    assert metrics["b/success_frac"] == 0.0  # declared indicator, never reported: still present


def test_agent_configuration_errors():
    with pytest.raises(ValueError, match="Agent.name"):
        Agent("")
    with pytest.raises(ValueError, match="Agent.policy"):
        Agent("solver", policy="a/b")
    with pytest.raises(ValueError, match="unknown agents.*'judge'"):
        SolveCheckEnv(policies={"judge": "p2"})
    env = make_env(EnvConfig("solve_check", {"policies": {"checker": "critic"}}))
    assert [(a.name, a.policy) for a in env.agents] == [("solver", "policy"), ("checker", "critic")]
    env.agents = (Agent("x"), Agent("x"))
    with pytest.raises(ValueError, match="agent names must be unique"):
        env.sample(ScriptedPolicy(byte_tokenizer(512), lambda t, k: "y"), 1, 1, ONE, np.random.default_rng(0), "eval")
    assert Move("a", (1, 2), "xy").tokens == (1, 2)


def test_agent_and_policy_names_survive_storage_and_reach_eval_metrics(tokenizer, tmp_path):
    policy = ScriptedPolicy(tokenizer, solver_and_checker)
    env = SolveCheckEnv(policies={"checker": "critic"})
    groups, metrics = safe_sample(env, policy, lesson_id="duo", n_examples=4, n_generations=2, sampling=ONE,
                                  rng=np.random.default_rng(0), mode="train", metadata=META)
    assert metrics["duo/malformed_groups"] == 0 and len(groups) == 8
    writer = RolloutWriter(f"file://{tmp_path}/rollouts")
    writer.write(RolloutBatch(tuple(groups), META))
    (batch,) = RolloutReader(f"file://{tmp_path}/rollouts").read_new()
    assert [(r.agent_name, r.policy_name) for r in batch.rollouts] == [("solver", "policy")] * 8 + [
        ("checker", "critic")] * 8
    assert batch.rollouts == [r for g in groups for r in g.rollouts]
    # eval.py averages env metrics over calls: the per-agent success rates come through
    calls = [(4, {k.split("/", 1)[1]: v for k, v in metrics.items()})]
    out = lesson_metrics(calls, groups, samples=1, pass_threshold=1.0)
    assert out["solver/success_frac"] == metrics["duo/solver/success_frac"]
    assert out["checker/success_frac"] == metrics["duo/checker/success_frac"]


def test_solve_check_through_the_real_inference_server(tiny_server):
    ctx = RecordingContext(tiny_server)
    groups, metrics = safe_sample(SolveCheckEnv(), ctx, lesson_id="duo", n_examples=8, n_generations=4,
                                  sampling=SamplingParams(temperature=1.0, max_tokens=2),
                                  rng=np.random.default_rng(0), mode="train", metadata=META)
    assert metrics["duo/env_failures"] == 0 and metrics["duo/malformed_groups"] == 0
    assert len(groups) == 16 and all(len(g) == 4 for g in groups)
    assert [g.rollouts[0].agent_name for g in groups] == ["solver"] * 8 + ["checker"] * 8
    for sg, cg in zip(groups[:8], groups[8:]):
        for s, c in zip(sg.rollouts, cg.rollouts):
            quoted = [t for t in s.response_tokens.tolist() if t != ctx.tokenizer.eos_token_id]
            assert c.prompt_tokens.tolist() == s.prompt_tokens.tolist() + quoted + [ord("?")]
    assert len(ctx.prompts) == 64 and metrics["duo/generate_calls"] == 2
    # a random model almost never answers the sum, nor says y/n
    assert metrics["duo/solver/success_frac"] < 0.2 and metrics["duo/checker/success_frac"] < 0.2


class PersuadeEnv(SolveCheckEnv):
    """SolveCheckEnv, plus 0.5 for the solver, settled at the end, when the checker accepted."""

    def settle(self, problem, moves):
        accepted = moves[-1].text == "y"
        return [Feedback(reward=0.5 * accepted, indicators={"persuaded": float(accepted)}), Feedback()]


def test_settle_credits_earlier_moves_with_the_episodes_outcome(tokenizer):
    # the solver always answers "2" and the checker accepts only "2": every solver move is settled +0.5
    policy = ScriptedPolicy(tokenizer, lambda text, tokens: ("y" if text.endswith("2?") else "n")
                            if text.endswith("?") else "2")
    groups, metrics = PersuadeEnv().sample(policy, 3, 2, ONE, np.random.default_rng(0), "train")
    for sg in groups[:3]:
        right = sg.group_id.split(":")[1] in ("1+1", "0+2", "2+0")
        for s in sg.rollouts:  # every solver move says "2"; the checker accepts it
            assert s.episode_reward == float(right) + 0.5 and s.token_rewards.tolist() == [float(right) + 0.5]
    assert metrics["solver/persuaded_frac"] == 1.0 and "checker/persuaded_frac" not in metrics
    assert metrics["solver/reward_mean"] == pytest.approx(0.5 + metrics["solver/success_frac"])


def test_the_multi_agent_example_in_docs_environments_runs():
    from test_episodes import run_docs_example

    ns = run_docs_example("multi-agent")
    metrics, groups = ns["metrics"], ns["groups"]
    assert metrics["signal/env_failures"] == 0 and metrics["signal/malformed_groups"] == 0
    assert [g.rollouts[0].agent_name for g in groups] == ["speaker"] * 4 + ["listener"] * 4
    assert metrics["signal/speaker/success_frac"] == metrics["signal/listener/success_frac"]
    for s, listener in zip(groups[0].rollouts, groups[4].rollouts):  # the speaker is paid what its listener earned
        assert s.episode_reward == listener.episode_reward
