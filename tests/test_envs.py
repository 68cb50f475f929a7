"""Environments: registry, graders, problem generators, dataset loading, `sample` end to end (through a
scripted test double of the model, and through the real inference server with a tiny random model),
and `safe_sample`'s failure isolation with deliberately broken environments."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import pathlib
import re
import threading

import numpy as np
import pytest

from marinrl.config.env import EnvConfig
from marinrl.envs import (
    UNSTAMPED,
    UNSTAMPED_LESSON,
    EchoEnv,
    MathDatasetEnv,
    ParityEnv,
    completion_text,
    encode_prompt,
    make_env,
    make_rollout,
    new_group_id,
    register_env,
    registered_envs,
    safe_sample,
)
from marinrl.envs.math import (
    ArithmeticEnv,
    arithmetic_problem,
    final_answer,
    grade_math,
    load_math_problems,
    parse_gold,
)
from marinrl.envs.toy import grade_answer
from marinrl.inference.context import Generation, SamplingParams
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.types import RolloutGroup, RolloutMetadata

REPO = pathlib.Path(__file__).resolve().parent.parent
VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(VOCAB)


class ScriptedContext:
    """TEST DOUBLE standing in for the policy model only (a model cannot be told what to answer):
    the real byte tokenizer, and each response chosen by `respond(prompt_text, sample_index)`, so
    rewards can be checked exactly. Everything else under test (envs, graders, rollouts) is real."""

    def __init__(self, tokenizer, respond, stop: bool = True):
        self.tokenizer = tokenizer
        self.respond = respond
        self.stop = stop
        self.calls: list[tuple[int, int, int]] = []  # (n prompts, n, seed)

    def generate(self, prompts, n, sampling, seed):
        self.calls.append((len(prompts), n, seed))
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(list(prompt), skip_special_tokens=True)
            row = []
            for j in range(n):
                tokens = self.tokenizer.encode(self.respond(text, j), add_special_tokens=False)
                if self.stop:
                    tokens = tokens + [self.tokenizer.eos_token_id]
                tokens = tokens[: sampling.max_tokens]
                row.append(Generation(np.asarray(tokens, np.int32), np.full(len(tokens), -0.25, np.float32),
                                      "stop" if self.stop else "length"))
            out.append(row)
        return out


SAMPLING = SamplingParams(temperature=1.0, max_tokens=8)


# ------------------------------------------------------------------------------ registry


def test_registry_builds_by_short_name_and_by_dotted_path():
    assert {"echo", "parity", "arithmetic", "math"} <= set(registered_envs())
    env = make_env(EnvConfig("echo", {"alphabet_size": 4, "length": 2}))
    assert isinstance(env, EchoEnv) and env.alphabet == "abcd" and env.length == 2
    assert isinstance(make_env(EnvConfig("marinrl.envs.toy.ParityEnv", {"n_bits": 3})), ParityEnv)
    assert isinstance(make_env(EnvConfig("marinrl.envs.toy:ParityEnv")), ParityEnv)
    assert isinstance(make_env(EnvConfig("arithmetic", {"difficulty": 2})), ArithmeticEnv)


def test_each_builtin_name_is_registered_by_the_module_the_lazy_table_names():
    """`registry.BUILTIN_ENVS` is what makes a built-in name importable on demand: a module that registers a
    name the table lacks (or under another module) would make that name unknown to a fresh process."""
    import importlib

    from marinrl.envs import registry

    registered_by: dict[str, str] = {}
    for module in sorted(set(registry.BUILTIN_ENVS.values())):
        importlib.import_module(f"marinrl.envs.{module}")
    for name, cls in registry._REGISTRY.items():
        if cls.__module__.startswith("marinrl.envs."):
            registered_by[name] = cls.__module__.removeprefix("marinrl.envs.")
    assert registered_by == registry.BUILTIN_ENVS


def test_a_fresh_process_imports_only_the_environment_it_builds():
    """Every actor imports marinrl.envs (job_actors); the task modules come only with a config naming them."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "import marinrl.job.actors, marinrl.envs\n"
        "before = sorted(m for m in sys.modules if m.startswith('marinrl.envs.') or m in ('openai', 'sympy'))\n"
        "from marinrl.envs import EnvConfig, make_env\n"
        "make_env(EnvConfig('echo', {}))\n"
        "after = sorted(m for m in sys.modules if m.startswith('marinrl.envs.') or m in ('openai', 'sympy'))\n"
        "print(json.dumps([before, after]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == ["marinrl.envs.base", "marinrl.envs.registry"]
    assert "marinrl.envs.toy" in after and "marinrl.envs.openai_env" not in after and "openai" not in after


