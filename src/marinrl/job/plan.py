"""One builder per role: what the trainer, each rollout host and an offline evaluation are given, built from
their configs in one place, so that the Ray actors (job/actors.py) and `marinrl eval` (eval.py) are thin
shells around the same wiring.

- the trainer: `train_worker_config` (with Levanter's `TrainerConfig` and optimizer) and `build_trainer`,
  its parts (`TrainerParts`: the weight server, the replay buffer over the run's rollout files, the
  checkpoint writer, the audit trail, the frozen reference), handed to the TrainWorker, whose `run()` is
  the loop; a part that needs what Levanter loads is a function the loop calls;
- a rollout host: `build_rollout_host` — the tokenizer, an inference server per `full` or shared policy model
  and one per base for the `lora` ones (a slot each: `rollout/shared_base.py`), in the dtype their trainers
  publish (behind a `PolicyRouter` when there are several models), each lesson's runtime, a weight client per
  stream, and the `RolloutWorkerConfig`;
- an offline evaluation: `lesson_runtimes` and `serve`, as a rollout host builds them.

The job config itself imports neither workers nor Levanter (docs/architecture.md, "Layers"); the workers'
modules are imported when a role is built, in the process that runs it: the driver stays free of JAX and
Levanter."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from marinrl.config.job import RLJobConfig
from marinrl.config.policies import PolicyModel, policy_models, trainers
from marinrl.levanter_configs import to_levanter, trainer_config

if TYPE_CHECKING:
    from marinrl.config.curriculum import LessonConfig
    from marinrl.config.lora import LoraRLConfig
    from marinrl.config.rollout_worker import ModelStream, RolloutWorkerConfig
    from marinrl.config.server import InferenceServerConfig
    from marinrl.config.train_worker import TrainWorkerConfig
    from marinrl.envs.base import Env
    from marinrl.inference.context import SamplingParams
    from marinrl.rollout.manager import LessonRuntime
    from marinrl.startup import StartupClock
    from marinrl.train.adapter_streams import AdapterReplays
    from marinrl.train.parts import TrainerParts
    from marinrl.train.replay.buffer import ReplayBuffer
    from marinrl.transfer.base import WeightTransferClient

logger = logging.getLogger(__name__)


def train_worker_config(job: RLJobConfig, policy_model: Optional[PolicyModel] = None, *,
                        device_bytes: Optional[float] = None) -> TrainWorkerConfig:
    """The trainer's config of `policy_model` (one of `policies.trainers(job)`; default: the job's first, its only
    one without several): the model's own parts from its view (a trainer of several adapters on one base: each
    adapter's rollout files and weight stream), the rest from the job. Built in the trainer's process:
    `model.model.gradient_checkpointing: auto` and `trainer.per_device_parallelism: auto` are resolved here, once,
    from the memory of `device_bytes` (default: this process's device, `local_device_bytes`), and the choice
    logged."""
    from marinrl.config.train_worker import AdapterSlotConfig, TrainWorkerConfig

    m = policy_model if policy_model is not None else trainers(job)[0]
    model = m.model
    if getattr(model.model, "gradient_checkpointing", None) == "auto" or job.trainer.per_device_parallelism == "auto":
        from marinrl.dry_run.memory import resolve_update_memory

        # the estimate reads the job as this model's trainer runs it
        seen = dataclasses.replace(job, model=model, optimizer=m.optimizer, loss=m.loss, lora=m.lora, policies={})
        if device_bytes is None:
            import jax

            device_bytes, on_cpu = local_device_bytes(), jax.default_backend() == "cpu"
        else:
            on_cpu = False
        seen, choice = resolve_update_memory(seen, device_bytes, cpu=on_cpu)
        model, job = seen.model, dataclasses.replace(job, trainer=seen.trainer)
        for line in choice.lines():
            logger.info("%s", line)
            print(f"[marinrl] {line}", flush=True)
    if getattr(model.model, "attn_backend", None) == "auto":
        line = attention_line(model.model.attn_backend)
        logger.info("%s", line)
        print(f"[marinrl] {line}", flush=True)
    adapters = tuple(AdapterSlotConfig(a.name, a.rollout_root, a.weights, a.policies, a.lora) for a in m.adapters)
    return TrainWorkerConfig(
        rollout_root=m.rollout_root, weights=m.weights, model=model, adapters=adapters,
        trainer=trainer_config(job, m), optimizer=to_levanter(m.optimizer), loss=m.loss,
        replay=dataclasses.replace(job.replay, sampling=job.sampling(), seed=job.seed),
        batching=job.batching, groups_per_step=job.groups_per_step, sync_interval=job.sync_interval,
        checkpoint_every=job.checkpoint_every, checkpoint_keep=job.checkpoint_keep,
        checkpoint_keep_every=job.checkpoint_keep_every, lora=m.lora, policies=m.policies,
        publish_dtype=job.rollout_dtype(), audit_root=f"{m.run_dir}/trained")


def attention_line(setting: str) -> str:
    """The attention `model.model.attn_backend: setting` runs in this process, in one line for the run's log."""
    import jax

    from marinrl.config.model import attention_backend_here

    platform = jax.default_backend()
    return f"attention {attention_backend_here(setting, platform)} ({setting} on {platform})"


def local_device_bytes() -> Optional[float]:
    """The allocator's limit of this process's first device (`memory_stats()['bytes_limit']`); None where JAX
    does not report one (a CPU)."""
    import jax

    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def build_trainer(config: TrainWorkerConfig) -> TrainerParts:
    """What a TrainWorker of `config` trains with besides Levanter's Trainer, built in the process that runs
    it (in a multi-host trainer, after `multihost.initialize`: only process 0 reads rollouts and keeps the
    audit trail)."""
    import functools

    from marinrl import multihost
    from marinrl.train.audit import AuditTrail, new_trainer_id
    from marinrl.train.initial_weights import frozen_reference
    from marinrl.train.parts import TrainerParts
    from marinrl.train.saved_state import CheckpointWriter

    leader = multihost.current_cohort().is_leader
    trainer_id = new_trainer_id()
    return TrainerParts(
        trainer_id=trainer_id, weight_server=functools.partial(weight_server, config),
        replay=functools.partial(replay_buffer, config) if leader else None,
        audit=(AuditTrail(config.audit_root, trainer_id, config.storage_options)
               if config.audit_root is not None and leader else None),
        # with LoRA the reference is the policy's own frozen base, taken from each step's state
        reference=frozen_reference if config.loss.uses_reference and config.lora is None else None,
        checkpoints=CheckpointWriter(trainer_id, keep=config.checkpoint_keep, keep_every=config.checkpoint_keep_every))


def weight_server(config: TrainWorkerConfig):
    """The trainer's weight server: its stream's, or with several adapters one per adapter's stream."""
    from marinrl.transfer.endpoints import build_server

    if not config.adapters:
        return build_server(config.weights)
    from marinrl.train.adapter_streams import AdapterWeightServers

    return AdapterWeightServers([build_server(a.weights) for a in config.adapters])


def replay_buffer(config: TrainWorkerConfig, start_step: int) -> ReplayBuffer | AdapterReplays:
    """The trainer's replay buffer over the run's rollout files, from weight step `start_step`; with several
    adapters, one per adapter over its own policy model's files (`train/adapter_streams.AdapterReplays`)."""
    from marinrl.storage.rollouts import RolloutReader
    from marinrl.train.replay.buffer import ReplayBuffer
    from marinrl.train.replay.ingest import overlong_reward_fn

    def one(rollout_root: str, policies: tuple[str, ...]) -> ReplayBuffer:
        reader = RolloutReader(rollout_root, storage_options=config.storage_options)
        return ReplayBuffer(config.replay.for_loss(config.loss), reader, start_step=start_step,
                            advantage=config.loss.advantage, reward_fn=overlong_reward_fn(config.loss),
                            max_tokens=config.batching.max_length, policies=policies)

    if not config.adapters:
        return one(config.rollout_root, config.policies)
    from marinrl.train.adapter_streams import AdapterReplays

    return AdapterReplays([a.name for a in config.adapters], [one(a.rollout_root, a.policies) for a in config.adapters])


def rollout_worker_config(job: RLJobConfig, index: int) -> RolloutWorkerConfig:
    """Rollout worker `index`'s config: its share of each step's groups, its seed, a stream per policy model."""
    from marinrl.config.rollout_worker import ModelStream, RolloutWorkerConfig

    models = policy_models(job)
    streams = ((ModelStream("policy", (), models[0].rollout_root, models[0].weights, models[0].lora),)
               if len(models) == 1
               else tuple(ModelStream(m.name, m.policies, m.rollout_root, m.weights, m.lora) for m in models))
    return RolloutWorkerConfig(
        streams=streams, groups_per_batch=job.groups_per_step // job.n_rollout_workers, n_generations=job.n_generations,
        max_staleness=job.max_staleness, final_step=job.num_train_steps, eval_every=job.eval_every,
        eval_examples=job.eval_examples, micro_eval_every=job.micro_eval_every,
        micro_eval_examples=job.micro_eval_examples, seed=job.seed * 1000 + index,
        max_consecutive_env_failures=job.max_consecutive_env_failures, warm_up_sampler=job.warm_up_sampler,
        inflight=job.inflight, fleet_size=job.n_rollout_workers)


# ------------------------------------------------------------------------------------- a rollout host


@dataclasses.dataclass
class RolloutHost:
    """The parts of one rollout host, ready to hand to a `RolloutManager` and a `RolloutWorker`."""

    config: RolloutWorkerConfig
    tokenizer: Any
    servers: dict[str, Any]
    """Policy model name → its started `InferenceServer`, or its `PolicySlot` of a shared base (a `lora` model)."""
    server: Any
    """What the manager generates with: the one server, or a `PolicyRouter` over several."""
    lessons: dict[str, LessonRuntime]
    clients: dict[str, WeightTransferClient]
    """Stream name → the weight client that fills its server's model."""
    rss_before_model: int
    """This process's resident memory before the models were built (for the program audit)."""


def build_rollout_host(job: RLJobConfig, index: int, clock: Optional[StartupClock] = None) -> RolloutHost:
    """Everything rollout worker `index` of `job` runs with, built in the process that runs it."""
    import psutil

    from marinrl.envs.base import with_endpoint_if_needed
    from marinrl.inference.served_model import load_served_model
    from marinrl.models.policy_model import build_tokenizer
    from marinrl.rollout.policy_router import PolicyRouter
    from marinrl.rollout.shared_base import PolicySlot, serving_groups, stack_serves

    config = rollout_worker_config(job, index)
    tokenizer = build_tokenizer(job.model)
    inference = with_endpoint_if_needed(dataclasses.replace(job.inference, dtype=job.rollout_dtype()),
                                        [lesson.env for lesson in job.curriculum.lessons])
    models = policy_models(job)  # each held in the dtype its trainer publishes (docs/models.md, "Dtypes")
    groups = serving_groups(models, inference, job.inflight.enabled)  # lora models of one base: one server
    stacked = stack_serves(inference, job.inflight.enabled)  # else each lora version is merged into its base
    rss_before_model = psutil.Process().memory_info().rss
    weights = [load_served_model(models[g[0]].model, inference, dtype=job.rollout_dtype()) for g in groups]
    if clock is not None:
        clock.mark("model")
    servers: dict[str, Any] = {}
    for g, w in zip(groups, weights):
        first = models[g[0]]  # each server's head as its models' trainers compute it (`model.lm_head_float32`)
        shared = first.lora is not None and stacked
        served = serve(dataclasses.replace(inference, serve_http=inference.serve_http and g[0] == 0,
                                           lm_head_float32=first.model.lm_head_float32), w, tokenizer,
                       adapters=[models[i].lora for i in g] if shared else None)
        for k, i in enumerate(g):
            servers[models[i].name] = served.slot(k) if shared else served
    server = (servers[models[0].name] if len(models) == 1
              else PolicyRouter(servers, {p: m.name for m in models for p in m.policies}))
    if clock is not None:
        clock.mark("server")
    clients = {s.name: weight_client(s, servers[m.name].model, slot=isinstance(servers[m.name], PolicySlot))
               for s, m in zip(config.streams, models)}
    return RolloutHost(config=config, tokenizer=tokenizer, servers=servers, server=server,
                       lessons=lesson_runtimes(job.curriculum.lessons, tokenizer), clients=clients,
                       rss_before_model=rss_before_model)


def weight_client(stream: ModelStream, model, *, slot: bool = False) -> WeightTransferClient:
    """A stream's weight client: full versions into `model`'s skeleton; with LoRA, adapter-only versions, written
    into the stream's slot of a shared base (`slot`) or merged into `model` (the base)."""
    if stream.lora is None:
        from marinrl.transfer.endpoints import build_client

        return build_client(stream.weights, model)
    if slot:
        from marinrl.models.lora import adapter_client

        return adapter_client(stream.weights, stream.lora, model)
    from marinrl.models.lora import AdapterMergingClient

    return AdapterMergingClient(stream.weights, stream.lora, model)


# ------------------------------------------------------------------------------------- shared parts


def lesson_runtimes(lessons: Sequence[LessonConfig], tokenizer, *, envs: Optional[dict[str, Env]] = None,
                    sampling: Optional[Callable[[LessonConfig], SamplingParams]] = None
                    ) -> dict[str, LessonRuntime]:
    """Lesson id → what the manager runs it with: its environment (built on first use, or the one in `envs`,
    already built) and its train and eval sampling (`sampling`: one for both, e.g. an evaluation's)."""
    import functools

    from marinrl.envs.base import make_env
    from marinrl.inference.context import lesson_sampling
    from marinrl.rollout.manager import LessonRuntime

    out = {}
    for lesson in lessons:
        built = None if envs is None else envs[lesson.lesson_id]
        make = functools.partial(make_env, lesson.env) if built is None else functools.partial(_same, built)
        train, evaluate = ((lesson_sampling(lesson, tokenizer, "train"), lesson_sampling(lesson, tokenizer, "eval"))
                           if sampling is None else (sampling(lesson),) * 2)
        out[lesson.lesson_id] = LessonRuntime(make_env=make, sampling=train, eval_sampling=evaluate,
                                              env_name=lesson.env.name)
    return out


def _same(env: Env) -> Env:
    return env


def serve(inference: InferenceServerConfig, model, tokenizer, *, weight_step: int = 0,
          adapters: Optional[Sequence[LoraRLConfig]] = None):
    """A started `InferenceServer` for `model`, ready for requests; with `adapters` (a config per slot) a
    `SharedBaseServer` holding `model` as the base of an adapter stack (`rollout/shared_base.py`)."""
    if adapters:
        from marinrl.rollout.shared_base import SharedBaseServer

        server = SharedBaseServer(inference, model, tokenizer, adapters).start()
    else:
        from marinrl.inference.server import InferenceServer

        server = InferenceServer(inference, model, tokenizer, weight_step=weight_step).start()
    try:
        server.wait_until_ready()
    except BaseException:
        server.shutdown()
        raise
    return server
