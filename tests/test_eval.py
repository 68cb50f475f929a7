"""Offline evaluation (`marinrl.eval`, `marinrl eval`) of real checkpoints the tests write: a tiny
random Llama saved as Levanter checkpoints (a run folder with two steps, and a Trainer-style step with
no model_config.json) and as a Hugging Face checkpoint, served by the real InferenceServer through a
real RolloutManager, rollouts written and read back as Parquet rollout files."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import shutil

import numpy as np
import pytest
from factories import make_rollout
from levanter.models.llama import LlamaConfig

from marinrl.cli import main as cli
from marinrl.config.curriculum import LessonConfig
from marinrl.config.env import EnvConfig
from marinrl.config.eval import EvalConfig
from marinrl.config.model import ModelConfig
from marinrl.eval import lesson_metrics, main, parse_lesson, resolve_checkpoint
from marinrl.models.hf_checkpoints import save_hf_checkpoint
from marinrl.models.policy_model import MODEL_CONFIG_FILE, build_model, save_levanter_checkpoint
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.storage.rollouts import iter_batches
from marinrl.types import RolloutGroup

VOCAB = 512
TINY = ModelConfig(model=LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
                                     num_kv_heads=2, gradient_checkpointing=False), vocab_size=VOCAB, seed=0)
LESSONS = (LessonConfig("echo", EnvConfig("echo", {"alphabet_size": 10}), max_tokens=2),
           LessonConfig("parity", EnvConfig("parity", {"n_bits": 2}), max_tokens=2))
JOB_YAML = """
run_id: demo
model:
  model: {type: llama, seq_len: 64, hidden_dim: 32, intermediate_dim: 64, num_layers: 2, num_heads: 2,
          num_kv_heads: 2, gradient_checkpointing: false}
  vocab_size: 512
curriculum:
  lessons:
    - lesson_id: copy
      env: {name: echo, args: {alphabet_size: 4}}
      max_tokens: 2
    - lesson_id: bits
      env: {name: parity, args: {n_bits: 2}}
