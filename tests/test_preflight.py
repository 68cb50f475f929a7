"""RLJob checks everything it can before Ray starts (marinrl.job.preflight): each mistake is one
ConfigError naming the field, raised by the constructor, so no actor, trainer or Ray ever runs."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import time

import jax.numpy as jnp
import pytest
import ray
from levanter.checkpoint import save_checkpoint
from test_job import ECHO, job_config

from marinrl.config.batching import BatchingConfig
from marinrl.config.curriculum import CurriculumConfig
from marinrl.config.env import EnvConfig
from marinrl.config.loss import LossConfig
from marinrl.config.model import ModelConfig
from marinrl.config.trainer import RLAdamConfig
from marinrl.job.rl_job import ConfigError, RLJob

QUICKSTART = pathlib.Path(__file__).parents[1] / "experiments" / "quickstart.yaml"


@pytest.mark.parametrize(
    "env, field, problem",
    [
        (EnvConfig("echo", {"frobnicate": 3}), "env.args", "unexpected keyword argument 'frobnicate'"),
        (EnvConfig("echo", {"alphabet_size": 99}), "env.args", r"alphabet_size must be in \[2, 26\], got 99"),
        (EnvConfig("echoo", {}), "env.name", "unknown environment 'echoo'; registered: .*'echo'"),
        (EnvConfig("math", {"path": "/nonexistent/problems.jsonl"}), "env.args", "/nonexistent/problems.jsonl"),
    ],
)
def test_an_environment_that_cannot_be_built_fails_in_the_constructor(tmp_path, env, field, problem):
    cfg = job_config(tmp_path, curriculum=CurriculumConfig(lessons=(dataclasses.replace(ECHO, env=env),)))
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.curriculum\.lessons\[echo\]\.{field}: .*{problem}"):
        RLJob(cfg)


@pytest.mark.parametrize(
    "overrides, field, problem",
    [
        (dict(optimizer=RLAdamConfig(learning_rate=-1.0)), "optimizer.learning_rate",
         "must be finite and > 0, got -1.0"),
        (dict(optimizer=RLAdamConfig(learning_rate=float("nan"))), "optimizer.learning_rate", "must be finite and > 0"),
        (dict(checkpoint_every=-1), "checkpoint_every", "must be >= 0, got -1"),
        (dict(eval_every=-2), "eval_every", "must be >= 0"),
        (dict(seed=-1), "seed", "must be >= 0"),
        (dict(checkpoint_keep=0), "checkpoint_keep", "must be >= 1, got 0"),
        (dict(checkpoint_keep_every=-1), "checkpoint_keep_every", "must be >= 0"),
        (dict(max_consecutive_env_failures=0), "max_consecutive_env_failures", "must be >= 1"),
        (dict(eval_examples=0), "eval_examples", "must be >= 1"),
        (dict(n_generations=1), "n_generations", "makes every advantage 0"),
        (dict(n_generations=1, loss=LossConfig(advantage="rloo")), "n_generations", "advantage='rloo'"),
        (dict(batching=BatchingConfig(max_length=64, min_bucket=8)), "batching.max_length",
         "64 is longer than the model's 32 positions"),
    ],
)
def test_numbers_out_of_range_are_refused(tmp_path, overrides, field, problem):
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.{field}: .*{problem}"):
        RLJob(job_config(tmp_path, **overrides))


def test_a_response_budget_longer_than_a_training_row_is_refused(tmp_path):
    lesson = dataclasses.replace(ECHO, max_tokens=32)
    with pytest.raises(ConfigError, match=r"lessons\[echo\]\.max_tokens: 32 new tokens do not fit .*max_length=32"):
        RLJob(job_config(tmp_path, curriculum=CurriculumConfig(lessons=(lesson,))))


def _hf_dir(tmp_path, files: dict[str, str]) -> str:
    path = tmp_path / "hf"
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "files, problem",
    [
        (None, "Hugging Face checkpoint directory not found"),
        ({}, r"has no config.json: not a Hugging Face checkpoint \(empty\)"),
        ({"config.json": '{"model_type": "llama",', "model.safetensors": ""}, r"config.json:1:\d+: not valid JSON"),
        ({"config.json": json.dumps({"model_type": "llama"})}, "has no weights"),
        ({"config.json": json.dumps({"model_type": "bert"}), "model.safetensors": ""},
         "Levanter has no model for HF model_type 'bert'"),
    ],
)
def test_a_missing_empty_or_corrupt_hf_checkpoint_is_one_line(tmp_path, files, problem):
    path = str(tmp_path / "missing") if files is None else _hf_dir(tmp_path, files)
    cfg = job_config(tmp_path, model=ModelConfig(hf_checkpoint=path))
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.model\.hf_checkpoint: .*{problem}") as e:
        RLJob(cfg)
    assert "\n" not in str(e.value)


def test_a_missing_tokenizer_or_levanter_checkpoint_names_its_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^RLJobConfig\.model\.tokenizer: .*tokenizer directory not found"):
        RLJob(job_config(tmp_path,
                         model=dataclasses.replace(job_config(tmp_path).model, tokenizer=str(tmp_path / "t"))))
    with pytest.raises(ConfigError, match=r"^RLJobConfig\.model\.levanter_checkpoint: Levanter checkpoint not found"):
        RLJob(job_config(tmp_path, model=ModelConfig(levanter_checkpoint=str(tmp_path / "ckpt"))))


def test_a_run_root_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.run_root: cannot write under {blocker}/job"):
        RLJob(job_config(tmp_path, run_root=str(blocker)))


def test_a_good_config_passes_and_leaves_only_its_run_directory(tmp_path):
    cfg = job_config(tmp_path / "runs")
    RLJob(cfg)  # the quickstart's config is timed in docs/configuration.md; here it only has to pass
    assert os.listdir(tmp_path / "runs" / "job") == []  # the probe file is gone


def test_a_good_gcs_run_root_passes(gcs_root, tmp_path):
    RLJob(job_config(tmp_path, run_root=gcs_root))


def test_preflight_of_the_quickstart_is_quick(tmp_path):
    """Not a timing assertion: a report of what preflight costs, and proof it passes on the shipped config."""
    import draccus

    from marinrl.job.rl_job import RLJobConfig

    cfg = draccus.parse(RLJobConfig, config_path=str(QUICKSTART), args=["--run_root", str(tmp_path)])
    started = time.perf_counter()
    job = RLJob(cfg)
    print(f"preflight of experiments/quickstart.yaml: {time.perf_counter() - started:.3f} s")
    assert os.listdir(tmp_path / cfg.run_id) == []  # the run folder was made and probed, its probe deleted
    assert job.config.curriculum == cfg.curriculum and job.config.model == cfg.model  # checked, not changed


# ------------------------------------------------------------------------- a trainer that dies


def trainer_death_message(error, checkpoints):
    from marinrl.job.outcomes import trainer_death_message

    return trainer_death_message(error, checkpoints)


def _task_error(cause: BaseException) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("TrainerActor.run", "Traceback (most recent call last): ...", cause)


def test_a_dead_trainer_names_its_checkpoint_only_when_one_exists(tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    message = trainer_death_message(_task_error(MemoryError("out of memory")), checkpoints)
    assert message.startswith("the trainer died: MemoryError: out of memory\n")
    assert "no checkpoint was written" in message and "starts from step 0" in message
    assert "resume" not in message

    save_checkpoint({"x": jnp.zeros(2)}, step=4, checkpoint_path=f"{checkpoints}/step-4")
    message = trainer_death_message(_task_error(MemoryError("out of memory")), checkpoints)
    assert f"resume from its last checkpoint, {checkpoints}/step-4" in message


def test_a_trainer_killed_by_an_input_error_says_to_fix_it_not_to_resume(tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    message = trainer_death_message(_task_error(FileNotFoundError("no such file: tok.json")), checkpoints)
    assert message.splitlines() == ["the trainer died: FileNotFoundError: no such file: tok.json",
                                    "this is a config or input error: fix it, then run the config again"]
    save_checkpoint({"x": jnp.zeros(2)}, step=2, checkpoint_path=f"{checkpoints}/step-2")
    message = trainer_death_message(_task_error(ValueError("bad")), checkpoints)
    assert message.endswith(f"fix it, then run the config again (it resumes from {checkpoints}/step-2)")


def test_a_trainer_killed_by_ray_for_memory_gets_advice_in_two_lines(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    checkpoints = str(tmp_path / "checkpoints")
    save_checkpoint({"x": jnp.zeros(2)}, step=2, checkpoint_path=f"{checkpoints}/step-2")
    killed = ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.\n"
                                             "Memory on the node (IP: 10.0.0.2) where the task was running ...\n" * 30)
    message = trainer_death_message(killed, checkpoints)
    assert message.splitlines() == [
        "the trainer died: Ray killed it for memory: the node's memory use passed RAY_memory_usage_threshold (0.95 "
        "unless set where Ray started)",
        message.splitlines()[1]]
    assert message.splitlines()[1].startswith("give the trainer and rollout workers more memory, or ask less of it: ")
    assert message.endswith(f"then run the same config again (it resumes from {checkpoints}/step-2)")


RAY_OOM_KILL = pathlib.Path(__file__).parent / "fixtures" / "ray_2.60_oom_kill_threshold_0.05.txt"
"""What Ray 2.60 raised (ray.get of an actor's call) when its memory monitor killed the actor under
RAY_memory_usage_threshold=0.05: captured from a local Ray on a 24 GiB machine."""


def _advised_fields(advice: str) -> list[str]:
    """The config fields a line of advice names: lowercase words joined by `_` or `.` (environment variables aside)."""
    return sorted(set(re.findall(r"\b[a-z]+(?:[._][a-z]+)+\b", advice)))


def test_ray_killing_the_trainer_for_memory_names_the_threshold_in_force_and_only_settable_fields(tmp_path,
                                                                                               monkeypatch):
    """Ray's own message names the threshold it killed at (here 5%, not its default 95%): the first line carries
    it, the advice says to raise it, and every field the advice names is one a job config may set."""
    from marinrl.config.errors import load_job_config
    from marinrl.config.job import DERIVED_FIELDS, RLJobConfig

    monkeypatch.setenv("RAY_memory_usage_threshold", "0.9")  # Ray's message wins over this driver's environment
    killed = ray.exceptions.OutOfMemoryError(RAY_OOM_KILL.read_text())
    what, advice = trainer_death_message(killed, str(tmp_path / "checkpoints")).splitlines()
    assert what == ("the trainer died: Ray killed it for memory: the node used 13.76GB of 23.59GB, over "
                    "RAY_memory_usage_threshold=0.05")
    assert advice.startswith("Ray kills at RAY_memory_usage_threshold=0.05, below its default 0.95: unless that is "
                             "meant, raise it (or unset it) where Ray starts")
    fields = _advised_fields(advice)
    assert {"trainer.per_device_parallelism", "batching.max_length", "groups_per_step", "n_generations",
            "n_rollout_workers"} <= set(fields), fields
    config = load_job_config(RLJobConfig, str(QUICKSTART), [])
    for field in fields:  # each parses as a flag of `marinrl train` (its value as the config has it)
        assert field not in DERIVED_FIELDS, field
        value = functools.reduce(getattr, field.split("."), config)
        parsed = load_job_config(RLJobConfig, str(QUICKSTART), [f"--{field}={value}"])
        assert functools.reduce(getattr, field.split("."), parsed) == value, field


@pytest.mark.parametrize(
    "text, environment, threshold",
    [
        ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.2, ID: ab) where "
         "the task was running was 32.91GB / 33.28GB (0.988698), which exceeds the memory usage threshold of "
         "0.969955. Ray killed this worker (ID: cd) because it was the most recently scheduled task", None,
         "the node used 32.91GB of 33.28GB, over RAY_memory_usage_threshold=0.969955"),
        ("Worker exit detail: killed due to memory pressure", "0.8",
         "the node's memory use passed RAY_memory_usage_threshold=0.8"),
    ],
    ids=["older-ray-message", "driver-environment"],
)
def test_the_memory_threshold_comes_from_rays_message_else_the_drivers_environment(tmp_path, monkeypatch, text,
                                                                                   environment, threshold):
    if environment is None:
        monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    else:
        monkeypatch.setenv("RAY_memory_usage_threshold", environment)
    what, advice = trainer_death_message(ray.exceptions.OutOfMemoryError(text), str(tmp_path)).splitlines()
    assert what == f"the trainer died: Ray killed it for memory: {threshold}"
    assert advice.startswith("Ray kills at RAY_memory_usage_threshold=") == (environment is not None)


def _disk_full_error() -> OSError:
    """A real ENOSPC: /dev/full refuses every write with it."""
    try:
        with open("/dev/full", "w") as f:
            f.write("checkpoint")
            f.flush()
    except OSError as e:
        return e
    raise AssertionError("/dev/full accepted a write")


@pytest.mark.skipif(not pathlib.Path("/dev/full").exists(), reason="no /dev/full on this OS")
def test_a_trainer_that_ran_out_of_disk_says_so_naming_the_checkpoint_folder(tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    save_checkpoint({"x": jnp.zeros(2)}, step=2, checkpoint_path=f"{checkpoints}/step-2")
    for error in (_disk_full_error(),  # the OS's own
                  ValueError("Error writing local file \"/ckpt/step-4/d/0\": [OS error: No space left on device]")):
        message = trainer_death_message(_task_error(error), checkpoints)
        advice = message.splitlines()[-1]
        assert advice == (f"no space left on the device of {checkpoints}: free space there (or move run_root), "
                          f"then run the same config again (it resumes from {checkpoints}/step-2)")
        assert "config or input error" not in message


@pytest.mark.parametrize("overrides, problem", [(dict(dtype="flaot32"), "ModelConfig.dtype must be a float dtype"),
                                                (dict(dtype="int32"), "ModelConfig.dtype must be a float dtype"),
                                                (dict(init_std=-0.02), "ModelConfig.init_std must be finite and > 0")])
def test_a_model_config_with_a_bad_dtype_or_init_std_is_refused_when_built(overrides, problem):
    with pytest.raises(ValueError, match=problem):
        ModelConfig(**overrides)


def test_a_gs_run_root_without_credentials_is_refused_naming_what_is_missing(tmp_path, monkeypatch):
    """google.auth finds no credentials (a key file that does not exist, no gcloud config, no emulator):
    the run directory check says so in about a second instead of gcsfs's minute of retries."""
    from marinrl.job.preflight import check_writable

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    with pytest.raises(ConfigError, match=r"^RLJobConfig\.run_root: gs://my-bucket/runs/x: no Google Cloud credentials "
                                          r"\(.*missing-key\.json.*\): run `gcloud auth application-default login`"):
        check_writable("gs://my-bucket/runs/x", "run_root")
