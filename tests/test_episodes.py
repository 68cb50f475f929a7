"""Multi-turn episodes (envs/episode.py) and the multi-turn games (envs/games.py): token layout,
masks, reward placement, budgets and truncation, the exact token-prefix property, one generate call
per turn, metrics; through a scripted policy, and through the real inference server."""

from __future__ import annotations

import collections
import pathlib
import re

import numpy as np
import pytest

from marinrl.config.env import EnvConfig
from marinrl.envs import Feedback, MultiTurnEnv, Problem, make_env, safe_sample
from marinrl.envs.games import DIGITS, CalculatorEnv, GuessEnv
from marinrl.inference.context import Generation, SamplingParams
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.types import RolloutMetadata

REPO = pathlib.Path(__file__).resolve().parent.parent
META = RolloutMetadata(worker_id="worker-1", weight_step=3, created_at=1_700_000_000.0)
LOGPROB = -0.25


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(512)


class ScriptedPolicy:
    """TEST DOUBLE standing in for the policy model only (a model cannot be told what to answer):
    the real byte tokenizer, and each turn chosen by `respond(prompt_text, prompt_tokens)`, which
    returns text or a list of token ids. It records every call's prompts, n and max_tokens, and
    honours max_tokens like the real sampler (finish_reason "length" when cut)."""

    def __init__(self, tokenizer, respond, eos: bool = False):
        self.tokenizer = tokenizer
        self.respond = respond
        self.eos = eos
        self.calls: list[dict] = []

    def generate(self, prompts, n, sampling, seed):
        self.calls.append({"prompts": [list(map(int, p)) for p in prompts], "n": n,
                           "max_tokens": sampling.max_tokens})
        out = []
        for prompt in prompts:
            answer = self.respond(self.tokenizer.decode(list(prompt), skip_special_tokens=True), list(prompt))
            tokens = (list(self.tokenizer.encode(answer, add_special_tokens=False)) if isinstance(answer, str)
                      else list(answer))
            tokens += [self.tokenizer.eos_token_id] if self.eos else []
            reason = "stop" if self.eos and len(tokens) <= sampling.max_tokens else "length"
            tokens = tokens[: sampling.max_tokens]
            out.append([Generation(np.asarray(tokens, np.int32), np.full(len(tokens), LOGPROB, np.float32), reason)
                        for _ in range(n)])
        return out


