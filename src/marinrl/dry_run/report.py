"""The dry run itself: check the programs (`programs.py`), predict each role's memory (`memory.py`) and
count the FLOPs (`flops.py`), then print them, each line saying what is exact and what is estimated."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp

import marinrl.dry_run.flops as flops
import marinrl.dry_run.memory as memory
import marinrl.dry_run.meshes as meshes
import marinrl.dry_run.programs as programs
from marinrl.config.checks import require_at_least
from marinrl.dry_run.engine_cache import trainer_device_bytes
from marinrl.dry_run.shapes import GiB, abstract_model, count
from marinrl.dry_run.working_set import attention_setting, trainer_attention
from marinrl.levanter_configs import to_levanter


@dataclasses.dataclass(frozen=True)
class DryRunShapes:
    """The token shapes the dry run counts at, and how deep it lowers (the config fixes the rest)."""

    prompt_tokens: int = 256
    """Prompt length of every row (a GSM8K question with its chat template is ~150-250 tokens)."""
    response_tokens: Optional[int] = None
    """Generated tokens per sample; None: the largest `max_tokens` among the curriculum's lessons."""
    layers: int = 1
    """Layers of the model the programs are lowered and compiled with (memory and FLOPs are always for
    the model's full depth, from shapes)."""

    def __post_init__(self):
        require_at_least(self, 1, "prompt_tokens", "layers")
        if self.response_tokens is not None and self.response_tokens < 1:
            raise ValueError(f"DryRunShapes.response_tokens must be >= 1 or None, got {self.response_tokens}")


@dataclasses.dataclass
class DryRunReport:
    backend: str
    """The rollout backend the job runs (`inference.backend`), whose programs were compiled."""
    programs: list
    """`ProgramCheck`s: what was lowered (and compiled), where, with how many layers."""
    trainer: memory.MemoryPlan
    rollout: memory.MemoryPlan
    train_flops: flops.TrainFlops
    generation_flops: flops.GenerationFlops
    """One train step's rollouts: every worker's prompts, `n_generations` rows each."""
    rollout_workers: int
    total_params: int
    prompt_tokens: int
    response_tokens: int
    row_length: int
    rows: int
    seconds: float
    trainer_settings: str = ""
    """The trainer's gradient checkpointing (and microbatch where `auto`): `auto`'s choice with its numbers
    (`memory.UpdateMemoryChoice.line`), else the policy the config sets; and the attention its device runs."""

    def lines(self) -> list[str]:
        t, g = self.train_flops, self.generation_flops
        out = [f"[dry run] parameters {self.total_params / 1e9:.3f} B; rollout backend: {self.backend}; "
               f"{self.prompt_tokens}-token prompts, {self.response_tokens}-token responses; {self.seconds:.1f} s"]
        for p in self.programs:
            what = "lowered and compiled" if p.compiled else "lowered"
            temp = (f", CPU compiler scratch {p.cpu_temp_bytes_per_device / GiB:.3f} GiB per device"
                    if p.compiled else "")
            out.append(f"[dry run] {p.name}: {what} with {p.layers} of the model's layers on {p.devices} devices, "
                       f"mesh {p.mesh} ({p.lower_seconds:.1f} s + {p.compile_seconds:.1f} s){temp}")
        if self.trainer_settings:
            out.append(f"[dry run] trainer {self.trainer_settings}")
        for plan in (self.trainer, self.rollout):
            parts = ", ".join(f"{name} {b / GiB:.3f}{' (estimate)' if name in plan.estimated else ''}"
                              for name, b in plan.bytes_per_device.items())
            out.append(f"[dry run] {plan.role} memory per device (GiB; {plan.devices} devices, mesh {plan.mesh}): "
                       f"{parts}; peak = {plan.composition} = {plan.peak_bytes_per_device / GiB:.3f} GiB, "
                       f"{plan.peak_bytes_per_process / GiB:.3f} GiB per process of {plan.devices_per_process} devices")
            out += [f"[dry run] {plan.role} {note}" for note in plan.notes]
        out += [
            f"[dry run] train FLOPs per step ({self.rows} rows × {self.row_length} tokens): model {t.model:.4g} "
            f"(6·N·T + attention, for MFU), executed {t.executed:.4g} (+ {t.recompute:.4g} gradient-checkpointing "
            f"recompute)",
            f"[dry run] generation FLOPs per train step ({self.rollout_workers} rollout workers, every row to its "
            f"{self.response_tokens}-token budget): {g.total:.4g} = prefill {g.prefill:.4g} ({g.prompt_tokens} prompt "
            f"tokens) + decode {g.decode:.4g} ({g.decode_tokens} decode steps)",
        ]
        return out

    def as_dict(self) -> dict:
        return {
            "backend": self.backend, "programs": [dataclasses.asdict(p) for p in self.programs],
            "trainer": self.trainer.as_dict(), "rollout": self.rollout.as_dict(),
            "train_flops": dataclasses.asdict(self.train_flops),
            "generation_flops": {**dataclasses.asdict(self.generation_flops), "total": self.generation_flops.total},
            "rollout_workers": self.rollout_workers, "total_params": self.total_params,
            "prompt_tokens": self.prompt_tokens, "response_tokens": self.response_tokens,
            "row_length": self.row_length, "rows": self.rows, "seconds": self.seconds,
            "trainer_settings": self.trainer_settings,
        }


