"""The Ray actors of a job and what each gets: a trainer (`TrainerActor`, one per policy model on one host;
a multi-host trainer is a `TrainerGroup`, job/trainer_group.py), a rollout worker (`RolloutActor`), their
resources and their environment (accelerators, the compile cache, the variables passed from the driver).
Heavy imports (JAX, Levanter, the inference server) happen in the actors, never in the driver."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import TYPE_CHECKING, Callable, Optional

import ray

from marinrl import program_audit
from marinrl.config.errors import ConfigError
from marinrl.config.job import RLJobConfig
from marinrl.config.placement import PlacementConfig
from marinrl.curriculum.actor import CurriculumClient
from marinrl.job.placement import device_problem
from marinrl.job.plan import build_rollout_host, build_trainer
from marinrl.logs import log_to_file, overdue_waits
from marinrl.startup import StartupClock, import_tensorboardx_without_torch

if TYPE_CHECKING:
    from marinrl.config.train_worker import TrainWorkerConfig


_ACCELERATOR_ENV = ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_PORT",
                    "XLA_PYTHON_CLIENT_MEM_FRACTION")


def _accelerators() -> dict[str, str]:
    """The accelerators this actor was given (as Ray and `job/placement.actor_options` set them), for its result."""
    return {k: os.environ[k] for k in _ACCELERATOR_ENV if k in os.environ}


def check_devices(placement: PlacementConfig, field: str) -> None:
    """Refuses, in one line naming the field, devices that are not what the role asked for (`device_problem`).
    Only a role that asked for accelerators: on the CPU nothing is looked at (and no JAX backend started)."""
    if placement.devices() is None or placement.hosts() != 1:
        return
    import jax

    problem = device_problem(placement, field, jax.local_devices())
    if problem:
        field_name, _, message = problem.partition(": ")
        raise ConfigError(field_name, message)


def compilation_cache_dir(config: RLJobConfig) -> str:
    """Where every actor's JAX keeps compiled programs: the driver's `JAX_COMPILATION_CACHE_DIR`, else
    `trainer.jax_compilation_cache_dir`, else on a cluster with a remote `run_root` (`gs://…`)
    `<run_root>/jax_cache`, which every host reads (a path on the driver's disk would be a different,
    empty cache on each host), else `.jax_cache` under the driver's working directory."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    if config.trainer.jax_compilation_cache_dir:
        return str(config.trainer.jax_compilation_cache_dir)
    root = str(config.run_root)
    if config.ray.address is not None and "://" in root and not root.startswith("file://"):
        return f"{root.rstrip('/')}/jax_cache"
    return str(pathlib.Path(".jax_cache").resolve())


# Passed from the driver's environment to the actors when set: wandb runs online unless WANDB_MODE says not.
_PASSTHROUGH = ("XLA_FLAGS", "USE_TORCH", "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                "GOOGLE_AUTH_TOKEN_FOR_TESTING",
                "TENSORSTORE_GCS_REQUEST_CONCURRENCY", "WANDB_MODE", "WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT",
                "WANDB_BASE_URL", "WANDB_DIR", program_audit.AUDIT_ENV,
                # glibc's allocator: a memory-tight host returns freed weight buffers to the OS with
                # MALLOC_MMAP_THRESHOLD_ (docs/performance.md, "Memory")
                "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def actor_env(compilation_cache: Optional[str] = None) -> dict[str, str]:
    """What every actor of the job runs with (`compilation_cache`: `compilation_cache_dir(config)`; None:
    the driver's `JAX_COMPILATION_CACHE_DIR`, else `.jax_cache` here)."""
    # USE_TORCH=0: `import levanter` imports transformers, which imports torch when it finds it: 250 MB
    # of resident memory and seconds of CPU per actor for nothing (docs/performance.md, "Memory").
    # Levanter's reader of pytorch_model.bin checkpoints imports torch itself and still works; set
    # USE_TORCH=1 in the driver's environment for an environment that needs transformers' torch models.
    env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "USE_TORCH": "0"}
    cache = (compilation_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR")
             or str(pathlib.Path(".jax_cache").resolve()))
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    for passthrough in _PASSTHROUGH:
        if os.environ.get(passthrough):
            env[passthrough] = os.environ[passthrough]
    return {k: v for k, v in env.items() if v}


