"""The dry run of a job config: its train step and its generation step at the config's real shapes,
lowered on fake CPU devices, with per-device memory and FLOPs per step. No weights exist: the model
and optimizer state are abstract (`eqx.filter_eval_shape`), so an 8B recipe checks on a laptop.

Why lower instead of run: what breaks first on a pod is a mesh that does not divide the model, a
batch that does not divide the mesh, or a state that does not fit a chip's memory; lowering finds the
first two and the shardings give the third, in seconds, before a TPU is rented.

What is exact and what is an estimate (each printed line says which):
- parameters and optimizer state per device: exact, the shard shape of every leaf under the
  trainer's `parameter_axis_mapping` (FSDP) on the trainer mesh, or under the rollout mesh's
  tensor-parallel mapping;
- FLOPs: XLA's cost analysis of the lowered program (`Lowered.cost_analysis()`), for the whole mesh.
  Levanter scans its layers (a loop XLA's cost analysis counts once), so the programs are lowered with
  unrolled layers at `k` and `k + 1` layers and the per-layer difference is scaled to the model's
  layer count: exact for identical layers, and said so in the output;
- activations (train): an estimate from shapes for one microbatch (`_train_activations`: layer inputs
  kept by gradient checkpointing, one layer's working set, float32 logits and their gradient). The CPU
  compiler's buffer sizes were tried and dropped: unrolled and without fused attention they grow by
  gigabytes per layer, which says nothing about a TPU;
- KV cache (generation): from its shape (rows × layers × 2 × kv heads × slots × head size).

The devices are the trainer's: `ray.trainer` fixes their number (`tpu: v5p-64` → 32), the process must
have that many (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set before JAX loads: see
`marinrl.recipe`). The rollout mesh takes the first `ray.rollout.devices()` of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from marinrl.config_checks import require_at_least
GiB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class DryRunShapes:
    """The token shapes the dry run lowers at (the config fixes the rest)."""

    prompt_tokens: int = 256
    """Prompt length of every row (a GSM8K question with its chat template is ~150-250 tokens)."""
    response_tokens: Optional[int] = None
    """Generated tokens per sample; None: the largest `max_tokens` among the curriculum's lessons."""
    layers: int = 1
    """Lower with this many and one more unrolled layer, and scale to the model's layer count."""

    def __post_init__(self):
        require_at_least(self, 1, "prompt_tokens", "layers")
        if self.response_tokens is not None and self.response_tokens < 1:
            raise ValueError(f"DryRunShapes.response_tokens must be >= 1 or None, got {self.response_tokens}")


@dataclasses.dataclass
class StepReport:
    """One lowered step: FLOPs for the whole mesh and bytes per device."""

    name: str
    devices: int
    mesh: dict
    calls: int
    """Device calls per step: 1 for train; generation splits a batch whose KV cache exceeds
    `inference.scan_max_cache_bytes` into equal calls (memory is per call, FLOPs for all of them)."""
    tokens: int
    """Tokens the FLOPs are for (train: rows × row length; generation: every prompt's prefill and one decode
    step of every row)."""
    flops: float
    param_bytes_per_device: float
    state_bytes_per_device: float
    """Optimizer state (train) or KV cache (generation) per device."""
    activation_bytes_per_device: float
    total_params: int
    param_bytes_total: float
    lowered_layers: tuple[int, int]
    model_layers: int
    seconds: float

    @property
    def extrapolated(self) -> bool:
        return self.lowered_layers[1] < self.model_layers