def step_flops(job, shapes: DryRunShapes) -> tuple[flops.TrainFlops, flops.GenerationFlops]:
    """One train step's FLOPs and the generation FLOPs of its rollouts (every worker's), at `shapes`
    (`gradient_checkpointing: auto` and `per_device_parallelism: auto` as the trainer placement's device resolves
    them)."""
    job = memory.resolve_update_memory(job, trainer_device_bytes(job))[0]
    response = shapes.response_tokens or memory.default_response_tokens(job)
    dims = flops.ModelDims.of(to_levanter(job.model.model), job.model.vocab_size)
    rows = job.groups_per_step * job.n_generations
    length = memory.train_row_length(job, shapes.prompt_tokens, response)
    passes = flops.recomputed_forward_passes(getattr(to_levanter(job.model.model), "gradient_checkpointing", False))
    return (flops.train_flops(dims, rows, length, passes),
            flops.generation_flops(dims, job.groups_per_step, job.n_generations, shapes.prompt_tokens, response))


def _checkpointing_as_set(job) -> str:
    gc = getattr(job.model.model, "gradient_checkpointing", None)
    return f"gradient checkpointing {'on' if gc is True else 'off' if gc is False else gc} (as the config sets it)"


def dry_run(job, shapes: DryRunShapes = DryRunShapes()) -> DryRunReport:
    """Check `job`'s train step and its rollout backend's programs at its shapes, and predict memory and
    FLOPs (see the package doc). `job` is validated by the caller (`marinrl.recipe`). The process must have
    the trainer's device count (`ray.trainer.devices()`, 8 when it fixes none)."""
    want = meshes.trainer_devices(job)
    if len(jax.devices()) != want:
        raise RuntimeError(f"the dry run of this config needs {want} devices (ray.trainer: {job.ray.trainer}), this "
                           f"process has {len(jax.devices())}: run it through marinrl.recipe (it sets XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={want} before JAX loads)")
    started = time.perf_counter()
    # `auto` resolved once, as the trainer will on the placement's device: every count below sees the choice
    job, choice = memory.resolve_update_memory(job, trainer_device_bytes(job), want)
    settings = _checkpointing_as_set(job) if choice is None or choice.on is None else ""
    attention = f"attention {trainer_attention(job)} ({attention_setting(job.model.model)})"
    settings = "; ".join(x for x in (settings, choice.line() if choice else "", attention) if x)
    response = shapes.response_tokens or memory.default_response_tokens(job)
    full = to_levanter(job.model.model)
    layers = min(shapes.layers, full.num_layers)
    trainer = memory.predicted_memory(job, "trainer", want, prompt_tokens=shapes.prompt_tokens,
                                      response_tokens=response)
    n_rollout = meshes.rollout_devices(job)
    if n_rollout > want:
        raise RuntimeError(f"ray.rollout gives a rollout worker {n_rollout} devices, more than this process's {want}")
    rollout = memory.predicted_memory(job, "rollout", n_rollout, prompt_tokens=shapes.prompt_tokens,
                                      response_tokens=response)
    rows = job.groups_per_step * job.n_generations
    length = memory.train_row_length(job, shapes.prompt_tokens, response)

    checks = [programs.check_train_step(job, layers, rows, length)]
    model_axis = rollout.mesh["model"]
    if job.inference.backend == "engine":
        checks += programs.check_engine(job, layers, n_rollout, model_axis)
    else:
        from marinrl.inference.scan_plan import bucket

        chunk = memory.scan_call_plan(job, shapes.prompt_tokens, response, rollout.mesh).prompts_per_call
        checks += programs.check_scan_sampler(job, layers, n_rollout, model_axis, chunk,
                                              bucket(shapes.prompt_tokens, 16), bucket(response, 16))

    train, generation = step_flops(job, shapes)
    abstract = abstract_model(full, job.model.vocab_size, jnp.dtype(job.model.dtype))
    return DryRunReport(
        backend=job.inference.backend, programs=checks, trainer=trainer, rollout=rollout,
        train_flops=train, generation_flops=generation,
        rollout_workers=job.n_rollout_workers, total_params=count(abstract), prompt_tokens=shapes.prompt_tokens,
        response_tokens=response, row_length=length, rows=rows, seconds=time.perf_counter() - started,
        trainer_settings=settings)

