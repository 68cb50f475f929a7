"""What each role of a job holds per device: `predicted_memory(job, role, n_devices) -> MemoryPlan`.

Nothing is lowered: the model, the optimizer state and the engine's cache are built abstractly
(`eqx.filter_eval_shape`, no arrays), their shardings come from the role's axis mapping
(`haliax.partitioning.pspec_for`) on a mesh of `n_devices`, and each leaf's shard is counted. So any
`RLJobConfig` answers in seconds, for any device count, on any machine.

Components (per device), and how exact each is:
- trainer: `parameters` (float32 master weights, `trainer.mp`'s param dtype), `gradients` (the same
  leaves and shardings: gradients of float32 parameters are float32), `gradient_accumulator` (Levanter's
  microbatch loop keeps a running sum beside each microbatch's gradients; 0 without microbatches) and
  `optimizer_state`: exact from shapes and shardings. Estimates from shapes for one microbatch:
  `activations` (the layers', `working_set.train_activation_bytes`) and the LM head's (`train_logits_bytes`): `logits`
  (three float32 [tokens, vocabulary block] arrays live in the loss's backward, plus the remainder block's
  where the vocabulary is not a multiple of the block), `logits_compute_copy` (with a compute dtype
  narrower than float32: the head's matmul output before its float32 cast), `lm_head_gradient` (the
  blockwise VJP's whole head gradient, vocab × hidden in the compute dtype, before it joins the gradients
  and, on FSDP, before its reduce-scatter) and `compute_parameters` (with `trainer.mp` p=f32,c=bfloat16:
  jmp's bfloat16 copy of the float32 masters, sharded as they are). The entropy metric's vocabulary pass
  is not counted: it runs in the forward and its blocks are freed before the backward's.
  Peak = parameters + gradients + gradient_accumulator + optimizer_state + activations + logits +
  logits_compute_copy + lm_head_gradient + compute_parameters; with `cpu=True` also
  `gathered_parameters` (in place of `compute_parameters`) and `unsharded_gradients` (what XLA:CPU holds
  per FSDP device), with delta sync `delta_host_copy` (the last version, kept on the host: device memory on a
  CPU), and `cpu_runtime`.
- rollout: `weights` in the rollout dtype (`job.rollout_dtype()`, tensor-parallel over the model axis), `cache`
  (engine: the paged KV cache plus the engine's decode state, its pages as the engine sizes them on the role's
  device kind, `engine_pages`; scan: one call's KV cache): exact from shapes and shardings. `working_set`: an
  estimate of one engine prefill or decode step's buffers (`rollout_working_set_bytes`). `incoming_version`: a
  received version is built beside the served weights before the swap (exact). Peak = weights + cache +
  working_set + incoming_version; with `cpu=True` also `cpu_float32_weights` (XLA:CPU's float32 copies of bfloat16
  weights for its matmuls) and, with delta sync, `delta_host_copy` (the receiver's copy of the last version).
- the trainer's `cpu_runtime` (`cpu=True`): the process's own memory beyond XLA's buffers while it traces,
  lowers and runs its step (`CPU_PROCESS_RUNTIME_BYTES`, measured, an estimate), its share per device. On a CPU
  device memory is the process's memory; an accelerator's device memory does not hold it. A rollout process
  shows no such excess (the real-size rehearsal's rollout peaks, 5.35 and 6.22 GiB on two runs, lie either side
  of its 5.62 GiB prediction without it: docs/performance.md, "Rehearsal").

Not counted, for the caller to add (the rehearsal measures them): the Python process's baseline (its RSS before
the model: imports, the XLA client), Ray, the trainer's copy of a version while it publishes (between updates),
and the host memory of checkpoints and rollout files; on an accelerator, host memory altogether and the compiled
programs. What only XLA:CPU allocates (float32 copies of bfloat16 weights for its matmuls, the engine's scratch
growing by twice a layer's bfloat16 shard per layer, whole gathered weights per FSDP device; docs/scaling.md) and
the trainer process's runtime (`CPU_PROCESS_RUNTIME_BYTES`) are counted with `cpu=True`.

The engine's cache is sized as the engine sizes its pages on the role's device kind: `engine_cache.py`.

`model.model.gradient_checkpointing: auto` and `trainer.per_device_parallelism: auto` are chosen here, from this
plan (`choose_update_memory`): checkpointing off where the trainer's peak without it fits `CHECKPOINTING_FIT_SHARE`
of a device's memory, the largest microbatch that fits. The trainer resolves them with its own device's limit
(`job.plan.train_worker_config`), the dry run and `predicted_memory` with the trainer placement's
(`engine_cache.trainer_device_bytes`), so no count here ever sees the string.

The rollout mesh is the accelerator's: `inference.model_axis_size`, else the largest divisor of the
device count that splits the model's heads and MLP (on a CPU a server with `model_axis_size: null`
uses one device: set it for a like-for-like comparison there).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from marinrl.config.trainer import parse_mp
from marinrl.dry_run.engine_cache import (
    RolloutDevice,
    abstract_engine_state,
    engine_pages,
    engine_sizing,
    rollout_device,
    trainer_device_bytes,
)
from marinrl.dry_run.flops import ModelDims
from marinrl.dry_run.meshes import (
    rollout_devices,
    rollout_mapping,
    rollout_model_axis_size,
    trainer_devices,
    trainer_mesh,
)
from marinrl.dry_run.shapes import GiB, abstract_model, cast_floats, shard_bytes, total_bytes
from marinrl.dry_run.working_set import (
    microbatch_rows_per_device,
    rollout_working_set_bytes,
    train_activation_bytes,
    train_logits_bytes,
    trainer_platform,
)
from marinrl.inference import scan_plan
from marinrl.levanter_configs import to_levanter, trainer_config

Role = Literal["trainer", "rollout"]
CPU_PROCESS_RUNTIME_BYTES = int(0.6 * GiB)
"""What an XLA:CPU trainer process holds beyond every buffer of its compiled step: host memory that JAX's tracing
and lowering of the step keep (~0.3 GiB, none given back) and a transient of about 0.3 GiB while a step runs
(measured at bench/train_step.py's vocab150k shape, where the compiled step's arguments and temporaries are all in
the prediction: docs/performance.md, "Large vocabulary"). Counted only on a CPU (`cpu=True`), where device memory
is the process's memory; an accelerator's device memory does not hold it."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One role's predicted memory: bytes per device by component, and the peak they add up to."""

    role: str
    devices: int
    """Devices the role's mesh spans."""
    devices_per_process: int
    """Devices one process holds: a host's chips, or all fake CPU devices (they share one process)."""
    mesh: dict
    """Mesh axis sizes."""
    bytes_per_device: dict
    """Component name -> bytes on the most loaded device, in the order the peak adds them."""
    estimated: tuple
    """The components that are estimates from shapes (the others are exact from shapes and shardings)."""
    notes: tuple = ()
    """How a component was sized where the job leaves it to the device (the engine's pages)."""

    @property
    def peak_bytes_per_device(self) -> float:
        return float(sum(self.bytes_per_device.values()))

    @property
    def peak_bytes_per_process(self) -> float:
        return self.peak_bytes_per_device * self.devices_per_process

    @property
    def composition(self) -> str:
        return " + ".join(self.bytes_per_device)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak_bytes_per_device": self.peak_bytes_per_device,
                "peak_bytes_per_process": self.peak_bytes_per_process}


