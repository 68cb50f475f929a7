"""The programs a job runs, lowered and compiled at its shapes on fake CPU devices with abstract weights.

- trainer: Levanter's `Trainer._train_step` over the real `rl_loss` (microbatches included) on the
  trainer mesh, the model and optimizer state sharded by `trainer.parameter_axis_mapping`: lowered (its
  compile on 8-32 fake devices is what a TPU compile does far faster; lowering already checks the mesh,
  the shardings and every shape).
- rollout, `inference.backend: engine`: Levanter's engine is built by `InferenceEngine.from_model_with_config`
  from real arrays, which an abstract model cannot give, so its two jitted programs are lowered and
  compiled directly, with the arguments that constructor and `generate` would pass:
  `levanter.inference.engine._run_prefill` (one prefill flush: `max_prefill_tokens` packed prompt tokens,
  `max_seqs` slots) and `_run_generation_loop` (the decode loop: `max_seqs` tokens per round,
  `max_rounds` rounds), over the engine's `GenState` (the paged KV cache of `max_pages` pages of
  `page_size` tokens, and the decode state) and the model in the rollout dtype, tensor-parallel on the
  rollout mesh.
- rollout, `inference.backend: scan`: the scan sampler's `_generate` (prefill, then its decode loop) for
  one call of one rollout worker's batch, lowered and compiled.

Each program is lowered with `layers` layers of the model (the decode path unrolls its layers in
Python, so a full-depth compile grows with depth while checking nothing more): a mesh that does not divide
the model, a batch that does not divide the mesh, or a program that does not compile fails here. The
numbers (memory, FLOPs) come from shapes at full depth (`memory.py`, `flops.py`), not from these programs.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from marinrl.dry_run.engine_cache import abstract_engine_state, engine_sizing
from marinrl.dry_run.meshes import rollout_mapping
from marinrl.dry_run.shapes import abstract_model
from marinrl.job.plan import trainer_config
from marinrl.levanter_configs import to_levanter


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    """One program lowered (and compiled) at the job's shapes."""

    name: str
    devices: int
    mesh: dict
    layers: int
    """Layers of the model it was lowered with."""
    compiled: bool
    lower_seconds: float
    compile_seconds: float
    cpu_temp_bytes_per_device: float
    """The CPU compiler's scratch buffers per device (`memory_analysis().temp_size_in_bytes`) at `layers`
    layers: what fake CPU devices allocate, not what a TPU or GPU compile would; -1 when not compiled."""


def with_layers(model_config, layers: int):
    """The architecture with `layers` layers (a Qwen3 sliding window it does not use dropped, as the HF
    converter leaves it)."""
    changes = {"num_layers": layers}
    if (getattr(model_config, "sliding_window", None) is not None
            and not getattr(model_config, "use_sliding_window", True)):
        changes["sliding_window"] = None
    return dataclasses.replace(model_config, **changes)


def with_shardings(tree, shardings):
    """ShapeDtypeStructs carrying the shardings a lowered program takes its inputs with."""
    def attach(x, s):
        if isinstance(x, hax.NamedArray):
            return hax.NamedArray(attach(x.array, s), x.axes)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return x

    return jax.tree_util.tree_map(attach, tree, shardings,
                                  is_leaf=lambda x: isinstance(x, (hax.NamedArray, jax.ShapeDtypeStruct)))


def _sharded(tree, mapping, mesh):
    return with_shardings(tree, hax.partitioning.infer_resource_partitions(
        tree, mapping, preserve_existing_shardings=False, mesh=mesh))


def _check(name, lowered, mesh, layers, started, compile_it: bool) -> ProgramCheck:
    lowered_at = time.perf_counter()
    temp = -1.0
    if compile_it:
        compiled = lowered.compile()
        stats = compiled.memory_analysis()
        temp = float(stats.temp_size_in_bytes) if stats is not None else -1.0
    done = time.perf_counter()
    return ProgramCheck(name=name, devices=int(np.prod(list(mesh.shape.values()))), mesh=dict(mesh.shape),
                        layers=layers, compiled=compile_it, lower_seconds=lowered_at - started,
                        compile_seconds=done - lowered_at if compile_it else 0.0, cpu_temp_bytes_per_device=temp)


