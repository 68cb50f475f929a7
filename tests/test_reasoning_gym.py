"""The reasoning_gym environment against the real reasoning-gym package: prompts from its generators,
rewards from its own scorers, held-out eval items, difficulty levels, and a short job end to end."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from marinrl.config.curriculum import CurriculumConfig, LessonConfig, level_lessons
from marinrl.curriculum.lessons import Curriculum
from marinrl.envs import EnvConfig
from marinrl.envs.base import make_env
from marinrl.envs.reasoning_gym_env import TaskSpec, task_config

rg = pytest.importorskip("reasoning_gym")  # the `reasoning_gym` extra (in `dev`: CI has it)

TASKS = ["basic_arithmetic", "chain_sum", "countdown", "leg_counting", "spell_backward", "letter_counting"]


@pytest.mark.parametrize("task", TASKS)
def test_each_task_scores_a_right_and_a_wrong_answer_as_the_package_does(task):
    env = make_env(EnvConfig("reasoning_gym", {"task": task}))
    problems = env.problems(3, np.random.default_rng(0), "train")
    assert len({p.prompt for p in problems}) == 3 and all(p.example_id.startswith(f"{task}:") for p in problems)
    package_score = rg.get_score_answer_fn(task)
    for p in problems:
        right = env.grade(p, f"thinking...\n<answer>{p.answer}</answer>")
        assert right.reward == package_score(p.answer, p.entry) == 1.0
        assert right.indicators == {"correct": 1.0, "extraction_failed": 0.0}
        wrong = env.grade(p, "<answer>7 apples</answer>")
        assert wrong.reward == package_score("7 apples", p.entry) < 1.0 and wrong.indicators["correct"] == 0.0
        untagged = env.grade(p, p.answer)  # the answer without the tags reasoning-gym asks for
        assert untagged.reward == package_score(None, p.entry) < 1.0 and untagged.indicators["extraction_failed"] == 1.0


def test_raw_answers_are_the_whole_response_and_prompts_are_reproducible():
    env = make_env(EnvConfig("reasoning_gym", {"task": "chain_sum", "answer_format": "raw"}))
    a = env.problems(8, np.random.default_rng(3), "train")
    b = env.problems(8, np.random.default_rng(3), "train")
    c = env.problems(8, np.random.default_rng(4), "train")
    assert [p.prompt for p in a] == [p.prompt for p in b] and [p.prompt for p in a] != [p.prompt for p in c]
    assert env.grade(a[0], f" {a[0].answer}\n").reward == 1.0


def test_training_never_draws_an_eval_question():
    """A task with few distinct items (one-digit sums of two terms: ~200 questions), so that the training
    generator does produce the eval questions and the environment must skip them."""
    args = {"task": "basic_arithmetic", "eval_size": 64,
            "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    env = make_env(EnvConfig("reasoning_gym", args))
    held_out = {p.prompt for p in env.problems(400, np.random.default_rng(1), "eval")}
    assert held_out <= env.eval_questions(0) and len(held_out) > 30
    raw_train = {env.train[0][i]["question"] for i in range(400)}
    assert raw_train & held_out  # the generator repeats eval questions...
    trained = {p.prompt for p in env.problems(400, np.random.default_rng(2), "train")}
    assert len(trained) > 50 and not trained & held_out  # ...and training never sees them


def test_in_a_mix_each_tasks_training_skips_its_own_eval_questions():
    """The second task of a mix has few distinct items: its training draws must be checked against its own
    eval set, not the first task's."""
    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    env = make_env(EnvConfig("reasoning_gym", {"eval_size": 64, "tasks": [
        {"task": "chain_sum"}, {"task": "basic_arithmetic", "config": small}]}))
    held_out = env.eval_questions(1)
    raw_train = {env.train[1][i]["question"] for i in range(400)}
    assert raw_train & held_out  # the second task's generator repeats its eval questions...
    trained = {p.prompt for p in env.problems(800, np.random.default_rng(2), "train") if p.task_index == 1}
    assert len(trained) > 50 and not trained & held_out  # ...and its training never sees them


def test_a_weighted_mix_draws_each_task_in_proportion_and_scores_each_with_its_own_scorer():
    env = make_env(EnvConfig("reasoning_gym", {"tasks": [{"task": "chain_sum", "weight": 3},
                                                {"task": "spell_backward", "weight": 1, "level": 2}]}))
    problems = env.problems(400, np.random.default_rng(0), "train")
    share = np.mean([p.example_id.startswith("chain_sum:") for p in problems])
    assert 0.68 < share < 0.82  # 3:1 (binomial, n=400: 0.75 ± 0.07 at 3 sigma)
    for p in problems[:20]:
        assert env.grade(p, f"<answer>{p.answer}</answer>").reward == 1.0
    assert task_config(TaskSpec("spell_backward", level=2), seed=0, size=1).max_word_len > task_config(
        TaskSpec("spell_backward", level=0), seed=0, size=1).max_word_len