@dataclasses.dataclass
class DryRunReport:
    train: StepReport
    generation: StepReport

    def lines(self) -> list[str]:
        out = []
        for step in (self.train, self.generation):
            lo, hi = step.lowered_layers
            how = (f"lowered with {lo} and {hi} unrolled layers, per-layer numbers scaled to {step.model_layers} "
                   f"layers (an extrapolation)" if step.extrapolated else f"lowered with all {hi} layers")
            state = "optimizer state" if step.name == "train" else "KV cache"
            out += [
                f"[dry run] {step.name}: {step.devices} devices, mesh {step.mesh}; {how}; {step.seconds:.1f} s",
                f"[dry run] {step.name}: parameters {step.total_params / 1e9:.3f} B = "
                f"{step.param_bytes_total / GiB:.2f} GiB in all",
                f"[dry run] {step.name}: per device: parameters {step.param_bytes_per_device / GiB:.3f} GiB, "
                f"{state} {step.state_bytes_per_device / GiB:.3f} GiB, activations (estimate) "
                f"{step.activation_bytes_per_device / GiB:.3f} GiB, total "
                f"{(step.param_bytes_per_device + step.state_bytes_per_device + step.activation_bytes_per_device) / GiB:.3f} GiB",
                f"[dry run] {step.name}: {step.flops:.4g} FLOPs per step ({step.tokens} tokens; "
                f"{step.flops / max(1, 2 * step.total_params * step.tokens):.2f} × 2·params·tokens)",
            ]
        return out

    def as_dict(self) -> dict:
        return {"train": dataclasses.asdict(self.train), "generation": dataclasses.asdict(self.generation)}


# ------------------------------------------------------------------------------------------- shared


def _with_layers(model_config, layers: int):
    """The architecture with `layers` unrolled layers: the loop XLA's cost analysis counts once is gone."""
    changes = {"num_layers": layers}
    if hasattr(model_config, "scan_layers"):
        changes["scan_layers"] = False
    if getattr(model_config, "sliding_window", None) is not None and not getattr(model_config, "use_sliding_window", True):
        changes["sliding_window"] = None  # Qwen3: a window it does not use (as the HF converter leaves it)
    return dataclasses.replace(model_config, **changes)


def _abstract_model(model_config, vocab_size: int, dtype):
    def init():
        model = model_config.model_type.init(hax.Axis("vocab", vocab_size), model_config, key=jax.random.PRNGKey(0))
        return jax.tree_util.tree_map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)

    return eqx.filter_eval_shape(init)


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs carrying the shardings a lowered program takes its inputs with."""
    def attach(x, s):
        if isinstance(x, hax.NamedArray):
            return hax.NamedArray(attach(x.array, s), x.axes)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return x

    return jax.tree_util.tree_map(attach, tree, shardings,
                                  is_leaf=lambda x: isinstance(x, (hax.NamedArray, jax.ShapeDtypeStruct)))


def _shard_bytes(tree) -> float:
    """Bytes of `tree` on its most loaded device (every leaf carries its sharding)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.ShapeDtypeStruct):
            shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
            total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return float(total)


def _bytes(tree) -> float:
    return float(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
                     if isinstance(x, jax.ShapeDtypeStruct)))


def _count(tree) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.ShapeDtypeStruct)))


def _lower(fn, *args, **static):
    """`jax.jit(fn).lower` on abstract arguments (ShapeDtypeStructs with shardings, inside equinox modules):
    haliax's `named_jit` takes only concrete arrays as dynamic arguments, so the split is done here."""
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    dynamic, fixed = eqx.partition(args, is_abstract)

    def run(dyn):
        out = fn(*eqx.combine(dyn, fixed), **static)
        return eqx.filter(out, eqx.is_array)

    return jax.jit(run).lower(dynamic)


def _flops(lowered) -> float:
    cost = lowered.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", 0.0))


def _extrapolate(at_k: float, at_k1: float, k: int, layers: int) -> float:
    return at_k + (at_k1 - at_k) * (layers - k)


# ------------------------------------------------------------------------------------------- train