def test_registry_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"unknown environment 'nope'.*echo"):
        make_env(EnvConfig("nope"))
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        make_env(EnvConfig("no_such_pkg.mod.Env"))
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        make_env(EnvConfig("marinrl.envs.toy.Missing"))
    with pytest.raises(TypeError, match="not a class with a sample"):
        make_env(EnvConfig("marinrl.envs.toy.grade_answer"))
    with pytest.raises(ValueError, match=r"environment 'echo' rejected args \{'size': 3\}"):
        make_env(EnvConfig("echo", {"size": 3}))
    with pytest.raises(ValueError, match="alphabet_size must be in"):
        make_env(EnvConfig("echo", {"alphabet_size": 1}))


def test_register_env_refuses_a_taken_name_and_classes_without_sample():
    with pytest.raises(ValueError, match="already registered"):
        register_env("echo")(ParityEnv)
    with pytest.raises(TypeError, match="no sample"):
        register_env("not_an_env")(type("NotAnEnv", (), {}))
    with pytest.raises(ValueError, match="without '.'"):
        register_env("a.b")


def test_env_config_reads_from_yaml_with_draccus():
    import draccus

    cfg = draccus.load(EnvConfig, io.StringIO("name: echo\nargs: {alphabet_size: 6, reverse: true}\n"))
    env = make_env(cfg)
    assert isinstance(env, EchoEnv) and env.alphabet == "abcdef" and env.reverse


# ------------------------------------------------------------------------------ toy tasks


@pytest.mark.parametrize(
    "response, answer, reward, correct",
    [
        ("a", "a", 1.0, 1.0),
        ("b", "a", 0.0, 0.0),
        ("", "a", 0.0, 0.0),
        ("ab", "ab", 1.0, 1.0),
        ("ax", "ab", 0.5, 0.0),   # per-position credit
        ("ba", "ab", 0.0, 0.0),   # positions, not a bag of letters
        ("a", "ab", 0.5, 0.0),    # stopped early
        ("abc", "ab", 0.5, 0.0),  # trailing text halves the credit
        ("a<|reserved_3|>", "a", 0.5, 0.0),
    ],
)
def test_grade_answer(response, answer, reward, correct):
    g = grade_answer(response, answer)
    assert g.reward == pytest.approx(reward) and g.indicators["correct"] == correct


def test_echo_and_parity_problems_carry_their_answers():
    rng = np.random.default_rng(0)
    for p in EchoEnv(alphabet_size=5, length=3).problems(50, rng, "train"):
        s = p.prompt[:-1]
        assert p.prompt == f"{s}=" and p.answer == s and set(s) <= set("abcde") and len(s) == 3
    for p in EchoEnv(alphabet_size=26, length=2, reverse=True).problems(50, rng, "train"):
        assert p.prompt.endswith("<") and p.answer == p.prompt[:-1][::-1]
    seen = set()
    for p in ParityEnv(n_bits=4).problems(200, rng, "train"):
        bits = p.prompt[:-1]
        assert p.answer == str(sum(map(int, bits)) % 2) and len(bits) == 4
        seen.add(p.answer)
    assert seen == {"0", "1"}


