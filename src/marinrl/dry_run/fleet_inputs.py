"""What the fleet planner takes from a job config and `marinrl plan`'s flags: each role's chips (the config's
`ray.trainer` / `ray.rollout`, unless `--accelerator` names a row), a rollout host's generation speed, the
model's train FLOPs a token and bytes a version, the tokens of a row; every figure with where it came from, so
that `marinrl plan` prints what it assumed (docs/planning.md). Pure arithmetic: no JAX, Levanter or Ray (a TPU
placement's chip count is Ray's table, which the config's own check has loaded already)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from marinrl.dry_run.fleet import FleetShape
from marinrl.dry_run.flops import ModelDims, chip_memory_bandwidth, chip_peak_flops, train_flops


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator row: a chip's peak, a training MFU, one rollout host's generation speed, and where the
    last two come from (measured, scaled from a measurement, or assumed)."""

    peak_flops: float
    mfu: float
    host_tokens_per_s: float
    mfu_from: str = "assumed"
    tokens_from: str = "assumed"


H200_SAMPLER_TOKENS_PER_S = 21_581.0
"""The scan sampler on one H200 at the recipe's shape (Qwen3-0.6B, bfloat16, 256 rows of up to 768 new tokens in
one call): `bench/generation.py --shape recipe` in docs/device_check.md, "Qwen3-0.6B on one H200"."""
H200_MFU = 0.193
"""The recipe's update on one H200 (32 rows x 1,024 tokens, microbatch 16, checkpointing off, as `auto` chooses
there): 0.675 s a step, docs/device_checks/2026-11-28-h200-session.json."""
H100_MFU = 0.21
"""The recipe's update on one H100 (the same shape with checkpointing on, as `auto` keeps it there): 0.619 s a
step, docs/device_checks/2026-11-26-h100.json. Measured on the H100 itself, so not scaled from the H200 (their
dense peaks are equal: scaling would give the H200's 0.193)."""
H100_SAMPLER_TOKENS_PER_S = H200_SAMPLER_TOKENS_PER_S * (chip_memory_bandwidth("NVIDIA H100")
                                                         / chip_memory_bandwidth("NVIDIA H200"))
"""Scaled, not measured: a decode step reads the weights and the cache, so the H200's figure times the H100's
bandwidth over the H200's (3.35 / 4.8 TB/s): about 15,000 tokens/s. The H100's own 8,012 (docs/device_check.md)
was the older sampler running the recipe's batch 16 rows a call."""

ACCELERATORS: dict[str, Chip] = {
    "cpu": Chip(1.8e11, 0.5, 8_000.0, mfu_from="assumed for this repository's 2-core CPU, a large float32 matmul's "
                                             "FLOP/s as the peak", tokens_from="bench/fleet.py's default"),
    **{name: Chip(chip_peak_flops(kind), 0.4, tokens)
       for name, kind, tokens in (("v4", "TPU v4", 20_000.0), ("v5e", "TPU v5 lite", 15_000.0),
                                  ("v5p", "TPU v5", 30_000.0), ("v6e", "TPU v6 lite", 40_000.0),
                                  ("a100", "NVIDIA A100", 20_000.0))},
    "h100": Chip(chip_peak_flops("NVIDIA H100"), H100_MFU, H100_SAMPLER_TOKENS_PER_S,
                 mfu_from="measured on one H100: Qwen3-0.6B's update, checkpointing on",
                 tokens_from="the H200's measured figure scaled by the H100's memory bandwidth (3.35 / 4.8 TB/s)"),
    "h200": Chip(chip_peak_flops("NVIDIA H200"), H200_MFU, H200_SAMPLER_TOKENS_PER_S,
                 mfu_from="measured on one H200: Qwen3-0.6B's update, checkpointing off",
                 tokens_from="measured on one H200: the scan sampler, Qwen3-0.6B, 256 rows of up to 768 tokens"),
}
"""Per accelerator: the bf16 dense peak per chip (`flops.CHIP_PEAK_FLOPS`), a training MFU, one rollout host's
generation speed (tokens/s; the GPU rows: one GPU), and where each comes from (docs/planning.md)."""

CONFIG_DEVICES = {("tpu", "v4"): "v4", ("tpu", "v5litepod"): "v5e", ("tpu", "v5p"): "v5p", ("tpu", "v6e"): "v6e",
                  ("gpu", "a100"): "a100", ("gpu", "h100"): "h100", ("gpu", "h200"): "h200"}
"""A placement's device (`PlacementConfig.device`: its kind, and a TPU's generation or a GPU's `accelerator_type`,
lowercased, without a memory suffix such as `-80G`) to its `ACCELERATORS` row."""