def _lower_train(job, model_config, rows: int, length: int):
    """(lowered, abstract state, mesh shape) of the trainer's step at this shape."""
    from levanter.tracker import NoopConfig
    from levanter.trainer import Trainer
    from levanter.trainer_state import TrainerState

    from marinrl.train.batching import TrainingBatch
    from marinrl.train.worker import StepInput, _step_loss

    trainer_cfg = dataclasses.replace(job.trainer_config(), tracker=NoopConfig(), require_accelerator=False)
    optimizer = job.optimizer.build(job.num_train_steps)
    trainer = Trainer(trainer_cfg, optimizer, functools.partial(_step_loss, config=job.loss), add_default_hooks=False)
    with trainer:
        mesh = trainer.device_mesh
        model = _abstract_model(model_config, job.model.vocab_size, jnp.dtype(job.model.dtype))
        state = eqx.filter_eval_shape(
            lambda m: TrainerState.init(optimizer, m, key=jax.random.PRNGKey(0), mp=trainer.mp), model)
        shardings = hax.partitioning.infer_resource_partitions(
            state, trainer.parameter_axis_mapping, preserve_existing_shardings=False, mesh=mesh)
        state = _with_shardings(state, shardings)

        def field(dtype, *axes):
            return hax.NamedArray(jax.ShapeDtypeStruct(tuple(a.size for a in axes), dtype), axes)

        Batch, Pos = hax.Axis("batch", rows), hax.Axis("position", length)
        floats = {"loss_mask", "sampler_logprobs", "advantages", "temperature", "sequence_slots"}
        batch = TrainingBatch(**{
            name: field(jnp.float32 if name in floats else jnp.int32,
                        *((Batch,) if TrainingBatch.field_axes(name) == ("batch",) else (Batch, Pos)))
            for name in TrainingBatch.field_names()})
        batch_shardings = hax.partitioning.infer_resource_partitions(
            batch, trainer.compute_axis_mapping, preserve_existing_shardings=False, mesh=mesh)
        inp = StepInput(_with_shardings(batch, batch_shardings), None)
        lowered = _lower(lambda st, i: trainer._train_step(st, (i,), {}, _no_hooks=True), state, inp)
        return lowered, state, dict(mesh.shape)


def _microbatch_rows(job, mesh: dict) -> int:
    """Rows per microbatch: `per_device_parallelism` × the data-parallel size (Levanter's rule)."""
    return job.trainer.per_device_parallelism * mesh.get("data", 1) * mesh.get("replica", 1)


