"""RLJobConfig carries Levanter's own knobs (`trainer`: TrainerConfig, `optimizer`: OptimizerConfig)
through to the TrainWorkerConfig, keeps the CPU defaults the job always had, and refuses a derived
field set twice with two values, naming both fields."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import draccus
import jmp
import pytest
import yaml
from levanter.checkpoint import CheckpointerConfig
from levanter.optim import AdamConfig
from levanter.tracker.json_logger import JsonLoggerConfig
from levanter.tracker.tensorboard import TensorboardConfig
from levanter.tracker.wandb import WandbConfig

from marinrl.config.errors import ConfigInputError, load_job_config
from marinrl.config.trainer import RLAdamConfig
from marinrl.job.actors import actor_env
from marinrl.job.plan import rollout_worker_config, train_worker_config
from marinrl.job.rl_job import ConfigError, RLJobConfig
from marinrl.levanter_configs import cpu_trainer_config

REPO = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.yaml"


def _parse(tmp_path, extra: dict | None = None, args: tuple[str, ...] = ()) -> RLJobConfig:
    """experiments/quickstart.yaml plus `extra`'s top-level keys, parsed as `marinrl train` parses it."""
    config = yaml.safe_load(QUICKSTART.read_text())
    config.update(extra or {})
    config["run_root"] = str(tmp_path / "runs")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return draccus.parse(RLJobConfig, config_path=str(path), args=list(args))


def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def test_the_quickstart_builds_the_trainer_and_optimizer_it_always_had(tmp_path):
    job = _parse(tmp_path)
    job.validate()
    built = train_worker_config(job)
    run_dir = job.run_dir
    before = cpu_trainer_config(  # what RLJobConfig.train_worker_config built before trainer/optimizer were fields
        num_train_steps=200, train_batch_size=32 * 16, id="quickstart", seed=0, log_dir=pathlib.Path(run_dir) / "logs",
        tracker=(JsonLoggerConfig(), TensorboardConfig(logdir=f"{run_dir}/tensorboard/trainer")),
        checkpointer=CheckpointerConfig(base_path=f"{run_dir}/checkpoints", append_run_id_to_base_path=False))
    assert _fields(built.trainer) == _fields(before)
    assert _fields(built.optimizer) == _fields(AdamConfig(learning_rate=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.999,
                                                          max_grad_norm=1.0, warmup=0.0, lr_schedule="constant"))
    assert built.sync_interval == 1


def test_levanter_knobs_reach_the_train_worker_config(tmp_path):
    job = _parse(tmp_path, {
        "trainer": {"model_axis_size": 2, "tensor_parallel_axes": ["mlp", "heads"], "per_device_parallelism": 4,
                    "mp": "p=f32,c=bfloat16", "jax_compilation_cache_dir": str(tmp_path / "jax_cache"),
                    "tracker": [{"type": "json_logger"},
                                {"type": "wandb", "project": "marinrl-test", "mode": "offline"}]},
        "optimizer": {"type": "adam", "learning_rate": 3e-4, "lr_schedule": "cosine", "warmup": 0.1, "decay": 0.2,
                      "weight_decay": 0.01, "max_grad_norm": 0.5, "min_lr_ratio": 0.05},
        "sync_interval": 2, "micro_eval_every": 3,
    })
    job.validate()
    built = train_worker_config(job)
    trainer = built.trainer
    assert trainer.model_axis_size == 2 and trainer.tensor_parallel_axes == ["mlp", "heads"]
    assert trainer.per_device_parallelism == 4 and trainer.microbatch_size == 4 * trainer.data_axis_size
    assert trainer.mp == jmp.get_policy("p=f32,c=bfloat16")
    assert trainer.jax_compilation_cache_dir == str(tmp_path / "jax_cache")
    assert trainer.tracker == (JsonLoggerConfig(), WandbConfig(project="marinrl-test", mode="offline"))
    assert (trainer.num_train_steps, trainer.train_batch_size, trainer.id) == (200, 512, "quickstart")  # still derived
    assert type(built.optimizer) is AdamConfig  # Levanter's own `adam`, with Levanter's defaults for the rest
    assert (built.optimizer.learning_rate, built.optimizer.lr_schedule, built.optimizer.warmup, built.optimizer.decay,
            built.optimizer.weight_decay, built.optimizer.max_grad_norm, built.optimizer.beta2) == (
        3e-4, "cosine", 0.1, 0.2, 0.01, 0.5, AdamConfig().beta2)
    assert built.sync_interval == 2 and rollout_worker_config(job, 0).micro_eval_every == 3


def test_a_flag_on_one_knob_keeps_marinrls_defaults_for_the_others(tmp_path):
    """draccus builds a nested config a flag touches from its class defaults: those must be marinrl's."""
    job = _parse(tmp_path, args=("--optimizer.warmup", "10", "--trainer.per_device_parallelism", "8"))
    assert job.optimizer == RLAdamConfig(learning_rate=1e-3, warmup=10)
    trainer = train_worker_config(job).trainer
    assert trainer.per_device_parallelism == 8
    assert trainer.require_accelerator is False and trainer.tracker[0] == JsonLoggerConfig()