def test_echo_context_and_holdout_split_the_prompts():
    env = EchoEnv(alphabet_size=10, length=1, context=2, holdout=0.2)
    rng = np.random.default_rng(0)
    train = env.problems(2000, rng, "train")
    evals = env.problems(500, rng, "eval")
    for p in train + evals:  # the answer is the last letter; the two before it are distractors
        assert len(p.prompt) == 4 and p.prompt[-1] == "=" and p.answer == p.prompt[-2]
    train_ids, eval_ids = {p.example_id for p in train}, {p.example_id for p in evals}
    assert not train_ids & eval_ids  # held out: no eval prompt is ever drawn for training
    assert len(train_ids | eval_ids) > 800 and 0.1 < len(eval_ids) / len(train_ids | eval_ids) < 0.3
    assert {p.answer for p in evals} == {p.answer for p in train} == set("abcdefghij")  # every answer on both sides
    assert EchoEnv(alphabet_size=10, context=2).problems(1, np.random.default_rng(3), "eval")  # no holdout: any prompt
    digits = EchoEnv(alphabet_size=10, context=2, context_alphabet="0123456789", holdout=0.2)
    for p in digits.problems(200, rng, "eval"):  # digits as distractors: `37c=` answers `c`
        assert p.prompt[:2].isdigit() and p.answer == p.prompt[2] and p.answer in "abcdefghij"
        assert digits.is_held_out(p.example_id)
    with pytest.raises(ValueError, match="context_alphabet must be distinct"):
        EchoEnv(context=1, context_alphabet="00")
    with pytest.raises(ValueError, match="holdout=0.2 of only 10 prompts"):
        EchoEnv(alphabet_size=10, length=1, holdout=0.2)
    with pytest.raises(ValueError, match="holdout must be in"):
        EchoEnv(holdout=1.0)


def test_arithmetic_answers_match_python_arithmetic():
    rng = np.random.default_rng(1)
    for difficulty in range(1, 8):
        for _ in range(50):
            expr, value = arithmetic_problem(difficulty, rng)
            assert re.fullmatch(r"[0-9+\-* ()]+", expr)
            assert eval(expr, {"__builtins__": {}}) == value, (difficulty, expr)  # our own digits-and-operators string
    assert all("(" in arithmetic_problem(4, rng)[0] for _ in range(20))
    assert all("(" not in arithmetic_problem(3, rng)[0] for _ in range(20))


# ------------------------------------------------------------------------------ math grading


@pytest.mark.parametrize(
    "response, gold, reward, failed",
    [
        ("So the answer is \\boxed{72}.", "72", 1.0, 0.0),
        ("3 * 24 = 72\n#### 72", "72", 1.0, 0.0),
        ("The total is 1,234 apples.", "1234", 1.0, 0.0),
        ("\\boxed{1234}", "1,234", 1.0, 0.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, 0.0),
        ("\\boxed{4.5}", "4.5", 1.0, 0.0),
        ("\\boxed{-3}", "-3", 1.0, 0.0),
        ("\\boxed{71}", "72", 0.0, 0.0),
        ("first 12, then \\boxed{13}", "12", 0.0, 0.0),
        ("I do not know.", "72", 0.0, 1.0),
        ("", "72", 0.0, 1.0),
    ],
)
def test_grade_math(response, gold, reward, failed):
    g = grade_math(response, parse_gold(gold))
    assert g.reward == reward and g.indicators == {"correct": reward, "extraction_failed": failed}


def test_grade_math_works_off_the_main_thread():
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("g", grade_math("\\boxed{9}", parse_gold("9"))))
    thread.start()
    thread.join()
    assert out["g"].reward == 1.0


def test_final_answer_and_bad_gold():
    assert final_answer("reasoning #### 1,250 ") == "1,250"
    assert final_answer("42") == "42"
    with pytest.raises(ValueError, match="cannot be parsed"):
        parse_gold("")


# ------------------------------------------------------------------------------ math datasets