"""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    model = build_model(TINY)
    save_levanter_checkpoint(model, str(root / "run" / "step-1"), step=1)
    save_levanter_checkpoint(model, str(root / "run" / "step-3"), step=3)
    save_hf_checkpoint(model, str(root / "hf" / "step-5"), tokenizer=byte_tokenizer(VOCAB))
    # A checkpoint laid out as the TrainWorker writes one: Levanter's Trainer names it after the 0-indexed
    # step it completed (6), our sidecar records the updates applied (7), and there is no model_config.json.
    trainer = root / "trainer" / "step-6"
    shutil.copytree(root / "run" / "step-3", trainer)
    (trainer / MODEL_CONFIG_FILE).unlink()
    meta = json.loads((trainer / "metadata.json").read_text())
    (trainer / "metadata.json").write_text(json.dumps({**meta, "step": 6}))
    (trainer / "marinrl.json").write_text(json.dumps({"step": 7}))
    (root / "job.yaml").write_text(JOB_YAML)
    return root


def read_rollouts(root: pathlib.Path):
    files = list(iter_batches(str(root)))
    return files, [r for _, _, batch in files for r in batch.rollouts]


@pytest.fixture(scope="module")
def levanter_eval(ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("lev") / "eval"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = main(EvalConfig(checkpoint=str(ckpts / "run"), lessons=LESSONS, n_examples=4, batch_size=2,
                                 output=str(out), progress=False))
    return result, out, printed.getvalue()


def test_levanter_run_folder_evaluates_its_latest_step(levanter_eval, capsys):
    result, out, printed = levanter_eval
    assert json.loads((out / "metrics.json").read_text()) == result
    assert result["checkpoint_kind"] == "levanter" and result["loaded_from"].endswith("step-3")
    assert result["weight_step"] == 3  # save_levanter_checkpoint's step: the weight step of those weights
    files, rollouts = read_rollouts(out / "rollouts")
    assert len(files) == result["files"] == 4  # 2 lessons x 2 batches of 2 prompts, one file per manager call
    assert {step for step, _, _ in files} == {3} and all("step=00000003" in path for _, path, _ in files)
    assert {(r.metadata.worker_id, r.metadata.weight_step, r.temperature) for r in rollouts} == {("eval", 3, 0.0)}
    for lesson_id in ("echo", "parity"):
        mine = [r for r in rollouts if r.lesson_id == lesson_id]
        m = result["lessons"][lesson_id]["metrics"]
        assert m["n"] == m["prompts"] == len(mine) == 4 and m["env_failures"] == 0 and m["groups"] == 4
        assert m["reward_mean"] == pytest.approx(np.mean([r.episode_reward for r in mine]))
        assert m["response_length_mean"] == pytest.approx(np.mean([r.response_tokens.size for r in mine]))
        assert all(r.response_tokens.size <= 2 for r in mine)  # the lesson's max_tokens
    assert result["lessons"]["parity"]["env"] == {"name": "parity", "args": {"n_bits": 2}}
    header, *rows = printed.splitlines()[1:4]
    assert header.split()[:5] == ["lesson", "env", "n", "reward", "pass@1"] and "pass@2" not in header
    assert rows[0].split()[:3] == ["echo", "echo", "4"] and rows[1].split()[:3] == ["parity", "parity", "4"]
    assert cli(["inspect", str(out / "rollouts")]) == 0
    assert "4 files, 8 rollouts, 8 groups" in capsys.readouterr().out


def test_hf_checkpoint_gives_the_same_greedy_answers(ckpts, levanter_eval, tmp_path):
    result = main(EvalConfig(checkpoint=str(ckpts / "hf" / "step-5"), lessons=LESSONS, n_examples=4, batch_size=2,
                             output=str(tmp_path / "hf-eval"), progress=False))
    assert result["checkpoint_kind"] == "hf" and result["weight_step"] == 5  # from the step-5 directory name
    assert result["lessons"]["echo"]["metrics"]["n"] == 4
    _, hf = read_rollouts(tmp_path / "hf-eval" / "rollouts")
    _, lev = read_rollouts(levanter_eval[1] / "rollouts")
    assert {r.metadata.weight_step for r in hf} == {5} and {r.metadata.worker_id for r in hf} == {"eval"}
    # same weights, same seed, greedy: the same prompts and answers whichever format they were loaded from
    tokens = lambda rs: [(r.lesson_id, r.prompt_tokens.tolist(), r.response_tokens.tolist()) for r in rs]  # noqa: E731
    assert tokens(hf) == tokens(lev)


def test_cli_samples_k_per_prompt_for_pass_at_k(ckpts, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(["eval", "--checkpoint", str(ckpts / "hf" / "step-5"), "--lessons", 'copy=echo:{"alphabet_size": 4}',
                "--n-examples", "2", "--batch-size", "1", "--samples", "2", "--temperature", "1.0",
                "--max-tokens", "2", "--output", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    m = metrics["lessons"]["copy"]["metrics"]
    assert metrics["samples"] == 2 and m["n"] == 4 and m["prompts"] == 2 and "pass@2" in m
    assert metrics["lessons"]["copy"]["temperature"] == 1.0 and metrics["lessons"]["copy"]["max_tokens"] == 2
    files, rollouts = read_rollouts(out / "rollouts")
    assert len(files) == 2 and all(len(g) == 2 for _, _, b in files for g in b.groups)
    assert {(r.temperature, r.lesson_id, r.env_name) for r in rollouts} == {(1.0, "copy", "echo")}
    assert "pass@2" in printed and "copy" in printed


def test_trainer_checkpoint_with_curriculum_and_model_from_a_job_config(ckpts, tmp_path, capsys):
    trainer, job = str(ckpts / "trainer"), str(ckpts / "job.yaml")
    with pytest.raises(SystemExit, match=f"{trainer}/step-6 has no {MODEL_CONFIG_FILE}.*--model-config"):
        cli(["eval", "--checkpoint", trainer, "--curriculum", job])
    out = tmp_path / "out"
    assert cli(["eval", "--checkpoint", trainer, "--curriculum", job, "--lessons", "copy", "--model-config", job,
                "--n-examples", "2", "--batch-size", "2", "--output", str(out), "--no-progress"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["weight_step"] == 7 and list(metrics["lessons"]) == ["copy"]  # 6 completed steps, 0-indexed
    assert metrics["lessons"]["copy"]["env"] == {"name": "echo", "args": {"alphabet_size": 4}}
    _, rollouts = read_rollouts(out / "rollouts")
    assert {r.metadata.weight_step for r in rollouts} == {7} and len(rollouts) == 2
    assert all(r.response_tokens.size <= 2 for r in rollouts)  # the curriculum lesson's max_tokens


def test_missing_or_foreign_checkpoint_is_a_clear_error(ckpts, tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"checkpoint not found: {missing}"):
        main(EvalConfig(checkpoint=missing, lessons=LESSONS))
    with pytest.raises(SystemExit, match=f"marinrl eval: checkpoint not found: {missing}"):
        cli(["eval", "--checkpoint", missing, "--lessons", "echo"])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="junk is neither a Levanter checkpoint .* nor a Hugging Face"):
        resolve_checkpoint(str(tmp_path / "junk"))


def test_unknown_lesson_or_environment_is_a_clear_error(ckpts, levanter_eval):
    ckpt, job = str(ckpts / "run"), str(ckpts / "job.yaml")
    with pytest.raises(ValueError, match="unknown environment 'nope'; registered: .*'echo'"):
        main(EvalConfig(checkpoint=ckpt, lessons=(LessonConfig("x", EnvConfig("nope")),)))
    with pytest.raises(SystemExit, match="unknown environment 'nope'"):
        cli(["eval", "--checkpoint", ckpt, "--lessons", "echo", "nope"])
    with pytest.raises(SystemExit, match="environment 'echo' rejected args"):
        cli(["eval", "--checkpoint", ckpt, "--lessons", 'echo:{"colour": 1}'])
    with pytest.raises(SystemExit, match=r"unknown lesson\(s\) \['nope'\] in .*job.yaml; known: \['copy', 'bits'\]"):
        cli(["eval", "--checkpoint", ckpt, "--curriculum", job, "--lessons", "nope"])
    with pytest.raises(SystemExit, match="not valid JSON"):
        cli(["eval", "--checkpoint", ckpt, "--lessons", "echo:{alphabet_size: 3}"])
    with pytest.raises(SystemExit, match="duplicate lesson ids \\['echo'\\]; give each its own id"):
        cli(["eval", "--checkpoint", ckpt, "--lessons", "echo", 'echo:{"length": 2}'])
    with pytest.raises(SystemExit, match="lessons is empty"):
        cli(["eval", "--checkpoint", ckpt])
    with pytest.raises(SystemExit, match="samples=4 at temperature 0 .* give a temperature > 0"):
        cli(["eval", "--checkpoint", ckpt, "--lessons", "echo", "--samples", "4"])
    with pytest.raises(FileExistsError, match="already holds an evaluation"):
        main(EvalConfig(checkpoint=ckpt, lessons=LESSONS, output=str(levanter_eval[1])))


def test_lesson_specs():
    assert parse_lesson("echo") == LessonConfig("echo", EnvConfig("echo"))
    assert parse_lesson('pairs=echo:{"length": 2, "template": "{s}=?"}') == LessonConfig(
        "pairs", EnvConfig("echo", {"length": 2, "template": "{s}=?"}))
    x = parse_lesson('pkg.envs:MyEnv:{"k": [1]}')
    assert (x.lesson_id, x.env.name, x.env.args) == ("pkg.envs:MyEnv", "pkg.envs:MyEnv", {"k": [1]})
    with pytest.raises(ValueError, match="lesson 'echo:{1]}': environment arguments are not valid JSON"):
        parse_lesson("echo:{1]}")
    with pytest.raises(ValueError, match="no environment name"):
        parse_lesson('copy=:{"a": 1}')


def test_lesson_metrics_over_several_calls():
    def group(*rewards, length=3):
        gid = f"g{np.random.default_rng().integers(1 << 30)}"
        return RolloutGroup(tuple(make_rollout(gid, r, response_len=length) for r in rewards))

    groups = [group(1.0, 0.0), group(0.0, 0.0), group(1.0, 1.0, length=5)]
    calls = [(2, {"correct_frac": 0.25, "correct_count": 1.0, "env_failures": 0.0, "sample_seconds": 1.0}),
             (1, {"correct_frac": 1.0, "correct_count": 2.0, "env_failures": 0.0, "sample_seconds": 0.5}),
             (3, {"env_failures": 1.0, "sample_seconds": 0.1})]  # a failed call: no env metrics, no groups
    m = lesson_metrics(calls, groups, samples=2, pass_threshold=1.0)
    assert m["correct_frac"] == pytest.approx((0.25 * 2 + 1.0) / 3)  # weighted by the prompts of the calls reporting it
    assert (m["correct_count"], m["env_failures"], m["sample_seconds"]) == (3.0, 1.0, pytest.approx(1.6))
    assert (m["n"], m["prompts"]) == (6, 3)
    assert m["reward_mean"] == pytest.approx(0.5) and m["pass@1"] == pytest.approx(0.5)
    assert m["pass@2"] == pytest.approx(2 / 3) and m["response_length_mean"] == pytest.approx(22 / 6)
    empty = lesson_metrics([(4, {"env_failures": 1.0})], [], samples=1, pass_threshold=1.0)
    assert empty["n"] == 0 and np.isnan(empty["reward_mean"]) and "pass@2" not in empty


def _garble_middle(chunk: pathlib.Path) -> None:
    """XOR the middle half of a file: the issue's garbled chunk, which zstd may still decode."""
    data = bytearray(chunk.read_bytes())
    lo, hi = len(data) // 4, 3 * len(data) // 4
    data[lo:hi] = bytes(b ^ 0x5A for b in data[lo:hi])
    chunk.write_bytes(bytes(data))