def test_a_level_raises_every_knob_of_the_task_curriculum():
    low, high = (task_config(TaskSpec("basic_arithmetic", level=k), seed=0, size=10) for k in (0, 3))
    assert (low.max_terms, low.max_digits) < (high.max_terms, high.max_digits)
    top = task_config(TaskSpec("basic_arithmetic", level=99), seed=0, size=10)  # clamped to the last level
    assert top.max_terms == 6 and top.max_digits == 4
    one = task_config(TaskSpec("basic_arithmetic", level={"num_digits": 3}), seed=0, size=10)
    assert one.max_digits == 4 and one.max_terms == low.max_terms
    env = make_env(EnvConfig("reasoning_gym", {"task": "basic_arithmetic", "level": 3}))
    assert max(len(p.prompt) for p in env.problems(20, np.random.default_rng(0), "eval")) > 25


def test_level_lessons_unlock_each_level_as_the_one_below_reaches_graduation():
    base = LessonConfig("arith", EnvConfig("reasoning_gym", {"task": "basic_arithmetic"}), graduate_at=0.8,
                        plateau_window=2)
    lessons = level_lessons(base, [0, 1, 2])
    assert [x.lesson_id for x in lessons] == ["arith-l0", "arith-l1", "arith-l2"]
    assert [x.env.args["level"] for x in lessons] == [0, 1, 2]
    for x in lessons:
        make_env(x.env)
    c = Curriculum(CurriculumConfig(lessons=lessons))
    assert [c.status(x.lesson_id) for x in lessons] == ["active", "locked", "locked"]
    for step in range(4):
        c.update_from_training("arith-l0", [1.0] * 8, step)
    assert [c.status(x.lesson_id) for x in lessons] == ["graduated", "active", "locked"]
    assert c.weights()["arith-l0"] == 0.0 and c.weights()["arith-l1"] == 1.0
    with pytest.raises(ValueError, match="never graduates"):
        level_lessons(dataclasses.replace(base, graduate_at=None), [0, 1])


@pytest.mark.parametrize("args, match", [
    ({"task": "nope"}, "unknown task 'nope'"),
    ({"task": "chain_sum", "config": {"bogus": 1}}, "bad config"),
    ({"task": "chain_sum", "config": {"seed": 1}}, "config.seed"),
    ({"task": "chain_sum", "level": {"bogus": 1}}, "no difficulty knob"),
    ({"task": "chain_sum", "tasks": [{"task": "chain_sum"}]}, "not both"),
    ({"tasks": [{"task": "chain_sum", "weight": 0}]}, "weight must be > 0"),
    ({"task": "chain_sum", "answer_format": "json"}, "answer_format"),
])
def test_bad_args_fail_naming_the_problem(args, match):
    with pytest.raises(ValueError, match=match):
        make_env(EnvConfig("reasoning_gym", args))


def test_importing_marinrl_envs_does_not_import_the_ecosystem_packages():
    code = ("import sys, marinrl.envs; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('reasoning_gym', 'textarena', 'openenv', 'verifiers')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("env, args, package", [
    ("reasoning_gym", {"task": "chain_sum"}, "reasoning_gym"),
    ("textarena", {"game": "TicTacToe-v0"}, "textarena"),
    ("openenv", {"url": "http://127.0.0.1:1"}, "openenv"),
])
def test_a_lesson_of_an_adapter_whose_package_is_missing_says_what_to_install(env, args, package):
    """In a fresh interpreter where the package cannot be imported (None in sys.modules is how Python
    marks a module as absent), building the environment fails with the extra to install."""
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            "from marinrl.envs import EnvConfig, make_env\n"
            f"try:\n    make_env(EnvConfig({env!r}, {args!r}))\n"
            "except ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"pip install 'marinrl[{package}]'" in out, out  # each extra is named after its package


@pytest.mark.timeout(1200)
def test_a_short_job_trains_on_one_task(tmp_path, ray_session):
    from levanter.models.llama import LlamaConfig
    from test_job import _run

    from marinrl.models.policy_model import ModelConfig
    from marinrl.train.batching import BatchingConfig

    lesson = LessonConfig("chain", EnvConfig("reasoning_gym", {
        "task": "chain_sum", "system_prompt": None, "answer_format": "raw",
        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}), max_tokens=2, graduate_at=None)
    model = ModelConfig(model=LlamaConfig(seq_len=128, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
                                          num_kv_heads=2, gradient_checkpointing=False), vocab_size=512)
    cfg, result = _run(tmp_path, ray_session, curriculum=CurriculumConfig(lessons=(lesson,)), model=model,
                       num_train_steps=3, eval_every=3, batching=BatchingConfig(max_length=128, min_bucket=32))
    assert result.train["final_step"] == 3 and all(np.isfinite(h["loss"]) for h in result.train["history"])
    evals = [e for e in result.rollouts[0]["evals"] if e["kind"] == "eval"]
    metrics = evals[-1]["metrics"]
    assert np.isfinite(metrics["eval/chain/reward_mean"]) and "eval/chain/correct_frac" in metrics
    from marinrl.storage.rollouts import RolloutReader

    groups = [g for b in RolloutReader(f"{cfg.run_dir}/rollouts").read_new() for g in b.groups]
    assert groups and all(g.group_id.startswith("reasoning_gym:chain_sum:") for g in groups)