ROWS = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}, {"question": "Half of 9?", "answer": "4.5"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_shipped_gsm8k_mini_loads_and_every_gold_answer_parses():
    env = MathDatasetEnv()
    assert len(env.train) == 25 and len(env.eval) == 8
    assert {p.example_id for p in env.train}.isdisjoint({p.example_id for p in env.eval})
    assert all(parse_gold(p.answer) for p in env.train + env.eval)


def test_load_math_problems_from_jsonl_parquet_folders_and_hf_datasets(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = _jsonl(tmp_path / "a.jsonl", ROWS)
    got = load_math_problems(jsonl)
    assert [(p.prompt, p.answer, p.example_id) for p in got] == [
        ("What is 2 + 3?", "5", "a.jsonl#0"), ("Half of 9?", "4.5", "a.jsonl#1")]
    pq.write_table(pa.Table.from_pylist([{"q": "One plus one?", "a": 2}]), tmp_path / "b.parquet")
    assert [(p.prompt, p.answer) for p in load_math_problems(str(tmp_path / "b.parquet"), "q", "a")] == [
        ("One plus one?", "2")]
    folder = tmp_path / "folder"
    folder.mkdir()
    _jsonl(folder / "x.jsonl", ROWS)
    _jsonl(folder / "y.jsonl", ROWS[:1])
    assert len(load_math_problems(f"file://{folder}")) == 3
    hf = tmp_path / "hf"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(hf))
    assert [p.answer for p in load_math_problems(str(hf))] == ["5", "4.5"]
    hf_dict = tmp_path / "hf_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(hf_dict))
    with pytest.raises(ValueError, match="DatasetDict with splits.*train"):
        load_math_problems(str(hf_dict))


def test_load_math_problems_errors_name_the_file_and_row(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_math_problems(str(tmp_path / "missing.jsonl"))
    bad = _jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"question": "Q?", "answer": "no final answer here ####"}])
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: gold answer '' cannot be parsed"):
        load_math_problems(bad)
    with pytest.raises(ValueError, match=r"row 0: no field 'answer'"):
        load_math_problems(_jsonl(tmp_path / "nofield.jsonl", [{"question": "Q?"}]))
    (tmp_path / "broken.jsonl").write_text('{"question": "Q?", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_math_problems(str(tmp_path / "broken.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .jsonl"):
        load_math_problems(str(tmp_path / "empty"))


def test_math_env_eval_mode_draws_from_the_eval_set_without_repeats(tmp_path, caplog):
    env = MathDatasetEnv()
    rng = np.random.default_rng(0)
    eval_ids = {p.example_id for p in env.eval}
    drawn = env.problems(8, rng, "eval")
    assert {p.example_id for p in drawn} == eval_ids  # all 8, no repeats
    assert all(p.prompt.endswith("\\boxed{}.") for p in drawn)
    assert not {p.example_id for p in env.problems(20, rng, "train")} & eval_ids
    with caplog.at_level(logging.WARNING):
        only_train = MathDatasetEnv(path=_jsonl(tmp_path / "t.jsonl", ROWS))
    assert "no eval_path" in caplog.text and only_train.eval is only_train.train


# ------------------------------------------------------------------------------ prompts and text


def test_encode_prompt_raw_and_chat(tokenizer):
    raw = encode_prompt(tokenizer, "ab=", chat=False)
    assert raw == [tokenizer.bos_token_id, ord("a"), ord("b"), ord("=")]
    chat = encode_prompt(tokenizer, "hi", chat=True)
    assert tokenizer.decode(chat) == "<|bos|><|user|>hi<|eos|><|assistant|>"
    no_template = byte_tokenizer(VOCAB)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(no_template, "hi", chat=True)


def test_completion_text_strips_only_what_ended_the_turn(tokenizer):
    eos = tokenizer.eos_token_id

    def gen(ids, reason):
        return Generation(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), reason)

    stop_nl = SamplingParams(stop_sequences=((ord("\n"),),))
    assert completion_text(tokenizer, gen([ord("a"), eos], "stop"), SAMPLING) == "a"
    assert completion_text(tokenizer, gen([ord("a"), ord("\n")], "stop"), stop_nl) == "a"
    assert completion_text(tokenizer, gen([ord("a"), ord("\n")], "length"), stop_nl) == "a\n"
    assert completion_text(tokenizer, gen([ord("a"), 300], "length"), SAMPLING) == "a<|reserved_37|>"


# ------------------------------------------------------------------------------ sample end to end


