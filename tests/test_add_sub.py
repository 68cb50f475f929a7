"""The real-model task (`add_sub`, docs/real_model.md): its reward, its prompt through SmolLM2's chat template,
its held-out set (fixed, distinct, walked in order, never drawn for training), and one sample call whose
responses are scripted, with the SmolLM2 tokenizer, so the rewards can be checked exactly."""

from __future__ import annotations

import numpy as np
import pytest

from marinrl.config.env import EnvConfig
from marinrl.envs.add_sub import QUESTION, AddSubEnv, grade_answer, last_integer
from marinrl.envs.base import completion_text, make_env
from marinrl.inference.context import Generation, SamplingParams
from marinrl.models.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    return load_tokenizer(smollm2_checkpoint)


@pytest.mark.parametrize("response, answer, reward", [
    ("12", 12, 1.0),
    ("-8", -8, 1.0),
    ("37 - 45 = -8", -8, 1.0),           # several integers: the last one counts
    ("37 - 45 = 8", -8, 0.0),            # a lost sign is wrong
    ("The answer is \u22128.", -8, 1.0),  # a typographic minus
    ("-8 is not it, it is 82", -8, 0.0),
    ("23 + 38 = 61. So 61", 61, 1.0),
    ("I cannot compute that.", 3, 0.0),  # no integer at all
    ("", 0, 0.0),
])
def test_reward_is_the_last_integer(response, answer, reward):
    grade = grade_answer(response, answer)
    assert grade.reward == reward and grade.indicators["correct"] == reward
    assert grade.indicators["no_integer"] == float(last_integer(response) is None)


def test_the_prompt_is_one_user_turn_through_smollm2s_chat_template(tokenizer):
    env = make_env(EnvConfig("add_sub"))
    problem = env.problem(37, "-", 45)
    assert problem.prompt == "What is 37 - 45? Answer with just the number." == QUESTION.format(a=37, op="-", b=45)
    assert problem.answer == "-8"
    text = tokenizer.decode(env.encode(tokenizer, problem))
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 37 - 45? Answer with just the number.<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_the_heldout_set_is_fixed_distinct_walked_in_order_and_never_trained_on():
    env, again = AddSubEnv(), AddSubEnv()
    assert env.heldout == again.heldout and len(set(env.heldout)) == 200
    assert all(1 <= a <= 50 and 1 <= b <= 50 and op in "+-" for a, op, b in env.heldout)
    assert {op for _, op, _ in env.heldout} == {"+", "-"}
    rng = np.random.default_rng(0)
    batches = [env.problems(n, rng, "eval") for n in (64, 64, 64, 8)]  # marinrl eval's batches of 64
    walked = [p.example_id for batch in batches for p in batch]
    assert walked == [f"{a}{op}{b}" for a, op, b in env.heldout]
    assert [p.example_id for p in env.problems(200, rng, "eval")] == walked  # a whole pass: the same order
    assert [p.example_id for p in again.problems(200, np.random.default_rng(7), "eval")] == walked
    heldout = set(walked)
    train = env.problems(5000, np.random.default_rng(1), "train")
    assert not heldout & {p.example_id for p in train}
    assert len({p.example_id for p in train}) > 3000  # spread over the 5,000 questions, not a few
    assert AddSubEnv(heldout_seed=1).heldout != env.heldout


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="low"):
        AddSubEnv(low=10, high=5)
    with pytest.raises(ValueError, match="ops"):
        AddSubEnv(ops="*")
    with pytest.raises(ValueError, match="heldout_size"):
        AddSubEnv(low=1, high=2, heldout_size=200)


class ScriptedContext:
    """TEST DOUBLE for the policy model only: each response is the text `respond(question)` returns, ended
    with the tokenizer's EOS (`<|im_end|>`) as the sampler ends a turn; tokenizer, env and grading are real."""

    def __init__(self, tokenizer, respond):
        self.tokenizer, self.respond = tokenizer, respond

    def generate(self, prompts, n, sampling, seed):
        out = []
        for prompt in prompts:
            question = self.tokenizer.decode(prompt).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            row = []
            for j in range(n):
                tokens = self.tokenizer.encode(self.respond(question, j), add_special_tokens=False)
                tokens = tokens + [self.tokenizer.eos_token_id]
                row.append(Generation(np.asarray(tokens, np.int32), np.zeros(len(tokens), np.float32), "stop"))
            out.append(row)
        return out


def test_sample_grades_each_response_without_its_end_of_turn(tokenizer):
    def respond(question, j):
        a, op, b = question.split("?")[0].removeprefix("What is ").split()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        return [str(value), f"{a} {op} {b} = {value + 1}", "I do not know"][j]

    env = AddSubEnv()
    sampling = SamplingParams(temperature=1.0, max_tokens=32)
    groups, metrics = env.sample(ScriptedContext(tokenizer, respond), 4, 3, sampling, np.random.default_rng(0),
                                 "train")
    assert [list(g.rewards) for g in groups] == [[1.0, 0.0, 0.0]] * 4
    assert metrics["correct_count"] == 4 and metrics["no_integer_count"] == 4
    first = groups[0].rollouts[0]
    assert int(first.response_tokens[-1]) == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = Generation(first.response_tokens, np.zeros(first.response_tokens.size, np.float32), "stop")
    assert "<|im_end|>" not in completion_text(tokenizer, generation, sampling)


def test_the_recipe_parses_and_heldout_sets_the_lesson_and_the_eval_size(smollm2_checkpoint):
    import pathlib
    import runpy

    recipe = runpy.run_path(str(pathlib.Path(__file__).parent.parent / "experiments" / "smollm2_arithmetic.py"),
                            run_name="recipe")
    job = recipe["configure"]([])
    assert job.model.hf_checkpoint == smollm2_checkpoint and job.eval_examples == 200
    lesson = job.curriculum.lessons[0]
    assert lesson.env.name == "add_sub" and lesson.max_tokens == 24
    short = recipe["configure"](["--heldout", "16", "--num_train_steps", "2"])
    assert short.eval_examples == 16 and short.curriculum.lessons[0].env.args["heldout_size"] == 16
    assert short.num_train_steps == 2
    with pytest.raises(SystemExit, match="eval_examples"):
        recipe["configure"](["--eval_examples", "50"])
    with pytest.raises(SystemExit, match="--heldout"):
        recipe["configure"](["--heldout", "0"])
    low, high = recipe["bootstrap_ci"](41, 200)
    assert low < 41 / 200 < high and 0.14 < low and high < 0.27  # binomial sd at 0.205 of 200 is 0.029
    assert recipe["bootstrap_ci"](0, 200) == (0.0, 0.0)