@ray.remote(max_concurrency=2)
class TrainerActor:
    def __init__(self, plan: Callable[[], TrainWorkerConfig], curriculum_name: Optional[str], namespace: Optional[str],
                 log_dir: Optional[str] = None, job_started_at: Optional[float] = None, log_name: str = "trainer",
                 placement: Optional[PlacementConfig] = None):
        """`plan` derives the trainer's config here, in the actor (`job.plan.train_worker_config`: it imports
        Levanter, which the driver never does), and `job.plan.build_trainer` its parts. `curriculum_name`
        None: a trainer that does not keep the curriculum's clock (the other policy models' trainers of a job
        of several: the first one's keeps it). `placement`: a one-process trainer's, whose devices are checked
        first (`check_devices`)."""
        clock = StartupClock(job_started_at)  # first: its "ready" phase ends here
        if placement is not None:
            check_devices(placement, "ray.trainer")
        import_tensorboardx_without_torch()  # before Levanter's tracker imports it
        from marinrl.train.worker import TrainWorker

        if log_dir:  # named loggers: Levanter's initialize() replaces the root logger's handlers
            log_to_file(log_dir, log_name, loggers=("marinrl", "levanter"))

        curriculum = (CurriculumClient(ray.get_actor(curriculum_name, namespace=namespace))
                      if curriculum_name is not None else None)
        config = plan()
        self.worker = TrainWorker(config, build_trainer(config), curriculum=curriculum, startup=clock)

    def run(self) -> dict:
        result = self.worker.run()
        return {**dataclasses.asdict(result), "node_id": ray.get_runtime_context().get_node_id(),
                "accelerators": _accelerators()}

    def progress(self) -> dict:
        return {"step": self.worker.step, **(self.worker.history[-1] if self.worker.history else {})}

    def trained_groups(self) -> list[tuple[int, list[str]]]:
        """(step, group ids trained at it) for every step so far: survives in no result if the trainer dies."""
        return [(h["step"], list(g)) for h, g in zip(list(self.worker.history), list(self.worker.trained_groups))]

    def stop(self) -> bool:
        """Whether the trainer is training (`TrainWorker.stop`): False, it is starting and has nothing to save."""
        return self.worker.stop()


@ray.remote(max_concurrency=2)
class RolloutActor:
    def __init__(self, job: RLJobConfig, index: int, curriculum_name: str, namespace: Optional[str],
                 log_dir: Optional[str] = None, job_started_at: Optional[float] = None):
        clock = StartupClock(job_started_at)  # first: its "ready" phase ends here
        check_devices(job.ray.rollout, "ray.rollout")
        import_tensorboardx_without_torch()  # before its tracker imports it
        from marinrl.rollout.manager import RolloutManager
        from marinrl.rollout.worker import RolloutWorker

        if log_dir:  # the root logger: environments' own loggers included
            log_to_file(log_dir, f"rollout-{index}")

        host = build_rollout_host(job, index, clock)
        curriculum = CurriculumClient(ray.get_actor(curriculum_name, namespace=namespace))
        manager = RolloutManager(host.server, host.lessons, curriculum)
        self.worker = RolloutWorker(host.config, manager, curriculum, clients=host.clients,
                                    worker_id=f"rollout-{index}", tracker=_rollout_tracker(job, index),
                                    startup=clock,  # a previous job's weights on this run are not this trainer's:
                                    min_epoch=None if job_started_at is None else int(job_started_at * 1e9))
        self._rss_before_model = host.rss_before_model
        self._program_constants = None
        if program_audit.auditing():  # the scan sampler's program; Levanter's engine takes its model as an
            # argument too (swapping `engine.model` never recompiles), so it holds no weights either
            self._program_constants = max(
                program_audit.sampler_constant_bytes(s.model, None if s.mesh is None else s.mesh.mesh)
                for s in host.servers.values())

    def run(self) -> dict:
        try:
            return {**self.worker.run(), "node_id": ray.get_runtime_context().get_node_id(),
                    "accelerators": _accelerators(),
                    "process": program_audit.process_stats(self._rss_before_model, self._program_constants)}
        finally:
            self.worker.tracker.finish()  # flush its event files: the actor is killed once the job ends

    def stop(self) -> None:
        self.worker.stop()

    def waits(self, after_s: float) -> list[str]:
        """This worker's waits on environment servers older than `after_s` (marinrl/logs.py), for the terminal."""
        return overdue_waits(after_s)


def _rollout_tracker(job: RLJobConfig, index: int):
    from levanter.tracker import CompositeTracker
    from levanter.tracker.json_logger import JsonLoggerConfig
    from levanter.tracker.tensorboard import TensorboardConfig

    run = f"{job.run_id}-rollout-{index}"
    return CompositeTracker([JsonLoggerConfig(logger_name=f"marinrl.rollout.{index}").init(run),
                             TensorboardConfig(logdir=f"{job.run_dir}/tensorboard/rollout-{index}").init(run)])


# ---------------------------------------------------------------------- the job