def test_echo_sample_groups_rewards_and_metrics(tokenizer):
    # sample j of every prompt answers right when j is even, wrong ("z") when odd
    ctx = ScriptedContext(tokenizer, lambda text, j: text[:-1] if j % 2 == 0 else "z")
    env = EchoEnv(alphabet_size=4, length=2)
    rng = np.random.default_rng(0)
    groups, metrics = env.sample(ctx, 5, 4, SAMPLING, rng, "train")
    assert ctx.calls[0][:2] == (5, 4) and len(ctx.calls) == 1  # all prompts in one call
    assert len(groups) == 5 and all(len(g) == 4 for g in groups)
    assert len({g.group_id for g in groups}) == 5 and all(g.group_id.startswith("echo:") for g in groups)
    for g in groups:
        np.testing.assert_array_equal(g.rewards, [1.0, 0.0, 1.0, 0.0])
        for r in g.rollouts:
            answer = tokenizer.decode(r.prompt_tokens[1:-1].tolist())
            assert r.prompt_tokens[0] == tokenizer.bos_token_id
            assert r.response_tokens[-1] == tokenizer.eos_token_id and r.finish_reason == "stop"
            assert r.loss_mask.all() and np.allclose(r.response_logprobs, -0.25)
            assert r.token_rewards[-1] == r.episode_reward and not r.token_rewards[:-1].any()
            assert r.metadata == UNSTAMPED and r.lesson_id == UNSTAMPED_LESSON
            assert r.env_name == "echo" and r.temperature == 1.0 and len(answer) == 2
    assert metrics == pytest.approx({
        "reward_mean": 0.5, "reward_std": 0.5, "response_tokens_mean": 2.5,  # "ab"+EOS, "z"+EOS
        "truncated_frac": 0.0,
        "zero_variance_groups_frac": 0.0, "n_samples": 20.0, "correct_frac": 0.5, "correct_count": 10.0})
    again, _ = env.sample(ctx, 5, 4, SAMPLING, rng, "train")
    assert not {g.group_id for g in groups} & {g.group_id for g in again}  # unique across calls


def test_same_rng_seed_gives_the_same_problems_and_sampler_seed(tokenizer):
    ctx = ScriptedContext(tokenizer, lambda text, j: "a")
    env = ParityEnv(n_bits=3)
    a, _ = env.sample(ctx, 6, 2, SAMPLING, np.random.default_rng(7), "eval")
    b, _ = env.sample(ctx, 6, 2, SAMPLING, np.random.default_rng(7), "eval")
    assert [g.rollouts[0].prompt_tokens.tolist() for g in a] == [g.rollouts[0].prompt_tokens.tolist() for g in b]
    assert ctx.calls[0][2] == ctx.calls[1][2]


def test_math_sample_counts_extraction_failures(tokenizer):
    answers = {p.prompt: p.answer for p in MathDatasetEnv().eval}

    def respond(text, j):
        question = text.removeprefix("<|user|>").split("<|eos|>")[0]
        gold = next(a for q, a in answers.items() if question.startswith(q))
        return [f"The answer is \\boxed{{{gold}}}", "I am not sure.", "\\boxed{123456789}"][j]

    groups, metrics = MathDatasetEnv().sample(ScriptedContext(tokenizer, respond), 4, 3, SamplingParams(max_tokens=64),
                                              np.random.default_rng(0), "eval")
    assert all(g.rewards.tolist() == [1.0, 0.0, 0.0] for g in groups)
    assert metrics["extraction_failed_count"] == 4 and metrics["correct_count"] == 4
    assert metrics["reward_mean"] == pytest.approx(1 / 3)


def test_sample_rejects_bad_arguments(tokenizer):
    ctx = ScriptedContext(tokenizer, lambda text, j: "a")
    with pytest.raises(ValueError, match="mode"):
        EchoEnv().sample(ctx, 1, 1, SAMPLING, np.random.default_rng(0), "training")
    with pytest.raises(ValueError, match="n_generations"):
        EchoEnv().sample(ctx, 1, 0, SAMPLING, np.random.default_rng(0), "train")


# ------------------------------------------------------------------------------ safe_sample


META = RolloutMetadata(worker_id="worker-3", weight_step=17, created_at=1_700_000_000.0)