def binary_search(text, tokens):
    """A perfect guesser of 0..9: bisects the range the answers so far leave."""
    low, high = 0, 9
    for guess, answer in re.findall(r"(\d)([+-])", text):
        low, high = (int(guess) + 1, high) if answer == "+" else (low, int(guess) - 1)
    return str((low + high) // 2)


def text_of(tokenizer, ids):
    return tokenizer.decode([int(t) for t in ids])


# --------------------------------------------------------------------------- the episode layout


class ChatterEnv(MultiTurnEnv):
    """Never done: answers every turn with `ok`, reward 1 per turn."""

    env_name = "chatter"

    def __init__(self, max_turns=10, max_episode_tokens=12):
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens

    def problems(self, n, rng, mode):
        return [Problem(prompt=f"hi{i}", answer="", example_id=str(i)) for i in range(n)]

    def step(self, problem, actions):
        return Feedback(reward=1.0, observation="ok")


def test_guess_episode_layout_masks_rewards_and_logprobs(tokenizer):
    policy = ScriptedPolicy(tokenizer, binary_search)
    env = GuessEnv(n_values=10, max_turns=4, turn_penalty=0.1, valid_reward=0.1, higher="+", lower="-")
    groups, metrics = env.sample(policy, 10, 2, SamplingParams(max_tokens=1), np.random.default_rng(0), "train")
    seen = set()
    for g in groups:
        hidden = int(g.group_id.split(":")[1])
        seen.add(hidden)
        for r in g.rollouts:
            assert text_of(tokenizer, r.prompt_tokens) == "<|bos|>?"
            response = text_of(tokenizer, r.response_tokens)
            guesses = response[0::2]
            assert guesses[-1] == str(hidden) and r.finish_reason == "stop"
            for guess, answer in zip(guesses, response[1::2]):  # each observation answers its guess
                assert answer == ("+" if hidden > int(guess) else "-")
            assert r.loss_mask.tolist() == [i % 2 == 0 for i in range(len(response))]
            np.testing.assert_allclose(r.response_logprobs, np.where(r.loss_mask, LOGPROB, 0.0))
            k = len(guesses) - 1
            expected = np.zeros(len(response), np.float32)
            expected[0:-1:2] = 0.1  # every wrong guess of a bisection is consistent: valid_reward
            expected[-1] = 1.0 - 0.1 * k  # the finding guess, on the last token of the last turn
            np.testing.assert_allclose(r.token_rewards, expected, atol=1e-6)
            assert r.episode_reward == pytest.approx(expected.sum())
    hidden_3 = next(r for g in groups for r in g.rollouts if g.group_id.split(":")[1] == "3")
    assert text_of(tokenizer, hidden_3.response_tokens) == "4-1+2+3"  # bisection: 4, 1, 2, 3
    assert len(seen) > 3
    assert metrics["success_frac"] == 1.0 and metrics["truncated_frac"] == 0.0
    assert 1 <= metrics["turns_mean"] <= 4 and metrics["n_samples"] == 20


def test_each_turn_prompt_is_exactly_the_tokens_so_far(tokenizer):
    # Token 300 decodes to "<|reserved_37|>": text that would re-encode to 15 byte tokens. The next
    # prompt must hold token 300 itself, and the observation's own tokens.
    policy = ScriptedPolicy(tokenizer, lambda text, tokens: [300, ord("x")])
    groups, _ = ChatterEnv(max_turns=3, max_episode_tokens=32).sample(
        policy, 2, 3, SamplingParams(max_tokens=2), np.random.default_rng(0), "train")
    sent = collections.Counter(tuple(p) for call in policy.calls for p in call["prompts"])
    expected = collections.Counter()
    for r in (r for g in groups for r in g.rollouts):
        full = r.prompt_tokens.tolist() + r.response_tokens.tolist()
        starts = [i for i, m in enumerate(r.loss_mask) if m and (i == 0 or not r.loss_mask[i - 1])]
        for s in starts:  # turn k's prompt: the prompt, then the response up to the turn's first token
            expected[tuple(full[: r.prompt_tokens.size + s])] += 1
        assert text_of(tokenizer, r.response_tokens) == "<|reserved_37|>xok" * 2 + "<|reserved_37|>x"
    assert sent == expected and len(policy.calls) == 3 and sum(expected.values()) == 18


def test_each_turn_of_all_live_episodes_is_one_generate_call(tokenizer):
    # hidden digits differ in how many bisection turns they take: later calls hold fewer prompts
    policy = ScriptedPolicy(tokenizer, binary_search)
    env = GuessEnv(max_turns=4, higher="+", lower="-")
    groups, metrics = env.sample(policy, 8, 4, SamplingParams(max_tokens=1), np.random.default_rng(1), "train")
    turns = [int(r.loss_mask.sum()) for g in groups for r in g.rollouts]
    assert [len(c["prompts"]) for c in policy.calls] == [sum(t > k for t in turns) for k in range(max(turns))]
    assert all(c["n"] == 1 for c in policy.calls) and len(policy.calls[0]["prompts"]) == 32
    assert metrics["generate_calls"] == len(policy.calls) == max(turns)


# --------------------------------------------------------------------------- budgets and truncation


def test_turn_budget_truncates_and_drops_the_last_observation(tokenizer):
    policy = ScriptedPolicy(tokenizer, lambda text, tokens: "@")  # calls the tool forever
    env = CalculatorEnv(max_turns=3, call_reward=0.2)
    groups, metrics = env.sample(policy, 1, 2, SamplingParams(max_tokens=1), np.random.default_rng(0), "train")
    r = groups[0].rollouts[0]
    value = groups[0].group_id.split(":")[1]
    answer = str(eval(value, {"__builtins__": {}}))  # our own "a+b" / "a-b" string
    assert text_of(tokenizer, r.response_tokens) == f"@={answer}@={answer}@"
    assert r.loss_mask.tolist() == [1, 0, 0, 1, 0, 0, 1]
    assert r.token_rewards.tolist() == pytest.approx([0.2, 0, 0, -0.2, 0, 0, -0.2])  # only the first call pays
    assert r.finish_reason == "length" and r.episode_reward == pytest.approx(-0.2)
    assert metrics["truncated_frac"] == 1.0 and metrics["turns_mean"] == 3.0 and metrics["success_frac"] == 0.0
    assert metrics["called_frac"] == 1.0 and len(policy.calls) == 3


def test_token_budget_shrinks_max_tokens_and_truncates(tokenizer):
    # episode 0 says "abcdef"+EOS (7 tokens), episode 1 says "ab"+EOS (3 tokens), every turn
    policy = ScriptedPolicy(tokenizer, lambda text, tokens: "abcdef" if text.startswith("hi0") else "ab", eos=True)
    groups, metrics = ChatterEnv().sample(policy, 2, 1, SamplingParams(max_tokens=8), np.random.default_rng(0),
                                          "train")
    long, short = groups[0].rollouts[0], groups[1].rollouts[0]
    # long: 7 + "ok" = 9; 3 tokens left: turn 2 is cut to "abc" (finish length), then no room for "ok"
    assert text_of(tokenizer, long.response_tokens) == "abcdef<|eos|>okabc"
    assert long.response_tokens.size == 12 and long.finish_reason == "length"
    assert long.loss_mask.tolist() == [1] * 7 + [0, 0] + [1] * 3
    assert long.token_rewards.tolist() == [0] * 6 + [1, 0, 0, 0, 0, 1]
    # short: "ab<eos>ok" (5) twice = 10, then 2 tokens left: "ab" cut before its EOS, no room for "ok"
    assert text_of(tokenizer, short.response_tokens) == "ab<|eos|>okab<|eos|>okab"
    assert short.finish_reason == "length" and short.episode_reward == 3.0
    # each call asks for the most any live episode may use: 8, then max(3, 7), then 2
    assert [c["max_tokens"] for c in policy.calls] == [8, 7, 2]
    assert [len(c["prompts"]) for c in policy.calls] == [2, 2, 1]
    assert metrics["truncated_frac"] == 1.0 and metrics["turns_mean"] == 2.5


def test_budgets_and_arguments_are_checked():
    with pytest.raises(ValueError, match="n_values must be in"):
        GuessEnv(n_values=11)
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        GuessEnv(max_turns=0)
    with pytest.raises(ValueError, match="max_episode_tokens must be >= 1"):
        CalculatorEnv(max_episode_tokens=0)
    with pytest.raises(ValueError, match="call must be"):
        CalculatorEnv(call="1")
    with pytest.raises(ValueError, match="Feedback.reward must be finite"):
        Feedback(reward=float("nan"))


# --------------------------------------------------------------------------- the games' rules


def test_guess_rules():
    env = GuessEnv(n_values=10, turn_penalty=0.1, valid_reward=0.1, higher="+", lower="-")
    p = Problem(prompt="?", answer="3", example_id="3")
    assert env.step(p, ["5"]) == Feedback(reward=0.1, observation="-")
    assert env.step(p, ["1"]) == Feedback(reward=0.1, observation="+")
    assert env.step(p, ["5", "7"]) == Feedback(reward=0.0, observation="-")  # 7 was ruled out by "5-"
    found = env.step(p, ["5", "1", "3"])
    assert found.reward == pytest.approx(0.8) and found.done and found.indicators == {"success": 1.0}
    assert env.step(p, ["x"]).truncated and env.step(p, ["33"]).truncated
    assert GuessEnv(n_values=4).step(p, ["7"]).truncated  # outside 0..3
    assert make_env(EnvConfig("guess", {"n_values": 4})).n_values == 4
    lettered = GuessEnv()  # default: one byte names the direction and the guess
    assert lettered.step(p, ["5"]).observation == "F" and lettered.step(p, ["1"]).observation == "b"
    with pytest.raises(ValueError, match="one symbol or ten"):
        GuessEnv(higher="ab")
    with pytest.raises(ValueError, match="share no symbol"):
        GuessEnv(higher="+", lower="+")


def test_calculator_rules():
    env = CalculatorEnv(call_reward=0.2)
    p = Problem(prompt="3+4:", answer="7", example_id="3+4")
    assert env.step(p, ["@"]) == Feedback(reward=0.2, observation="=7", indicators={"called": 1.0})
    assert env.step(p, ["@", "@"]).reward == -0.2
    assert env.step(p, ["@", "7"]) == Feedback(reward=1.0, done=True, indicators={"success": 1.0, "called": 1.0})
    assert env.step(p, ["7"]) == Feedback(reward=1.0, done=True, indicators={"success": 1.0, "called": 0.0})
    assert env.step(p, ["@", "8"]).reward == 0.0 and env.step(p, ["@", "8"]).done
    problems = env.problems(2000, np.random.default_rng(0), "train")
    for q in problems:
        a, op, b = q.example_id
        assert q.prompt == f"{q.example_id}:" and int(q.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    counts = collections.Counter(q.answer for q in problems)  # answers near uniform: no digit pays for every prompt
    assert sorted(counts) == list(DIGITS) and max(counts.values()) < 2 * min(counts.values())
    assert {q.example_id for q in CalculatorEnv(max_operand=2, ops="-").problems(100, np.random.default_rng(0),
                                                                                   "eval")} == {
        "0-0", "1-0", "2-0", "1-1", "2-1", "2-2"}
    assert isinstance(make_env(EnvConfig("calculator")), CalculatorEnv)


def test_calculator_tool_then_answer_scores_and_reports(tokenizer):
    def respond(text, tokens):  # call once, then copy the tool's digit
        m = re.search(r"=(\d)$", text)
        return m.group(1) if m else "@"

    policy = ScriptedPolicy(tokenizer, respond)
    groups, metrics = safe_sample(CalculatorEnv(), policy, lesson_id="calc", n_examples=4, n_generations=3,
                                  sampling=SamplingParams(max_tokens=1), rng=np.random.default_rng(0), mode="train",
                                  metadata=META)
    assert len(groups) == 4 and all(len(g) == 3 for g in groups)
    for r in (r for g in groups for r in g.rollouts):
        assert r.metadata == META and r.lesson_id == "calc" and r.finish_reason == "stop"
        assert r.loss_mask.tolist() == [1, 0, 0, 1] and r.token_rewards.tolist() == pytest.approx([0.2, 0, 0, 1.0])
    assert metrics["calc/success_frac"] == 1.0 and metrics["calc/called_frac"] == 1.0
    assert metrics["calc/reward_mean"] == pytest.approx(1.2) and metrics["calc/turns_mean"] == 2.0
    assert metrics["calc/generate_calls"] == 2 and metrics["calc/malformed_groups"] == 0


# --------------------------------------------------------------------------- the real server


class RecordingContext:
    """Passes every call to the real server and keeps the prompts it was asked (a spy, not a double)."""

    def __init__(self, server):
        self.server, self.prompts = server, []

    @property
    def tokenizer(self):
        return self.server.tokenizer

    def generate(self, prompts, n, sampling, seed):
        self.prompts += [tuple(map(int, p)) for p in prompts]
        return self.server.generate(prompts, n, sampling, seed)


@pytest.mark.parametrize("env", [GuessEnv(n_values=10, max_turns=4), CalculatorEnv(max_turns=3)],
                         ids=["guess", "calculator"])
def test_games_through_the_real_inference_server(tiny_server, env):
    ctx = RecordingContext(tiny_server)
    groups, metrics = safe_sample(env, ctx, lesson_id="game", n_examples=8, n_generations=4,
                                  sampling=SamplingParams(temperature=1.0, max_tokens=2),
                                  rng=np.random.default_rng(0), mode="train", metadata=META)
    assert metrics["game/env_failures"] == 0 and metrics["game/malformed_groups"] == 0
    assert len(groups) == 8 and all(len(g) == 4 for g in groups)
    expected = collections.Counter()
    for r in (r for g in groups for r in g.rollouts):
        assert r.response_tokens.size <= env.max_episode_tokens and (r.response_logprobs <= 0).all()
        assert (r.response_logprobs[~r.loss_mask] == 0).all() and r.loss_mask[0] and r.loss_mask[-1]
        assert r.token_rewards.sum() == pytest.approx(r.episode_reward)
        assert not r.token_rewards[~r.loss_mask].any()  # rewards sit on model tokens only
        full = r.prompt_tokens.tolist() + r.response_tokens.tolist()
        for s in [i for i, m in enumerate(r.loss_mask) if m and (i == 0 or not r.loss_mask[i - 1])]:
            expected[tuple(full[: r.prompt_tokens.size + s])] += 1
    assert collections.Counter(ctx.prompts) == expected
    # A random model almost never plays a valid action: most episodes end after one turn.
    assert metrics["game/turns_mean"] < 1.5 and metrics["game/reward_mean"] < 0.2


# --------------------------------------------------------------------------- the docs example


def run_docs_example(marker: str) -> dict:
    """Runs the one ```python block of docs/environments.md marked `# example: <marker>`."""
    text = (REPO / "docs" / "environments.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if f"# example: {marker}\n" in b]
    assert len(blocks) == 1, f"docs/environments.md must hold one block marked '# example: {marker}'"
    assert blocks[0].count("\n") < 80, f"the {marker} example must stay under 80 lines"
    namespace: dict = {"__name__": f"docs_example_{marker}"}
    exec(compile(blocks[0], "docs/environments.md", "exec"), namespace)
    return namespace


def test_the_multi_turn_example_in_docs_environments_runs():
    ns = run_docs_example("multi-turn")
    assert ns["metrics"]["retry/env_failures"] == 0 and ns["metrics"]["retry/malformed_groups"] == 0
    assert len(ns["groups"]) == 4 and all(len(g) == 8 for g in ns["groups"])
    episode = ns["episode"]
    assert episode.loss_mask.tolist() == [i % 2 == 0 for i in range(episode.response_tokens.size)]