def _train_activations(job, mesh: dict, length: int) -> float:
    """Activations of one microbatch per device, from shapes: with gradient checkpointing each layer keeps
    its input (rows × length × hidden, in the compute dtype) and one layer's working set is live at a
    time (~ 16 × rows × length × hidden: q/k/v, MLP hidden, their gradients); the logits and their
    gradient in float32 (2 × rows × length × vocab × 4 bytes) come on top. Without checkpointing every
    layer keeps its working set. The CPU compiler's own buffer sizes are not used: it neither fuses
    attention nor rematerializes the way a TPU compile does."""
    cfg = job.model.model
    data = mesh.get("data", 1) * mesh.get("replica", 1)
    rows = job.trainer.per_device_parallelism if job.trainer.per_device_parallelism > 0 else \
        job.groups_per_step * job.n_generations // data
    compute = np.dtype(job.trainer.mp.compute_dtype).itemsize
    per_token_layer = cfg.hidden_dim * compute
    working = 16 * rows * length * max(cfg.hidden_dim, cfg.intermediate_dim // 2) * compute / mesh.get("model", 1)
    checkpointing = bool(getattr(cfg, "gradient_checkpointing", False))
    kept = rows * length * per_token_layer * cfg.num_layers if checkpointing else working * cfg.num_layers
    logits = 2 * rows * length * job.model.vocab_size * 4 / mesh.get("model", 1)
    return float(kept + working + logits)


def train_step_report(job, shapes: DryRunShapes, response_tokens: int) -> StepReport:
    from marinrl.train.batching import BatchingConfig

    started = time.perf_counter()
    full = job.model.model
    rows = job.groups_per_step * job.n_generations
    batching: BatchingConfig = job.batching
    length = batching.bucket_for(min(batching.max_length, shapes.prompt_tokens + response_tokens))
    k = min(shapes.layers, full.num_layers)
    runs = []
    for layers in sorted({k, min(k + 1, full.num_layers)}):
        lowered, state, mesh = _lower_train(job, _with_layers(full, layers), rows, length)
        runs.append((layers, _flops(lowered), state, mesh))
    (k0, f0, s0, mesh), (k1, f1, s1, _) = runs[0], runs[-1]

    def scaled(fn) -> float:
        return fn(s0) if k1 == k0 else _extrapolate(fn(s0), fn(s1), k0, full.num_layers)

    params = lambda s: s.model  # noqa: E731
    # gradient accumulation is a loop over microbatches, which XLA's cost analysis counts once
    mbs = job.trainer_config().microbatch_size if job.trainer.per_device_parallelism > 0 else None
    microbatches = rows // _microbatch_rows(job, mesh) if mbs else 1
    return StepReport(
        name="train", devices=len(jax.devices()), mesh=mesh, calls=1, tokens=rows * length,
        flops=microbatches * (f0 if k1 == k0 else _extrapolate(f0, f1, k0, full.num_layers)),
        param_bytes_per_device=scaled(lambda s: _shard_bytes(params(s))),
        state_bytes_per_device=scaled(lambda s: _shard_bytes(s.opt_state)),
        activation_bytes_per_device=_train_activations(job, mesh, length),
        total_params=int(round(scaled(lambda s: _count(params(s))))),
        param_bytes_total=scaled(lambda s: _bytes(params(s))),
        lowered_layers=(k0, k1), model_layers=full.num_layers, seconds=time.perf_counter() - started)


# ------------------------------------------------------------------------------------------- generation


def trainer_devices(job) -> int:
    """The trainer mesh's devices: its placement's per host × hosts (`v5p-64`: 4 × 8), else 8."""
    per_host = job.ray.trainer.devices()
    return per_host * job.ray.trainer.hosts() if per_host else 8


def rollout_devices(job) -> int:
    """The devices one rollout worker sees: its placement's, else all of this process's."""
    n = job.ray.rollout.devices()
    return n if n is not None else len(jax.devices())


def _rollout_mesh(model, n_devices: int, model_axis_size: Optional[int]):
    from marinrl.inference import sharding

    devices = jax.devices()[:n_devices]
    if model_axis_size is None:  # what an accelerator host does by default: all its devices, if they split the model
        cfg = model.config
        model_axis_size = max(d for d in range(1, n_devices + 1) if n_devices % d == 0 and cfg.num_kv_heads % d == 0
                              and cfg.num_heads % d == 0 and cfg.intermediate_dim % d == 0)
    sharding.check_model_axis_size(model_axis_size, model, n_devices)
    grid = np.asarray(devices).reshape(n_devices // model_axis_size, model_axis_size)
    mapping = {axis: sharding.MODEL for axis in sharding.TENSOR_PARALLEL_AXES}
    if model.Vocab.size % model_axis_size == 0:
        mapping["vocab"] = sharding.MODEL
    return sharding.RolloutMesh(Mesh(grid, (sharding.DATA, sharding.MODEL)), mapping)


def _lower_generation(job, model_config, prompts: int, p_len: int, t_len: int, n_devices: int):
    from marinrl.inference import sampler, sharding

    model = _abstract_model(model_config, job.model.vocab_size, jnp.dtype(job.model.dtype))
    where = _rollout_mesh(model, n_devices, job.inference.model_axis_size)
    targets = hax.partitioning.infer_resource_partitions(model, where.axis_mapping, preserve_existing_shardings=False,
                                                         mesh=where.mesh)
    model = _with_shardings(model, targets)
    replicated = NamedSharding(where.mesh, PartitionSpec())

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    with sharding.using(where):
        lowered = _lower(
            functools.partial(sampler._generate.__wrapped__, n=job.n_generations, max_new=t_len, mesh=where.mesh),
            model, arg((prompts, p_len), jnp.int32), arg((prompts,), jnp.int32), arg((prompts,), jnp.bool_),
            arg((1, 1), jnp.int32), arg((1,), jnp.bool_), arg((), jnp.int32), arg((), jnp.float32),
            arg((prompts,), jnp.uint32), arg((prompts,), jnp.int32))
    return lowered, model, where


def generation_step_report(job, shapes: DryRunShapes, response_tokens: int) -> StepReport:
    """The scan sampler's program for one rollout worker's batch: prefill, then its decode loop (whose
    body XLA's cost analysis counts once: the FLOPs are the prefill plus one decode step of every row)."""
    from marinrl.inference.sampler import bucket

    started = time.perf_counter()
    full = job.model.model
    from marinrl.inference.sampler import _floor_bucket

    prompts = job.groups_per_step // job.n_rollout_workers
    p_len, t_len = bucket(shapes.prompt_tokens, 16), bucket(response_tokens, 16)
    cfg = _with_layers(full, 1)
    head = getattr(cfg, "actual_head_size", None) or cfg.hidden_dim // cfg.num_heads
    itemsize = np.dtype(job.model.dtype).itemsize
    per_prompt = job.n_generations * 2 * full.num_layers * cfg.num_kv_heads * (p_len + t_len) * head * itemsize
    # as `sampler.sample` splits a call whose KV cache exceeds inference.scan_max_cache_bytes
    chunk = min(bucket(prompts), _floor_bucket(max(1, job.inference.scan_max_cache_bytes // per_prompt)))
    calls = math.ceil(prompts / chunk)
    n_devices = rollout_devices(job)
    k = min(shapes.layers, full.num_layers)
    runs = []
    for layers in sorted({k, min(k + 1, full.num_layers)}):
        lowered, params, where = _lower_generation(job, _with_layers(full, layers), chunk, p_len, t_len, n_devices)
        runs.append((layers, _flops(lowered), params))
    (k0, f0, m0), (k1, f1, m1) = runs[0], runs[-1]
    one = k1 == k0

    def scaled(fn) -> float:
        return fn(m0) if one else _extrapolate(fn(m0), fn(m1), k0, full.num_layers)

    rows = chunk * job.n_generations
    kv_shards = (where.data_axis_size if rows % where.data_axis_size == 0 else 1) * (
        where.model_axis_size if cfg.num_kv_heads % where.model_axis_size == 0 else 1)
    kv_bytes = chunk * per_prompt
    # activations of one decode step (rows × hidden and rows × vocab logits, float32), per device: small
    act = rows * (4 * full.hidden_dim + full.intermediate_dim * 2 + job.model.vocab_size) * 4 / where.data_axis_size
    return StepReport(
        name="generation", devices=n_devices, mesh=dict(where.mesh.shape), calls=calls,
        tokens=calls * (chunk * p_len + rows), flops=calls * (f0 if one else _extrapolate(f0, f1, k0, full.num_layers)),
        param_bytes_per_device=scaled(_shard_bytes), state_bytes_per_device=kv_bytes / kv_shards,
        activation_bytes_per_device=float(act), total_params=int(round(scaled(_count))),
        param_bytes_total=scaled(_bytes), lowered_layers=(k0, k1), model_layers=full.num_layers,
        seconds=time.perf_counter() - started)


def dry_run(job, shapes: DryRunShapes = DryRunShapes()) -> DryRunReport:
    """Lower `job`'s train step and one rollout worker's generation step at its shapes (see module doc).
    `job` is validated by the caller (`marinrl.recipe`). The process must have the trainer's device count (`ray.trainer.devices()`, 8 when it fixes none)."""
    want = trainer_devices(job)
    if len(jax.devices()) != want:
        raise RuntimeError(f"the dry run of this config needs {want} devices (ray.trainer: {job.ray.trainer}), this "
                           f"process has {len(jax.devices())}: run it through marinrl.recipe (it sets XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={want} before JAX loads)")
    response = shapes.response_tokens or max(lesson.max_tokens for lesson in job.curriculum.lessons)
    return DryRunReport(train_step_report(job, shapes, response), generation_step_report(job, shapes, response))