def _run(env, ctx, n_examples=3, n_generations=2, lesson_id="lesson-a"):
    return safe_sample(env, ctx, lesson_id=lesson_id, n_examples=n_examples, n_generations=n_generations,
                       sampling=SAMPLING, rng=np.random.default_rng(0), mode="train", metadata=META)


def test_safe_sample_stamps_metadata_and_lesson_and_prefixes_metrics(tokenizer):
    ctx = ScriptedContext(tokenizer, lambda text, j: text[:-1])
    groups, metrics = _run(EchoEnv(), ctx)
    assert len(groups) == 3 and all(len(g) == 2 for g in groups)
    for r in (r for g in groups for r in g.rollouts):
        assert r.metadata == META and r.lesson_id == "lesson-a" and r.episode_reward == 1.0
    assert metrics["lesson-a/env_failures"] == 0 and metrics["lesson-a/malformed_groups"] == 0
    assert metrics["lesson-a/reward_mean"] == 1.0 and metrics["lesson-a/groups"] == 3
    assert metrics["lesson-a/sample_seconds"] >= 0


class RaisingEnv:
    def sample(self, ctx, n_examples, n_generations, sampling, rng, mode):
        raise RuntimeError("the environment's own bug")


class NotATupleEnv:
    def sample(self, ctx, n_examples, n_generations, sampling, rng, mode):
        return [g for g in []]


class BrokenGroupsEnv(EchoEnv):
    """Three good groups from EchoEnv, then damage: a NaN reward written into group 0 after it was
    built, a group larger than n_generations, something that is not a group, a repeated group id, and a
    metric that is not a number."""

    def sample(self, ctx, n_examples, n_generations, sampling, rng, mode):
        groups, metrics = super().sample(ctx, n_examples, n_generations, sampling, rng, mode)
        groups[0].rollouts[0].token_rewards[-1] = np.nan
        oversized = RolloutGroup(groups[1].rollouts * 2)
        short = RolloutGroup(groups[2].rollouts[:1])  # fewer than n_generations is allowed
        return [groups[0], groups[1], short, oversized, {"not": "a group"}, groups[1]], {
            **metrics, "bad": float("nan"), "text": "x"}


def test_safe_sample_reports_an_env_that_raises_with_the_lesson_id(tokenizer, caplog):
    with caplog.at_level(logging.ERROR):
        groups, metrics = _run(RaisingEnv(), ScriptedContext(tokenizer, lambda t, j: "a"), lesson_id="hard")
    assert groups == [] and metrics["hard/env_failures"] == 1.0
    assert "'hard'" in caplog.text and "the environment's own bug" in caplog.text
    groups, metrics = _run(NotATupleEnv(), ScriptedContext(tokenizer, lambda t, j: "a"))
    assert groups == [] and metrics["lesson-a/env_failures"] == 1.0


def test_safe_sample_drops_malformed_groups_and_keeps_the_valid_ones(tokenizer, caplog):
    ctx = ScriptedContext(tokenizer, lambda text, j: text[:-1])
    with caplog.at_level(logging.WARNING):
        groups, metrics = _run(BrokenGroupsEnv(), ctx, lesson_id="broken")
    assert [len(g) for g in groups] == [2, 1]  # group 1 and the short one survive; the NaN one, the oversized
    # one, the non-group and the repeat do not
    assert all(r.metadata == META and r.lesson_id == "broken" for g in groups for r in g.rollouts)
    assert metrics["broken/malformed_groups"] == 4 and metrics["broken/env_failures"] == 0
    assert metrics["broken/dropped_metrics"] == 2 and "broken/bad" not in metrics
    assert "must be finite" in caplog.text and "more than n_generations=2" in caplog.text
    assert "appears twice" in caplog.text and "'broken'" in caplog.text


def test_safe_sample_still_raises_for_the_callers_mistakes(tokenizer):
    with pytest.raises(ValueError, match="mode"):
        safe_sample(EchoEnv(), ScriptedContext(tokenizer, lambda t, j: "a"), lesson_id="x", n_examples=1,
                    n_generations=1, sampling=SAMPLING, rng=np.random.default_rng(0), mode="test", metadata=META)
    with pytest.raises(TypeError, match="RolloutMetadata"):
        safe_sample(EchoEnv(), ScriptedContext(tokenizer, lambda t, j: "a"), lesson_id="x", n_examples=1,
                    n_generations=1, sampling=SAMPLING, rng=np.random.default_rng(0), mode="train", metadata=None)