def _lower(fn, *args, **static):
    """`jax.jit(fn).lower` on abstract arguments inside equinox modules: the ShapeDtypeStructs are the
    dynamic part, everything else is closed over."""
    dynamic, fixed = eqx.partition(args, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def run(dyn):
        return eqx.filter(fn(*eqx.combine(dyn, fixed), **static), eqx.is_array)

    return jax.jit(run).lower(dynamic)


# ------------------------------------------------------------------------------------------- trainer


def check_train_step(job, layers: int, rows: int, length: int) -> ProgramCheck:
    """Lower the trainer's step at `rows` × `length` with a `layers`-layer model on this process's devices."""
    from levanter.tracker import NoopConfig
    from levanter.trainer import Trainer
    from levanter.trainer_state import TrainerState

    from marinrl.train.batching import TrainingBatch
    from marinrl.train.worker import StepInput, _step_loss

    started = time.perf_counter()
    trainer_cfg = dataclasses.replace(trainer_config(job), tracker=NoopConfig(), require_accelerator=False)
    optimizer = to_levanter(job.optimizer).build(job.num_train_steps)
    step_loss = functools.partial(_step_loss, config=job.loss, lm_head_float32=job.model.lm_head_float32)
    trainer = Trainer(trainer_cfg, optimizer, step_loss, add_default_hooks=False)
    with trainer:
        mesh = trainer.device_mesh
        model = abstract_model(with_layers(to_levanter(job.model.model), layers), job.model.vocab_size,
                               jnp.dtype(job.model.dtype))
        state = eqx.filter_eval_shape(
            lambda m: TrainerState.init(optimizer, m, key=jax.random.PRNGKey(0), mp=trainer.mp), model)
        state = _sharded(state, trainer.parameter_axis_mapping, mesh)

        def field(dtype, *axes):
            return hax.NamedArray(jax.ShapeDtypeStruct(tuple(a.size for a in axes), dtype), axes)

        Batch, Pos = hax.Axis("batch", rows), hax.Axis("position", length)
        floats = {"loss_mask", "sampler_logprobs", "advantages", "temperature", "sequence_slots"}
        batch = TrainingBatch(**{
            name: field(jnp.float32 if name in floats else jnp.int32,
                        *((Batch,) if TrainingBatch.field_axes(name) == ("batch",) else (Batch, Pos)))
            for name in TrainingBatch.field_names()})
        inp = StepInput(_sharded(batch, trainer.compute_axis_mapping, mesh), None)
        lowered = _lower(lambda st, i: trainer._train_step(st, (i,), {}, _no_hooks=True), state, inp)
        return _check("train step", lowered, mesh, layers, started, compile_it=False)


# ------------------------------------------------------------------------------------------- rollout


def rollout_mesh(job, n_devices: int, model_axis_size: int):
    from marinrl.inference import sharding

    grid = np.asarray(jax.devices()[:n_devices]).reshape(n_devices // model_axis_size, model_axis_size)
    return sharding.RolloutMesh(Mesh(grid, (sharding.DATA, sharding.MODEL)), rollout_mapping(job, model_axis_size))


def _prefill_work(gen_state, engine_config):
    """The abstract `PrefillWork` of one prefill flush, shaped as `InferenceEngine._prefill_prompts` builds it."""
    from levanter.inference.engine import PrefillWork
    from levanter.inference.jit_scheduler import SeqDecodingParams, TokenQueue

    ds = gen_state.decode_state
    slots, seq_len = ds.max_seqs, ds.tokens.axis_size("position")
    tokens = engine_config.max_prefill_size

    def ints(*shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype)

    def named(axes, dtype=jnp.int32):
        return hax.NamedArray(ints(*axes.values(), dtype=dtype), tuple(hax.Axis(k, v) for k, v in axes.items()))

    stops = ds.stop_tokens
    stop_tokens = None if stops is None else named(
        {"seq": slots, "stop_seq": stops.axis_size("stop_seq"), "position": stops.axis_size("position")})
    return PrefillWork(
        queue=TokenQueue(queued_tokens=named({"position": tokens}), queued_slot_ids=named({"position": tokens}),
                         queued_pos_ids=named({"position": tokens}), num_queued_tokens=ints()),
        new_num_seqs=ints(), new_slot_ids=named({"seq": slots}), clone_targets=named({"seq": slots}),
        prompt_tokens=named({"seq": slots, "position": seq_len}), prompt_lengths=named({"seq": slots}),
        seq_params=SeqDecodingParams(max_num_tokens=ints(slots), stop_tokens=stop_tokens,
                                     temperature=ints(slots, dtype=jnp.float32), key=ints(slots, 2, dtype=jnp.uint32)))


def check_engine(job, layers: int, n_devices: int, model_axis_size: int) -> list[ProgramCheck]:
    """Lower and compile the engine's prefill and decode loop (module doc) at `inference.engine`'s sizes."""
    from levanter.inference.engine import _run_generation_loop, _run_prefill
    from levanter.layers.sampler import Sampler

    from marinrl.inference import sharding
    from marinrl.inference.levanter_engine import with_float32_head

    where = rollout_mesh(job, n_devices, model_axis_size)
    sizing = engine_sizing(job)
    checks = []
    with sharding.using(where):
        started = time.perf_counter()
        model = abstract_model(with_layers(to_levanter(job.model.model), layers), job.model.vocab_size,
                               jnp.dtype(job.rollout_dtype()))
        model = _sharded(model, where.axis_mapping, where.mesh)
        if job.model.lm_head_float32:  # the engine's copy, as `LevanterEngine` makes it
            model = with_float32_head(model)
        state = _sharded(abstract_engine_state(model, sizing), where.axis_mapping, where.mesh)
        work = _sharded(_prefill_work(state, sizing), where.axis_mapping, where.mesh)
        sampler = Sampler(model.Vocab)
        lowered = _run_prefill.lower(state, model, sampler, work, max_seqs_in_prefill=sizing.max_seqs_in_prefill)
        checks.append(_check("engine prefill", lowered, where.mesh, layers, started, compile_it=True))
        started = time.perf_counter()
        lowered = _run_generation_loop.lower(state, model, sampler, sizing.imputed_max_tokens_per_round,
                                             sizing.max_rounds)
        checks.append(_check("engine decode loop", lowered, where.mesh, layers, started, compile_it=True))
    return checks


def check_scan_sampler(job, layers: int, n_devices: int, model_axis_size: int, prompts: int, p_len: int,
                       t_len: int) -> list[ProgramCheck]:
    """Lower and compile the scan sampler's `_generate` for one call of `prompts` prompts."""
    from marinrl.inference import sampler, sharding

    where = rollout_mesh(job, n_devices, model_axis_size)
    started = time.perf_counter()
    model = abstract_model(with_layers(to_levanter(job.model.model), layers), job.model.vocab_size,
                           jnp.dtype(job.rollout_dtype()))
    model = _sharded(model, where.axis_mapping, where.mesh)
    replicated = NamedSharding(where.mesh, PartitionSpec())

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    with sharding.using(where):
        lowered = _lower(
            functools.partial(sampler._generate.__wrapped__, n=job.n_generations, max_new=t_len, mesh=where.mesh,
                              lm_head_float32=job.model.lm_head_float32),
            model, arg((prompts, p_len), jnp.int32), arg((prompts,), jnp.int32), arg((prompts,), jnp.bool_),
            arg((1, 1), jnp.int32), arg((1,), jnp.bool_), arg((), jnp.int32), arg((), jnp.float32),
            arg((prompts,), jnp.uint32), arg((prompts,), jnp.int32))
        return [_check("scan sampler", lowered, where.mesh, layers, started, compile_it=True)]