def chip_of(placement, field: str) -> tuple[str, str]:
    """(`ACCELERATORS` row, where from) of a role's placement (`field`: `ray.trainer`, `ray.rollout`); ValueError
    naming the field where the placement names a device the planner has no row for."""
    kind, name, _ = placement.device
    if kind == "cpu":
        return "cpu", f"{field} names no accelerator"
    row = CONFIG_DEVICES.get((kind, (name or "").lower().split("-")[0]))
    if row is None:
        named = f"{kind.upper()} {name}" if name else f"a {kind.upper()} of no named kind"
        fix = f"set {field}.accelerator_type ({'H100, H200, A100' if kind == 'gpu' else 'TPU-V5P, ...'}) or " \
            if not name else ""
        raise ValueError(f"{field}: {placement.accelerator_field} is {named}, which the planner has no figures for: "
                         f"{fix}pass --accelerator (one of {', '.join(ACCELERATORS)}) and --host_tokens_per_s")
    return row, f"{field}: {placement.accelerator_field}"


def placed_chips(placement) -> int:
    """The chips a role's placement asks for over all its hosts (1 where it names no accelerator)."""
    return placement.devices() * placement.hosts() if placement.device[0] != "cpu" else 1


def _checkpoint_dims(job) -> Optional[ModelDims]:
    """The dimensions of a model the config names by a local HF checkpoint (its config.json); None if none is
    named. ValueError naming the field where the checkpoint's architecture cannot be read without loading it."""
    m = job.model
    if m.levanter_checkpoint:
        raise ValueError("model.levanter_checkpoint names the model: pass --params (e.g. 8e9)")
    if not m.hf_checkpoint:
        return None
    path = os.path.join(m.hf_checkpoint, "config.json")
    try:
        with open(path) as f:
            c = json.load(f)
        heads = c["num_attention_heads"]
        return ModelDims(hidden=c["hidden_size"], intermediate=c["intermediate_size"], layers=c["num_hidden_layers"],
                         heads=heads, kv_heads=c.get("num_key_value_heads", heads),
                         head_dim=c.get("head_dim") or c["hidden_size"] // heads, vocab=c["vocab_size"],
                         tied_embeddings=bool(c.get("tie_word_embeddings", False)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model.hf_checkpoint: {path} does not give the architecture ({type(e).__name__}: {e}): "
                         "pass --params (e.g. 8e9)") from None


def model_parameters(dims: ModelDims) -> int:
    """Every parameter a version carries but the norms: the layers' and the LM head's matmuls, and the embedding
    table unless the head is that table (`tied_embeddings`)."""
    return dims.matmul_params + dims.vocab * dims.hidden * (0 if dims.tied_embeddings else 1)


@dataclasses.dataclass(frozen=True)
class JobInputs:
    """The planner's figures from a job config and the flags, each with where it came from (`lines`)."""

    trainer: str
    trainer_chips: int
    trainer_from: str
    rollout: str
    rollout_from: str
    host_tokens_per_s: float
    tokens_from: str
    params: float
    flops_per_token: float
    model_from: str
    prompt_tokens: int
    response_tokens: int
    tokens_of_row_from: str
    dtype_bytes: int
    groups_per_step: int
    group_size: int
    max_staleness: int

    @property
    def train_tokens_per_s(self) -> float:
        chip = ACCELERATORS[self.trainer]
        return chip.peak_flops * chip.mfu * self.trainer_chips / self.flops_per_token

    def shape(self, **overrides) -> FleetShape:
        """The `FleetShape` of these inputs (`overrides`: its storage and fan-out fields)."""
        return FleetShape(groups_per_step=self.groups_per_step, group_size=self.group_size,
                          prompt_tokens=self.prompt_tokens, response_tokens=self.response_tokens,
                          host_tokens_per_s=self.host_tokens_per_s, train_tokens_per_s=self.train_tokens_per_s,
                          max_staleness=self.max_staleness, weight_bytes=self.params * self.dtype_bytes, **overrides)

    def lines(self) -> list[str]:
        """What `marinrl plan` prints of these inputs."""
        chip = ACCELERATORS[self.trainer]
        return [
            f"trainer: {self.trainer_chips} x {self.trainer} ({self.trainer_from}): {chip.peak_flops:.3g} FLOP/s "
            f"peak a chip, MFU {chip.mfu:.2f} ({chip.mfu_from}): {self.train_tokens_per_s:,.0f} "
            "trained tokens/s",
            f"a rollout host: {self.rollout} ({self.rollout_from}): {self.host_tokens_per_s:,.0f} tokens/s "
            f"({self.tokens_from})",
            f"model: {self.params:.4g} parameters, {self.flops_per_token:.4g} train FLOPs a token ({self.model_from}); "
            f"a version {self.dtype_bytes} bytes a parameter (the rollout dtype)",
            f"a step: {self.groups_per_step} groups x {self.group_size} (groups_per_step x n_generations), "
            f"max_staleness {self.max_staleness}; a row: {self.prompt_tokens} prompt + {self.response_tokens} "
            f"response tokens ({self.tokens_of_row_from})",
        ]


def job_inputs(job, *, accelerator: Optional[str] = None, trainer_chips: Optional[int] = None,
               host_tokens_per_s: Optional[float] = None, params: Optional[float] = None,
               prompt_tokens: Optional[int] = None, response_tokens: Optional[int] = None) -> JobInputs:
    """The planner's figures for an `RLJobConfig` (`job`); each keyword, when given, overrides what the config
    gives (`accelerator`: both roles' row).

    The trainer's tokens/s is the chip's peak x MFU x its chips over the train step's model FLOPs a token
    (`dry_run.flops.train_flops` on the config's architecture, or a local HF checkpoint's config.json; `params`
    instead: 6 FLOPs a parameter a token). Response tokens: the lessons' largest `max_tokens` (a budget: an upper
    bound); prompt tokens: the rest of `batching.max_length`. A version is the parameters in the job's rollout
    dtype (2 bytes unless float32)."""
    if accelerator is not None and accelerator not in ACCELERATORS:
        raise ValueError(f"--accelerator: unknown accelerator {accelerator!r}: one of {', '.join(ACCELERATORS)}")
    if accelerator is None:
        (trainer, kind_from), (rollout, rollout_from) = chip_of(job.ray.trainer, "ray.trainer"), chip_of(
            job.ray.rollout, "ray.rollout")
    else:
        trainer, rollout, kind_from, rollout_from = accelerator, accelerator, "--accelerator", "--accelerator"
    if trainer_chips is not None:
        chips, chips_from = trainer_chips, "--trainer_chips"
    else:
        chips = placed_chips(job.ray.trainer)
        chips_from = (f"ray.trainer: {job.ray.trainer.accelerator_field}" if job.ray.trainer.device[0] != "cpu"
                      else "ray.trainer names no accelerator")
    trainer_from = kind_from if kind_from == chips_from else f"{kind_from}; chips: {chips_from}"
    if host_tokens_per_s is not None:
        tokens_from = "--host_tokens_per_s"
    else:
        host_tokens_per_s, tokens_from = ACCELERATORS[rollout].host_tokens_per_s, ACCELERATORS[rollout].tokens_from
    lessons = job.curriculum.lessons if job.curriculum is not None else ()
    response = response_tokens or max((lesson.max_tokens for lesson in lessons), default=256)
    prompt = prompt_tokens or max(1, job.batching.max_length - response)
    row_from = ", ".join([
        "--prompt_tokens" if prompt_tokens else f"batching.max_length {job.batching.max_length} less the response",
        "--response_tokens" if response_tokens else "the lessons' largest max_tokens, a budget"])
    if params is not None:
        per_token, model_from = 6.0 * params, "--params, 6 FLOPs a parameter a token"
    else:
        dims = _checkpoint_dims(job)
        model_from = f"{job.model.hf_checkpoint}/config.json" if dims else "the config's architecture"
        dims = dims or ModelDims.of(job.model.model, job.model.vocab_size)
        flops = train_flops(dims, job.groups_per_step * job.n_generations, prompt + response, 0)
        per_token, params = flops.model / flops.tokens, model_parameters(dims)
    dtype_bytes = 4 if str(job.rollout_dtype()) in ("float32", "f32") else 2
    return JobInputs(trainer=trainer, trainer_chips=chips, trainer_from=trainer_from, rollout=rollout,
                     rollout_from=rollout_from, host_tokens_per_s=host_tokens_per_s, tokens_from=tokens_from,
                     params=params, flops_per_token=per_token, model_from=model_from, prompt_tokens=prompt,
                     response_tokens=response, tokens_of_row_from=row_from, dtype_bytes=dtype_bytes,
                     groups_per_step=job.groups_per_step, group_size=job.n_generations,
                     max_staleness=job.max_staleness)


def shape_of_job(job, **flags_and_overrides) -> FleetShape:
    """The `FleetShape` of `job`: `job_inputs(job, **flags)`, then `FleetShape` fields as overrides."""
    names = {"accelerator", "trainer_chips", "host_tokens_per_s", "params", "prompt_tokens", "response_tokens"}
    flags = {k: v for k, v in flags_and_overrides.items() if k in names}
    overrides = {k: v for k, v in flags_and_overrides.items() if k not in names}
    return job_inputs(job, **flags).shape(**overrides)