@pytest.mark.parametrize(
    "args, derived_from",
    [
        (("--trainer.num_train_steps", "50"), "the job sets trainer.num_train_steps from num_train_steps"),
        (("--trainer.train_batch_size", "64"),
         "the job sets trainer.train_batch_size from groups_per_step × n_generations"),
        (("--trainer.id", "other"), "the job sets trainer.id from run_id"),
        (("--trainer.seed", "3"), "the job sets trainer.seed from seed"),
        (("--trainer.log_dir", "/elsewhere"), "the job sets trainer.log_dir from run_root and run_id"),
    ],
)
def test_a_derived_trainer_field_is_refused_naming_where_the_job_sets_it(tmp_path, args, derived_from):
    """Levanter's fields the job derives are not part of `trainer:`: a flag or a YAML key that sets one is
    an unknown field whose message says which job field to set instead."""
    path = tmp_path / "job.yaml"
    path.write_text(QUICKSTART.read_text())
    with pytest.raises(ConfigInputError, match=re.escape(derived_from)):
        load_job_config(RLJobConfig, str(path), list(args))
    config = yaml.safe_load(QUICKSTART.read_text())
    config["trainer"] = {args[0].split(".")[1]: 1}
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigInputError, match=re.escape(derived_from.replace("trainer.", ""))):
        load_job_config(RLJobConfig, str(path), [])


DERIVED_FLAG_VALUES = {"replay.sampling": '{"type": "on_policy"}', "replay.seed": "7",
                       "inference.lm_head_float32": "true"}
"""A value other than the default for each derived field a job config has (the others take any value)."""


@pytest.mark.parametrize("field", sorted(RLJobConfig.DERIVED_FIELDS))
def test_every_derived_field_is_refused_with_its_rows_message(tmp_path, field):
    """`DERIVED_FIELDS` is the one table of the fields the job sets itself: each row, set by a flag, is refused
    with its message: when the config is read where the field is no field of the job's configs (Levanter's
    trainer fields), else by `validate`."""
    derived = RLJobConfig.DERIVED_FIELDS[field]
    path = tmp_path / "job.yaml"
    path.write_text(QUICKSTART.read_text())
    args = [f"--{field}", DERIVED_FLAG_VALUES.get(field, "1")]
    if field.startswith("trainer."):
        with pytest.raises(ConfigInputError, match=re.escape(derived.refusal(field))):
            load_job_config(RLJobConfig, str(path), args)
        return
    job = load_job_config(RLJobConfig, str(path), args)
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.{re.escape(field)}: {re.escape(derived.refusal(field))}$"):
        job.validate()


@pytest.mark.parametrize(
    "args, field, problem",
    [
        (("--optimizer.learning_rate", "0"), "optimizer.learning_rate", "must be finite and > 0, got 0.0"),
        (("--optimizer.weight_decay", "-0.1"), "optimizer.weight_decay", "must be >= 0"),
        (("--optimizer.beta2", "1.0"), "optimizer.beta2", r"must be in \[0, 1\)"),
        (("--optimizer.max_grad_norm", "0"), "optimizer.max_grad_norm", "must be > 0 or null"),
        (("--optimizer.warmup", "-5"), "optimizer.warmup", "must be >= 0"),
        (("--trainer.model_axis_size", "0"), "trainer.model_axis_size", "must be >= 1, got 0"),
        (("--trainer.per_device_parallelism", "0"), "trainer.per_device_parallelism", "must be -1"),
        (("--trainer.per_device_parallelism", "5"), "trainer.per_device_parallelism",
         "5 rows per device do not divide the batch of groups_per_step × n_generations = 32 × 16 = 512 rows"),
        (("--ray.trainer.num_gpus", "8", "--trainer.model_axis_size", "3"), "trainer.model_axis_size",
         r"model_axis_size=3 × replica_ici_axis_size=1 does not divide the trainer's 8 devices "
         r"\(ray.trainer.num_gpus=8\)"),
        (("--ray.trainer.num_gpus", "8", "--groups_per_step", "2", "--n_generations", "3"), "groups_per_step",
         "the batch of groups_per_step × n_generations = 2 × 3 = 6 rows does not divide among the trainer's 8"),
        (("--ray.trainer.tpu", "v5litepod-8", "--trainer.per_device_parallelism", "128"),
         "trainer.per_device_parallelism",
         "microbatches of 128 rows × 8 data-parallel devices do not divide the batch"),
        (("--sync_interval", "3"), "sync_interval",
         "weights published every 3 steps .* with max_staleness=1 they must be at most 2 steps apart"),
        (("--sync_interval", "2", "--max_staleness", "0"), "sync_interval",
         "weights published every 2 steps .* with max_staleness=0 they must be at most 1 steps apart"),
        (("--micro_eval_every", "-1"), "micro_eval_every", "must be >= 0"),
        (("--optimizer.lr_schedule", "sawtooth"), "optimizer.lr_schedule", "unknown schedule 'sawtooth': use one of"),
        (("--optimizer.warmup", "1.5"), "optimizer.warmup", "1.5 is neither a fraction of the steps in"),
        (("--optimizer.cycle_length", "10", "--optimizer.cycles", "2"), "optimizer.cycle_length",
         "set cycle_length, cycles or haps, not two of them"),
        (("--replay.sampling", '{"type": "replay", "uses": 3}'), "replay.sampling",
         "a job's sampling strategy follows from max_staleness and max_uses"),
        (("--replay.seed", "7"), "replay.seed", "a job's replay buffer draws with the job's `seed`"),
    ],
)
def test_a_knob_out_of_range_is_refused_naming_it(tmp_path, args, field, problem):
    from marinrl.job.preflight import check_optimizer

    job = _parse(tmp_path, args=args)
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.{re.escape(field)}: {problem}"):
        job.validate()
        check_optimizer(job.optimizer, job.num_train_steps)