# ------------------------------------------------------------------------------------------- the plan


def train_row_length(job, prompt_tokens: int, response_tokens: int) -> int:
    """The row length the trainer's batches take: the bucket that holds prompt + response."""
    b = job.batching
    return b.bucket_for(min(b.max_length, prompt_tokens + response_tokens))


def _trainer_plan(job, n_devices: int, prompt_tokens: int, response_tokens: int, cpu: bool = False) -> MemoryPlan:
    from levanter.trainer_state import TrainerState

    mesh = trainer_mesh(job, n_devices)
    trainer_cfg = trainer_config(job)
    mapping = trainer_cfg.parameter_axis_mapping
    from marinrl.config.policies import trainers
    from marinrl.models.adapter_stack import adapted_model
    from marinrl.models.lora import trainable_filter
    from marinrl.train.adapter_slots import per_slot

    first = trainers(job)[0]  # the first trainer's (with several adapters on one base: the base once, K adapters)
    adapters = tuple(m.lora for m in first.adapters) if first.adapters else first.lora
    optimizer = to_levanter(first.optimizer).build(job.num_train_steps)
    if first.adapters:
        optimizer = per_slot(optimizer, len(first.adapters))
    model = abstract_model(to_levanter(first.model.model), first.model.vocab_size, jnp.dtype(first.model.dtype))
    model = eqx.filter_eval_shape(adapted_model, model, adapters)
    state = eqx.filter_eval_shape(
        lambda m: TrainerState.init(optimizer, m, key=jax.random.PRNGKey(0), mp=to_levanter(job.trainer).mp,
                                    is_trainable=True if adapters is None else trainable_filter(m)), model)
    params = shard_bytes(state.model, mapping, mesh)
    grads = shard_bytes(state.trainable_model, mapping, mesh)
    rows = job.groups_per_step * job.n_generations
    mbs = trainer_cfg.microbatch_size
    accumulating = mbs is not None and mbs < rows
    length = train_row_length(job, prompt_tokens, response_tokens)
    per_host = job.ray.trainer.devices()
    slots = len(first.adapters) or 1  # a step of K adapters runs K batches of `rows` at once
    head = {k: slots * v for k, v in train_logits_bytes(job, mesh, length).items()}
    components = {"parameters": params, "gradients": grads,
                  "gradient_accumulator": grads if accumulating else 0.0,
                  "optimizer_state": shard_bytes(state.opt_state, mapping, mesh),
                  "activations": slots * train_activation_bytes(job, mesh, length, cpu), **head}
    estimated = ("activations", *head)
    compute = jnp.dtype(parse_mp(job.trainer.mp)["compute"])
    gathered = cpu and mesh["data"] * mesh["replica"] > 1
    if compute != jnp.dtype(parse_mp(job.trainer.mp)["params"]) and not gathered:
        # jmp casts the float32 masters to the compute dtype for the forward and backward: a copy, sharded
        # as the parameters (XLA:CPU's whole gathered copy on FSDP devices is `gathered_parameters`)
        components["compute_parameters"] = shard_bytes(cast_floats(state.model, compute), mapping, mesh)
        estimated += ("compute_parameters",)
    if gathered:
        # XLA:CPU's SPMD program gathers every FSDP-sharded weight whole (in the compute dtype) for the
        # forward and holds whole float32 gradients before their reduce-scatter, per device (measured:
        # docs/scaling.md, "Rehearsal"); an accelerator's gathers stay within the layer scan.
        components["gathered_parameters"] = total_bytes(cast_floats(state.model, compute)) / mesh["model"]
        components["unsharded_gradients"] = total_bytes(state.trainable_model) / mesh["model"] - grads
        estimated += ("gathered_parameters", "unsharded_gradients")
    if cpu and _delta_sync(job):  # the delta server's host copy of the last version; on a CPU host is device memory
        version = shard_bytes(cast_floats(state.model, jnp.dtype(job.rollout_dtype())), mapping, mesh)
        components["delta_host_copy"] = version
    per_process = min(per_host or n_devices, n_devices)
    if cpu:
        components["cpu_runtime"] = CPU_PROCESS_RUNTIME_BYTES / per_process
        estimated += ("cpu_runtime",)
    return MemoryPlan(
        role="trainer", devices=n_devices, devices_per_process=per_process, mesh=mesh,
        bytes_per_device=components, estimated=estimated)