def test_make_rollout_takes_masks_and_per_token_rewards_for_multi_turn():
    gen = Generation(np.array([5, 6, 7, 8], np.int32), np.array([-1, 0, 0, -1], np.float32), "stop")
    r = make_rollout([1, 2], gen, reward=1.5, temperature=0.7, env_name="game", group_id=new_group_id("game", "ep1"),
                     loss_mask=np.array([1, 0, 0, 1]), token_rewards=np.array([0.5, 0, 0, 1.0]),
                     agent_name="solver", policy_name="policy-b")
    assert r.loss_mask.tolist() == [True, False, False, True] and r.token_rewards.tolist() == [0.5, 0, 0, 1.0]
    assert r.agent_name == "solver" and r.policy_name == "policy-b" and r.group_id.startswith("game:ep1:")


# ------------------------------------------------------------------------------ the real server


def test_echo_through_the_real_inference_server_with_a_tiny_random_model(tokenizer):
    from levanter.models.llama import LlamaConfig

    from marinrl.config.model import ModelConfig
    from marinrl.config.server import InferenceServerConfig
    from marinrl.inference.server import InferenceServer
    from marinrl.models.policy_model import build_model

    arch = LlamaConfig(seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       gradient_checkpointing=False)
    model = build_model(ModelConfig(model=arch, vocab_size=VOCAB, seed=0))
    with InferenceServer(InferenceServerConfig(serve_http=False), model, tokenizer) as server:
        server.wait_until_ready()
        env = EchoEnv(alphabet_size=10, length=1)
        sampling = SamplingParams(temperature=1.0, max_tokens=2)
        groups, metrics = safe_sample(env, server, lesson_id="echo-10", n_examples=8, n_generations=4,
                                      sampling=sampling, rng=np.random.default_rng(0), mode="train", metadata=META)
        assert metrics["echo-10/env_failures"] == 0 and metrics["echo-10/malformed_groups"] == 0
        assert len(groups) == 8 and all(len(g) == 4 for g in groups)
        for g in groups:
            answer = tokenizer.decode(g.rollouts[0].prompt_tokens[1:-1].tolist())
            for r in g.rollouts:
                gen = Generation(r.response_tokens, r.response_logprobs, r.finish_reason)
                assert r.episode_reward == grade_answer(completion_text(tokenizer, gen, sampling), answer).reward
                assert 1 <= r.response_tokens.size <= 2 and (r.response_logprobs <= 0).all()
                assert r.metadata == META
        # A random model samples ~uniformly over 512 tokens: almost never the right letter.
        assert metrics["echo-10/reward_mean"] < 0.2
        greedy, _ = env.sample(server, 8, 1, SamplingParams(temperature=0.0, max_tokens=1),
                               np.random.default_rng(1), "eval")
        assert all(len(g) == 1 and g.rollouts[0].response_tokens.size == 1 for g in greedy)


# ------------------------------------------------------------------------------ the docs example


def test_the_example_in_docs_environments_runs():
    text = (REPO / "docs" / "environments.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    example = [b for b in blocks if "# example: complete" in b]
    assert len(example) == 1, "docs/environments.md must hold one block marked '# example: complete'"
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(example[0], "docs/environments.md", "exec"), namespace)
    assert namespace["groups"] and namespace["metrics"]["upper/env_failures"] == 0


def test_a_lesson_that_drives_the_openai_endpoint_turns_it_on():
    from marinrl.config.server import InferenceServerConfig
    from marinrl.envs.base import with_endpoint_if_needed

    off = InferenceServerConfig(serve_http=False)
    assert with_endpoint_if_needed(off, [EnvConfig("echo")]) is off
    on = with_endpoint_if_needed(off, [EnvConfig("echo"), EnvConfig("openai_agent", {"agent": "x.y"})])
    assert on.serve_http and dataclasses.replace(on, serve_http=False) == off