def test_the_accelerator_is_required_where_the_placement_asks_for_one(tmp_path):
    """A trainer placed on GPUs whose JAX falls back to the CPU must fail, not train slowly."""
    assert train_worker_config(_parse(tmp_path, args=("--ray.trainer.num_gpus", "8"))).trainer.require_accelerator
    assert train_worker_config(_parse(tmp_path, args=("--ray.trainer.tpu", "v6e-8"))).trainer.require_accelerator
    assert not train_worker_config(_parse(tmp_path)).trainer.require_accelerator
    explicit = _parse(tmp_path, args=("--ray.trainer.num_gpus", "8", "--trainer.require_accelerator", "false"))
    assert train_worker_config(explicit).trainer.require_accelerator is False


def test_the_trainers_replay_takes_the_jobs_sampling_and_seed(tmp_path):
    """What `replay.sampling` / `replay.seed` would set is derived from the job's own fields (the YAML forms are
    refused above), and reaches the trainer."""
    from marinrl.config.replay import ReplaySamplingConfig

    job = _parse(tmp_path, args=("--max_uses", "3", "--max_staleness", "2", "--seed", "5"))
    job.validate()
    replay = train_worker_config(job).replay
    assert replay.sampling == ReplaySamplingConfig(staleness=2, uses=3) and replay.seed == 5


def test_wandb_mode_is_the_users(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert "WANDB_MODE" not in actor_env()  # online when the tracker asks for wandb and nothing says otherwise
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "p")
    env = actor_env()
    assert env["WANDB_MODE"] == "offline" and env["WANDB_PROJECT"] == "p"



def test_range_checks_name_the_one_bad_field_and_refuse_nan():
    """`config_checks.require_at_least` / `require_above`: one message per field, NaN refused like any bad value."""
    from marinrl.config.replay import ReplaySamplingConfig
    from marinrl.envs.openai_env import OpenAIEnvConfig
    from marinrl.multihost import ProcessGroupConfig

    with pytest.raises(ValueError, match=r"^replay\.uses must be >= 1, got 0$"):
        ReplaySamplingConfig(uses=0)
    with pytest.raises(ValueError, match=r"^ProcessGroupConfig\.initialization_timeout_s must be >= 1, got 0$"):
        ProcessGroupConfig(num_processes=1, process_id=0, initialization_timeout_s=0)
    with pytest.raises(ValueError, match=r"^OpenAIEnvConfig\.backoff_initial must be >= 0, got nan$"):
        OpenAIEnvConfig(backoff_initial=float("nan"))
    with pytest.raises(ValueError, match=r"^OpenAIEnvConfig\.episode_timeout must be > 0, got 0$"):
        OpenAIEnvConfig(episode_timeout=0)


_AT_LEAST_1 = ("num_train_steps", "groups_per_step", "n_generations", "n_rollout_workers", "eval_examples", "max_uses",
               "max_consecutive_env_failures", "checkpoint_keep", "sync_interval", "micro_eval_examples")
_AT_LEAST_0 = ("max_staleness", "eval_every", "checkpoint_every", "checkpoint_keep_every", "seed", "micro_eval_every")


@pytest.mark.parametrize("field, value, problem", [
    *[(name, "0", "must be >= 1, got 0") for name in _AT_LEAST_1],
    *[(name, "-1", "must be >= 0, got -1") for name in _AT_LEAST_0],
    ("num_train_steps", "1000000001", "must be <= 1_000_000_000, got 1_000_000_001: the trainer counts steps"),
    ("groups_per_step", "1000001", "must be <= 1_000_000, got 1_000_001: "),
    ("n_generations", "10001", "must be <= 10_000, got 10_001: "),
    ("ray.num_cpus", "0", "must be >= 1 or null, got 0"),
    ("ray.placement_timeout_s", "-1", "must be >= 0, got -1"),
    ("ray.max_rollout_restarts", "-1", "must be >= 0, got -1"),
    ("ray.stop_timeout_s", "0", "must be > 0, got 0"),
])
def test_validate_refuses_every_count_out_of_range_before_ray(tmp_path, field, value, problem):
    """Every range `RLJobConfig.validate()` checks, one at a time: a check removed from validate() would move
    its refusal after Ray starts (issue 33)."""
    job = _parse(tmp_path, args=(f"--{field}", value))
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.{re.escape(field)}: {re.escape(problem)}"):
        job.validate()