def _rollout_plan(job, n_devices: int, prompt_tokens: int, response_tokens: int, cpu: bool = False,
                  device: Optional[RolloutDevice] = None) -> MemoryPlan:
    model_axis = rollout_model_axis_size(job, n_devices, device or rollout_device(job, cpu))
    mesh = {"data": n_devices // model_axis, "model": model_axis}
    mapping = rollout_mapping(job, model_axis)
    model = abstract_model(to_levanter(job.model.model), job.model.vocab_size, jnp.dtype(job.rollout_dtype()))
    notes = ()
    if job.inference.backend == "engine":
        pages, page, how = engine_pages(job, model, mapping, mesh, device or rollout_device(job, cpu))
        notes = (f"cache: {how}",)
        with hax.axis_mapping(mapping):
            cache = shard_bytes(abstract_engine_state(model, engine_sizing(job, page_size=page, max_pages=pages)),
                                mapping, mesh)
    else:
        plan = scan_call_plan(job, prompt_tokens, response_tokens, mesh, device or rollout_device(job, cpu))
        cache = plan.per_device_cache_bytes
        notes = (f"scan sampler: {plan.calls} call(s) of {plan.rows_per_call} rows",)
    weights = shard_bytes(model, mapping, mesh)
    components = {"weights": weights, "cache": cache,
                  "working_set": rollout_working_set_bytes(job, model_axis, mesh["data"]),
                  "incoming_version": weights}  # a new version is built beside the served one, then swapped
    estimated = ("working_set",)
    if cpu and jnp.dtype(job.rollout_dtype()).itemsize < 4:
        components["cpu_float32_weights"] = weights * 4 / jnp.dtype(job.rollout_dtype()).itemsize
        estimated += ("cpu_float32_weights",)
    if cpu and _delta_sync(job):  # the delta receiver's host copy of the last version
        components["delta_host_copy"] = weights
    return MemoryPlan(
        role="rollout", devices=n_devices, devices_per_process=n_devices, mesh=mesh,
        bytes_per_device=components, estimated=estimated, notes=notes)


def scan_call_plan(job, prompt_tokens: int, response_tokens: int, mesh: Optional[dict] = None,
                   device: Optional[RolloutDevice] = None):
    """The scan sampler's split of one rollout worker's batch into device calls (`scan_plan.CallPlan`), as
    `sampler.sample` makes it: `inference.scan_max_cache_bytes` per device, `auto` from the rollout device's
    memory less the served weights (`device`, else the placement's), the CPU default where it is unknown."""
    dims = ModelDims.of(to_levanter(job.model.model), job.model.vocab_size)
    arch = to_levanter(job.model.model)
    mesh = mesh or {"data": 1, "model": 1}
    itemsize = np.dtype(job.rollout_dtype()).itemsize
    per_prompt = scan_plan.kv_bytes_per_prompt(
        layers=dims.layers, kv_heads=arch.num_kv_heads, head_size=dims.kv_dim // arch.num_kv_heads,
        itemsize=itemsize, p_len=scan_plan.bucket(prompt_tokens, 16), t_len=scan_plan.bucket(response_tokens, 16),
        n=job.n_generations)
    budget = job.inference.scan_max_cache_bytes
    if budget == "auto":
        device = device or rollout_device(job)
        weights = 0.0
        if device.memory_bytes:
            model = abstract_model(arch, job.model.vocab_size, jnp.dtype(job.rollout_dtype()))
            weights = shard_bytes(model, rollout_mapping(job, mesh["model"]), mesh)
        budget = scan_plan.auto_cache_budget(device.memory_bytes, weights)
    return scan_plan.plan_calls(prompts=max(1, job.groups_per_step // job.n_rollout_workers), n=job.n_generations,
                                per_prompt_bytes=per_prompt, budget_bytes=budget, kv_heads=arch.num_kv_heads,
                                data=mesh["data"], model=mesh["model"])


# ---------------------------------------------------------------------- gradient checkpointing, microbatch

CHECKPOINTING_FIT_SHARE = 0.9
"""`auto` takes a plan of the update only where its predicted peak fills at most this share of the device's
memory; the rest is room for what the plan does not count (the compiled programs, the allocator's
fragmentation). The plan errs high on a GPU, where XLA fuses more (docs/performance.md)."""
MIN_MICROBATCH_TOKENS = 4096
"""`per_device_parallelism: auto` with `gradient_checkpointing: auto` drops the recomputation by shrinking the
microbatch only down to this many tokens per device (rows × the longest row); below, it keeps the larger
microbatch and recomputes (one more forward: a third more FLOPs), since matmuls over fewer tokens than this
leave an accelerator's compute units idle (an estimate, docs/training.md, "Memory of the update")."""


@dataclasses.dataclass(frozen=True)
class UpdateMemoryChoice:
    """What `gradient_checkpointing: auto` and `per_device_parallelism: auto` resolved to, and the numbers they
    were chosen from."""

    on: Optional[bool]
    """Gradient checkpointing as chosen; None: the config sets it (not `auto`)."""
    device_bytes: Optional[float]
    """The allocator's limit of one trainer device; None where unknown (a CPU)."""
    peak_without_bytes: Optional[float] = None
    """The predicted peak per device with checkpointing off at the chosen microbatch (at the smallest tried where
    `auto` kept it on; None: not predicted)."""
    microbatch_rows: Optional[int] = None
    """Rows per device per microbatch as chosen (-1: the whole batch); None: the config sets it (not `auto`)."""
    peak_bytes: Optional[float] = None
    """The predicted peak per device of the chosen plan (None: memory unknown)."""

    def lines(self) -> list[str]:
        """One line per `auto` setting, for the run's log and the dry run's report."""
        out = []
        if self.device_bytes is None:
            if self.on is not None:
                out.append("gradient checkpointing on (auto): the trainer device's memory is unknown")
            if self.microbatch_rows == -1:
                out.append("microbatch: the whole batch (auto): the trainer device's memory is unknown")
            elif self.microbatch_rows is not None:
                out.append(f"microbatch {self.microbatch_rows} rows per device (auto): the trainer device's memory "
                           f"is unknown, so at most {MIN_MICROBATCH_TOKENS:,} tokens a device")
            return out
        limit = self.device_bytes / GiB
        if self.on is not None:
            if self.on:
                out.append(f"gradient checkpointing on (auto): predicted peak without it "
                           f"{self.peak_without_bytes / GiB:.2f} GiB exceeds {CHECKPOINTING_FIT_SHARE:.0%} of "
                           f"{limit:.2f} GiB")
            else:
                out.append(f"gradient checkpointing off (auto): predicted peak {self.peak_without_bytes / GiB:.2f} "
                           f"GiB of {limit:.2f} GiB")
        if self.microbatch_rows is not None:
            fits = self.peak_bytes <= CHECKPOINTING_FIT_SHARE * self.device_bytes
            peak = "" if self.on is False else (f": predicted peak {self.peak_bytes / GiB:.2f} GiB of {limit:.2f} GiB"
                                               + ("" if fits else f", over {CHECKPOINTING_FIT_SHARE:.0%}: no "
                                                                  f"smaller microbatch exists"))
            out.append(f"microbatch {self.microbatch_rows} rows per device (auto){peak}")
        return out

    def line(self) -> str:
        return "; ".join(self.lines())


def with_gradient_checkpointing(job, policy):
    """`job` with `model.model.gradient_checkpointing` set to `policy`."""
    model = dataclasses.replace(job.model.model, gradient_checkpointing=policy)
    return dataclasses.replace(job, model=dataclasses.replace(job.model, model=model))


def with_microbatch(job, rows: int):
    """`job` with `trainer.per_device_parallelism` set to `rows`."""
    return dataclasses.replace(job, trainer=dataclasses.replace(job.trainer, per_device_parallelism=rows))


def _microbatch_candidates(job, n_devices: int) -> list[int]:
    """Rows per device per microbatch `auto` may take, largest first: the divisors of a device's share of the
    batch (the whole share first, as -1)."""
    share = microbatch_rows_per_device(with_microbatch(job, -1), trainer_mesh(job, n_devices))
    return [-1] + [r for r in range(share // 2, 0, -1) if share % r == 0]


def choose_update_memory(job, device_bytes: Optional[float], n_devices: Optional[int] = None,
                         cpu: bool = False) -> UpdateMemoryChoice:
    """`auto`'s choice for `job`'s trainer on devices of `device_bytes` each (`n_devices`: the trainer's placement),
    predicted at the longest row its batches hold (`batching.max_length`). Gradient checkpointing `auto`: off where
    the peak without it fits `CHECKPOINTING_FIT_SHARE` of the device, else on. `per_device_parallelism: auto`: the
    largest microbatch that fits, preferring no recomputation (when that is `auto` too) down to
    `MIN_MICROBATCH_TOKENS` a device; the smallest where nothing fits. Memory unknown: checkpointing on, and the
    whole batch at once on a CPU (its memory is the host's), else the most rows per device holding at most
    `MIN_MICROBATCH_TOKENS` (a dry run whose placement names no known device: the trainer itself reads its
    device's limit). `cpu`: the trainer runs on CPU devices whatever its placement says."""
    gc_auto = getattr(job.model.model, "gradient_checkpointing", None) == "auto"
    mb_auto = job.trainer.per_device_parallelism == "auto"
    n_devices = n_devices or trainer_devices(job)
    longest = job.batching.max_length  # prompt + response capped at max_length: the longest bucket
    sizes = _microbatch_candidates(job, n_devices) if mb_auto else [job.trainer.per_device_parallelism]
    if not device_bytes:
        busy = next((r for r in sizes[1:] if r * longest <= MIN_MICROBATCH_TOKENS), sizes[-1])
        rows = -1 if trainer_platform(job, cpu) == "cpu" else busy
        return UpdateMemoryChoice(on=True if gc_auto else None, device_bytes=None,
                                  microbatch_rows=rows if mb_auto else None)
    limit = CHECKPOINTING_FIT_SHARE * device_bytes
    policies = [False, True] if gc_auto else [job.model.model.gradient_checkpointing]

    def peak(policy, rows) -> float:
        seen = with_microbatch(with_gradient_checkpointing(job, policy), rows)
        return predicted_memory(seen, "trainer", n_devices, prompt_tokens=longest,
                                response_tokens=longest).peak_bytes_per_device

    without = None
    for policy in policies:
        for rows in sizes:
            if policy is False and gc_auto and mb_auto and rows != sizes[0] and \
                    rows * longest < MIN_MICROBATCH_TOKENS:
                break  # fewer tokens than pay for the recompute saved
            p = peak(policy, rows)
            if policy is False:
                without = p
            if p <= limit or (not mb_auto and policy is policies[-1]):
                return UpdateMemoryChoice(on=bool(policy) if gc_auto else None, device_bytes=float(device_bytes),
                                          peak_without_bytes=without, microbatch_rows=rows if mb_auto else None,
                                          peak_bytes=p)
    return UpdateMemoryChoice(on=bool(policies[-1]) if gc_auto else None, device_bytes=float(device_bytes),
                              peak_without_bytes=without, microbatch_rows=sizes[-1], peak_bytes=p)


def resolve_update_memory(job, device_bytes: Optional[float], n_devices: Optional[int] = None, cpu: bool = False):
    """(`job` with `gradient_checkpointing: auto` and `per_device_parallelism: auto` replaced by
    `choose_update_memory`'s choice, the choice); a job that sets both comes back as it is, with None."""
    gc_auto = getattr(job.model.model, "gradient_checkpointing", None) == "auto"
    mb_auto = job.trainer.per_device_parallelism == "auto"
    if not gc_auto and not mb_auto:
        return job, None
    choice = choose_update_memory(job, device_bytes, n_devices, cpu)
    if gc_auto:
        job = with_gradient_checkpointing(job, choice.on)
    if mb_auto:
        job = with_microbatch(job, choice.microbatch_rows)
    return job, choice


def default_response_tokens(job) -> int:
    return max(lesson.max_tokens for lesson in job.curriculum.lessons)


def _delta_sync(job) -> bool:
    """Whether weight versions travel as deltas (each side then keeps a host copy of the last version)."""
    return bool(getattr(job.weights_config(), "delta", False))


def _with_local_checkpoint_architecture(job):
    """`job` with `model.model` and `vocab_size` from its HF checkpoint's config.json when that is a local
    folder (what the run will build); a remote or missing one leaves the config's (the recipes' dry runs)."""
    import os

    path = job.model.hf_checkpoint
    if not path or ("://" in path and not path.startswith("file://")):
        return job
    if not os.path.exists(os.path.join(path.removeprefix("file://"), "config.json")):
        return job
    from marinrl.models.policy_model import model_architecture

    arch, vocab = model_architecture(job.model)
    return dataclasses.replace(job, model=dataclasses.replace(job.model, model=arch, vocab_size=vocab))


def predicted_memory(job, role: Role, n_devices: Optional[int] = None, *, prompt_tokens: int = 256,
                     response_tokens: Optional[int] = None, cpu: bool = False,
                     device: Optional[RolloutDevice] = None) -> MemoryPlan:
    """`role`'s memory per device for `job` on `n_devices` devices (None: the trainer's placement, or the
    rollout worker's; see the module doc for what is counted). Lowers nothing. `prompt_tokens` and
    `response_tokens` (None: the curriculum's largest `max_tokens`) fix the trainer's row length and the
    scan sampler's cache; the engine's cache is sized by `inference.engine` alone. `cpu`: also count what
    XLA:CPU adds on fake CPU devices (whole gathered weights and gradients per FSDP device, float32 copies
    of bfloat16 rollout weights, the process's runtime), for a run on this machine (bench/rehearsal.py).
    `device`: the rollout's device as measured where one is at hand (its kind and `bytes_limit`;
    bench/device_check.py), in place of what the placement says (`rollout_device`)."""
    if role not in ("trainer", "rollout"):
        raise ValueError(f"predicted_memory: role must be 'trainer' or 'rollout', got {role!r}")
    if n_devices is not None and n_devices < 1:
        raise ValueError(f"predicted_memory: n_devices must be >= 1 or None, got {n_devices}")
    response = response_tokens or default_response_tokens(job)
    if role == "trainer":  # before the checkpoint's architecture takes the setting
        job = resolve_update_memory(job, trainer_device_bytes(job, cpu), n_devices, cpu)[0]
    job = _with_local_checkpoint_architecture(job)
    if role == "trainer":
        return _trainer_plan(job, n_devices or trainer_devices(job), prompt_tokens, response, cpu)
    return _rollout_plan(job, n_devices or rollout_devices(job), prompt_tokens, response, cpu, device)

