"""What each actor of a job gets: the trainer's `TrainWorkerConfig` (with Levanter's `TrainerConfig` and
optimizer) and each rollout worker's `RolloutWorkerConfig`, derived from an `RLJobConfig`. Runtime, above
the config layer: the job config itself imports neither workers nor Levanter (docs/architecture.md). The
workers' modules are imported when a config is derived, in the actor that runs it: the driver stays free of
JAX and Levanter."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from marinrl.config.job import RLJobConfig
from marinrl.config.policies import policy_models, policy_names
from marinrl.job.placement import joins_jax_distributed
from marinrl.levanter_configs import levanter_trainer, to_levanter

if TYPE_CHECKING:
    from marinrl.config.rollout_worker import RolloutWorkerConfig
    from marinrl.config.train_worker import TrainWorkerConfig


def trainer_config(job: RLJobConfig):
    """Levanter's `TrainerConfig` of the job: `job.trainer` with what the job derives filled in. A trainer on
    part of a TPU host (`ray.trainer.tpu_chips`) is one process: Levanter must not call
    `jax.distributed.initialize`, which on a TPU VM finds the VM's slice metadata and would join it as that
    slice's process (with the coordinator port every process on the host would share)."""
    config = levanter_trainer(job.trainer, num_train_steps=job.num_train_steps,
                              train_batch_size=job.groups_per_step * job.n_generations, run_id=job.run_id,
                              seed=job.seed, run_dir=job.run_dir, require_accelerator=job.ray.trainer.has_accelerator)
    if joins_jax_distributed(job.ray.trainer):
        return config
    from levanter.distributed import DistributedConfig

    return dataclasses.replace(config, distributed=DistributedConfig(initialize_jax_distributed=False))


def train_worker_config(job: RLJobConfig, policies: Optional[tuple[str, ...]] = None) -> TrainWorkerConfig:
    """The trainer's config; `policies`: those its model plays (default: every policy of the job)."""
    from marinrl.config.train_worker import TrainWorkerConfig

    return TrainWorkerConfig(
        rollout_root=f"{job.run_dir}/rollouts", weights=job.weights_config(), model=job.model,
        trainer=trainer_config(job), optimizer=to_levanter(job.optimizer), loss=job.loss,
        replay=dataclasses.replace(job.replay, sampling=job.sampling(), seed=job.seed),
        batching=job.batching, groups_per_step=job.groups_per_step, sync_interval=job.sync_interval,
        checkpoint_every=job.checkpoint_every, checkpoint_keep=job.checkpoint_keep,
        checkpoint_keep_every=job.checkpoint_keep_every, lora=job.lora,
        policies=policies if policies is not None else policy_names(job), publish_dtype=job.rollout_dtype(),
        audit_root=f"{job.run_dir}/trained")


def rollout_worker_config(job: RLJobConfig, index: int) -> RolloutWorkerConfig:
    """Rollout worker `index`'s config: its share of each step's groups, its seed, a stream per policy model."""
    from marinrl.config.rollout_worker import ModelStream, RolloutWorkerConfig

    models = policy_models(job)
    streams = ((ModelStream("policy", (), f"{job.run_dir}/rollouts", job.weights_config(), job.lora),) if len(models) == 1
               else tuple(ModelStream(m.name, m.policies, f"{m.job.run_dir}/rollouts", m.job.weights_config(), m.job.lora)
                          for m in models))
    return RolloutWorkerConfig(
        streams=streams, groups_per_batch=job.groups_per_step // job.n_rollout_workers, n_generations=job.n_generations,
        max_staleness=job.max_staleness, final_step=job.num_train_steps, eval_every=job.eval_every,
        eval_examples=job.eval_examples, micro_eval_every=job.micro_eval_every,
        micro_eval_examples=job.micro_eval_examples, seed=job.seed * 1000 + index,
        max_consecutive_env_failures=job.max_consecutive_env_failures, warm_up_sampler=job.warm_up_sampler,
        inflight=job.inflight)
