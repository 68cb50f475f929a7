"""The engine's KV cache as a rollout worker's engine would size it, from shapes: `engine_sizing` (the Levanter
`InferenceEngineConfig`), `engine_pages` (its pages on the role's device kind) and `abstract_engine_state`
(its `GenState` as ShapeDtypeStructs).

The engine's pages (`engine_pages`), as `levanter_engine.resolved_engine_config` and Levanter's engine size
them: `inference.engine.max_pages` when set; on a CPU (`cpu=True`, or a rollout placement without an
accelerator) `max_seqs` × ceil(`max_seq_len` / page) pages of 64 tokens; on a GPU or TPU with
`max_pages: null` as many pages as fit `hbm_utilization` of the device's free memory when the engine starts
(its memory limit less the served weights: Levanter's `_infer_max_pages_from_hbm`), pages of 128 tokens.
The device's memory comes from the rollout placement (`DEVICE_MEMORY_GIB`: the TPU generation of `tpu` or
`accelerator_type`, the GPU of `accelerator_type`, times `memory_fraction` on a GPU); where it names no
known device the plan counts `max_seqs` full-length sequences and says so in `notes`. The engine's page size
and cache dtype are `inference.engine.page_size` (else 128) and `inference.engine.compute_dtype` (else the
rollout dtype).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import equinox as eqx
import haliax as hax
import jax.numpy as jnp

from marinrl.dry_run.shapes import GiB, shard_bytes
from marinrl.inference.levanter_engine import resolved_engine_config

ACCELERATOR_PAGE_SIZE = 128
"""The engine's page size on TPU/GPU when `inference.engine.page_size` is unset (`EngineConfig`)."""
CPU_PAGE_SIZE = 64
"""The engine's page size on a CPU when `inference.engine.page_size` is unset (`resolved_engine_config`)."""
DEVICE_MEMORY_GIB = {
    "H100": 79.18,
    "H200": 139.8,
    "v4": 32.0,
    "v5litepod": 16.0,
    "v5p": 95.0,
    "v6e": 32.0,
}
"""One device's memory (GiB) as JAX's allocator would have it all, by GPU `accelerator_type` or TPU generation:
the H100's measured (`memory_stats()['bytes_limit']` 59.38 GiB at JAX's default fraction 0.75,
docs/device_checks/2026-11-26-h100.json), the H200's from nvidia-smi's 143,771 MiB less the share the H100
keeps from JAX; the TPU chips' HBM from Google's data sheets (v4 32, v5e 16, v5p 95,
v6e 32 GiB; the runtime keeps a little of it). A device not listed leaves the engine's cache at `max_seqs`
sequences, with a note."""
GPU_MEMORY_FRACTION = 0.75
"""JAX's default `XLA_PYTHON_CLIENT_MEM_FRACTION`: a GPU process's allocator limit is this share of the GPU
(`PlacementConfig.memory_fraction` sets another)."""
MAX_ENGINE_PAGES = 1 << 20
"""Levanter's cap on the pages it sizes from memory."""