def _largest_weight_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((p for p in (step_dir / "model").rglob("*") if p.is_file() and not p.name.startswith(".")),
               key=lambda p: p.stat().st_size)


def test_a_garbled_checkpoint_is_named_and_never_evaluated(ckpts, tmp_path, capsys):
    from marinrl.train.checkpoints import write_digest

    run = tmp_path / "run"
    shutil.copytree(ckpts / "run", run)
    write_digest(str(run / "step-3"))  # as the TrainWorker does once the save commits
    chunk = _largest_weight_file(run / "step-3")
    _garble_middle(chunk)
    with pytest.raises(SystemExit) as exited:
        cli(["eval", "--checkpoint", str(run), "--lessons", "echo", "--no-progress"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"marinrl eval: {run / 'step-3'} is damaged: {chunk}")
    assert f"--checkpoint {run / 'step-1'}" in err  # the newest intact one, named


def test_a_truncated_checkpoint_is_one_line_and_exit_2(ckpts, tmp_path, capsys):
    step = tmp_path / "step-3"
    shutil.copytree(ckpts / "run" / "step-3", step)
    chunk = _largest_weight_file(step)
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    with pytest.raises(SystemExit) as exited:
        cli(["eval", "--checkpoint", str(step), "--lessons", "echo", "--no-progress"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"marinrl eval: cannot load the weights of {step}: "), err


def test_loading_a_checkpoint_logs_no_unknown_leaf_lines(ckpts, caplog):
    """Levanter warns "Unknown leaf type" for each non-array leaf of the loading template: 16 stray lines per
    `marinrl eval` that say nothing is wrong (marinrl/models/policy_model.py filters them)."""
    import logging

    from marinrl.eval import load_policy, resolve_checkpoint

    with caplog.at_level(logging.WARNING):
        model, _ = load_policy(resolve_checkpoint(str(ckpts / "run" / "step-1")),
                               EvalConfig(checkpoint=str(ckpts / "run"), lessons=LESSONS))
    assert model.Vocab.size == VOCAB
    assert not [r for r in caplog.records if "Unknown leaf type" in r.getMessage()]