def engine_sizing(job, *, page_size: Optional[int] = None, max_pages: Optional[int] = None):
    """The Levanter `InferenceEngineConfig` a rollout worker builds: `inference.engine` resolved with an
    accelerator's page size (`page_size`) and `max_pages` pages (default: `inference.engine.max_pages`, else
    `max_seqs` full-length sequences; `engine_pages` sizes them as the engine does on each device kind), its
    cache in `inference.engine.compute_dtype`, else the rollout dtype."""
    e = job.inference.engine
    page = page_size or e.page_size or ACCELERATOR_PAGE_SIZE
    pages = max_pages or e.max_pages or e.max_seqs * -(-e.max_seq_len // page)
    dtype = jnp.dtype(e.compute_dtype or job.rollout_dtype())
    return dataclasses.replace(resolved_engine_config(e), page_size=page, max_pages=pages, compute_dtype=dtype)


@dataclasses.dataclass(frozen=True)
class RolloutDevice:
    """What kind of device a rollout worker runs on, and how much memory its allocator may hand out."""

    kind: Literal["cpu", "gpu", "tpu"]
    name: Optional[str] = None
    """The `DEVICE_MEMORY_GIB` key (GPU `accelerator_type`, TPU generation); None where the placement names none."""
    memory_bytes: Optional[float] = None
    """The allocator's limit per device (`bytes_limit`); None where unknown."""


def rollout_device(job, cpu: bool = False) -> RolloutDevice:
    """The rollout placement's device (`cpu`: fake CPU devices whatever the placement says)."""
    kind, name, fraction = job.ray.rollout.device
    if cpu or kind == "cpu":
        return RolloutDevice("cpu")
    gib = DEVICE_MEMORY_GIB.get(name or "")
    if kind == "gpu":
        share = fraction if fraction is not None else GPU_MEMORY_FRACTION
        return RolloutDevice("gpu", name, None if gib is None else gib * share * GiB)
    return RolloutDevice("tpu", name, None if gib is None else gib * GiB)


def trainer_device_bytes(job, cpu: bool = False) -> Optional[float]:
    """The allocator's limit of one trainer device as the trainer placement names it, read as `rollout_device`
    reads the rollout's (`DEVICE_MEMORY_GIB`, a GPU's `memory_fraction`); None on a CPU (`cpu`: fake CPU
    devices) or where the placement names no known device."""
    kind, name, fraction = job.ray.trainer.device
    gib = DEVICE_MEMORY_GIB.get(name or "")
    if cpu or kind == "cpu" or gib is None:
        return None
    if kind == "gpu":
        return gib * (fraction if fraction is not None else GPU_MEMORY_FRACTION) * GiB
    return gib * GiB


def engine_pages(job, model, mapping: dict, mesh: dict, device: RolloutDevice) -> tuple[int, int, str]:
    """(pages, page size, how) of the engine's KV cache on `device`, as the engine sizes it (module doc).
    On an accelerator with `max_pages: null`: the most pages whose cache (per device, `model.initial_cache`
    as Levanter measures it) fits `hbm_utilization` × (the device's limit − the served weights)."""
    from levanter.inference.page_table import PageTable

    e = job.inference.engine
    page = e.page_size or (CPU_PAGE_SIZE if device.kind == "cpu" else ACCELERATOR_PAGE_SIZE)
    per_seq = -(-e.max_seq_len // page)
    if e.max_pages is not None:
        return e.max_pages, page, f"inference.engine.max_pages = {e.max_pages} pages of {page} tokens"
    if device.kind == "cpu":
        return e.max_seqs * per_seq, page, (f"CPU: max_seqs {e.max_seqs} x {per_seq} pages of {page} tokens "
                                            "(resolved_engine_config)")
    if device.memory_bytes is None:
        field = "accelerator_type" if device.kind == "gpu" else "tpu or accelerator_type"
        return e.max_seqs * per_seq, page, (
            f"{device.kind.upper()} of unknown memory (ray.rollout.{field} names no device of DEVICE_MEMORY_GIB): "
            f"counted max_seqs {e.max_seqs} x {per_seq} pages of {page} tokens, where the engine fills "
            f"{e.hbm_utilization:.0%} of the free memory (set inference.engine.max_pages to fix it)")
    dtype = jnp.dtype(e.compute_dtype or job.rollout_dtype())

    def cache_bytes(pages: int) -> float:
        def build():
            return model.initial_cache(PageTable.init(pages, e.max_seqs, page, per_seq).spec(), dtype=dtype)

        with hax.axis_mapping(mapping):
            return shard_bytes(eqx.filter_eval_shape(build), mapping, mesh)

    weights = shard_bytes(model, mapping, mesh)
    budget = int(max(device.memory_bytes - weights, 0) * e.hbm_utilization)
    one, two = cache_bytes(1), cache_bytes(2)
    per_page, base = two - one, 2 * one - two
    if one > budget:
        raise ValueError(f"inference.engine.hbm_utilization: {e.hbm_utilization} of the {device.name} device's free "
                         f"memory ({budget / GiB:.2f} GiB after the weights) holds no KV page of {one / GiB:.3f} GiB: "
                         "the engine would refuse to start")
    pages = min(int((budget - base) // per_page), MAX_ENGINE_PAGES)
    return pages, page, (f"{device.kind.upper()} {device.name}: {pages} pages of {page} tokens fill "
                         f"{e.hbm_utilization:.0%} of {(device.memory_bytes - weights) / GiB:.2f} GiB free after the "
                         f"weights ({device.memory_bytes / GiB:.2f} GiB limit)")


def abstract_engine_state(model, engine_config):
    """The engine's `GenState` (paged KV cache and decode state) as ShapeDtypeStructs, as
    `InferenceEngine.from_model_with_config` builds it."""
    from levanter.inference.engine import GenState
    from levanter.inference.jit_scheduler import DecodeState
    from levanter.inference.page_table import PageTable

    c = engine_config

    def build():
        table = PageTable.init(c.max_pages, c.max_seqs, c.page_size, c.max_pages_per_seq)
        cache = model.initial_cache(table.spec(), dtype=c.compute_dtype)
        state = DecodeState.init(table, max_stop_seqs=c.max_stop_seqs, max_stop_tokens=c.max_stop_tokens,
                                 max_queued_tokens=c.max_queued_tokens, enable_logprobs=c.enable_logprobs)
        return GenState(cache=cache, decode_state=state)

    return eqx.filter_eval_shape(build)
