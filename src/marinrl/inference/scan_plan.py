"""How the scan sampler splits a rollout batch into device calls, from shapes alone: the shape buckets, the KV
cache a call holds, its budget on a device, and the decode phases that bound how much of the generated cache each
step reads. Pure Python (no JAX): the sampler (`sampler.py`), the dry run and `bench/generation.py --plan` compute
the same split from the same functions, so a plan and a run cannot disagree on `calls` and `rows_per_call`.

The cache of one call (`sampler.py`): each prompt's keys and values once, `n` rows' generated tokens apart.
Per prompt: 2 (keys, values) × layers × kv_heads × head_size × itemsize × (p_len + n × t_len).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

CPU_CACHE_BYTES = 1 << 30
"""`inference.scan_max_cache_bytes: auto` on a CPU (or any device whose allocator reports no limit): the budget
of one call's cache. The trainer and the rollout worker share the host's memory, so none of it is claimed."""
AUTO_CACHE_SHARE = 0.8
"""`auto` on an accelerator: the share of a device's memory left after the served weights that one call's cache
may take. The rest holds the call's working set (logits, the sampling CDF, the prefill's activations: a few
hundred MB at 256 rows of a 150k vocabulary) and the next weight version, built beside the served one."""
PHASE_MIN_TOKENS = 256
"""Responses of at most this many tokens (bucketed) decode in one phase: every step reads the whole generated
cache, which is small there. Longer ones decode in `MAX_PHASES` phases of growing windows."""
MAX_PHASES = 4
"""Phases of a long decode: phase k's steps read the first k + 1 of MAX_PHASES blocks of the generated cache, so
a decode reads about 5/8 of it on average instead of all of it; each phase is its own compiled loop body."""


def bucket(x: int, minimum: int = 1) -> int:
    """Shape bucket: the next power of two up to 64, then the next multiple of 64. Few distinct shapes
    means few compiles; the padding costs at most a factor 2 on tiny batches and 1.5% at large ones."""
    x = max(x, minimum)
    if x <= 64:
        return 1 << (x - 1).bit_length()
    return 64 * math.ceil(x / 64)


def floor_bucket(x: int) -> int:
    """The largest bucket size <= x (x >= 1)."""
    return 1 << (x.bit_length() - 1) if x < 64 else 64 * (x // 64)


def kv_bytes_per_prompt(*, layers: int, kv_heads: int, head_size: int, itemsize: int, p_len: int, t_len: int,
                        n: int) -> int:
    """KV cache bytes of one prompt and its `n` samples in a call (module doc): the prompt's slots once, each
    sample's generated slots apart."""
    return 2 * layers * kv_heads * head_size * itemsize * (p_len + n * t_len)


def cache_shards(rows: int, kv_heads: int, data: int, model: int) -> int:
    """Devices a call's cache is split over on a (data, model) mesh: rows over data where they divide evenly,
    KV heads over model where they divide evenly (`decoder.constrain` drops an axis that does not)."""
    return (data if rows % data == 0 else 1) * (model if kv_heads % model == 0 else 1)


def auto_cache_budget(bytes_limit: Optional[float], weights_bytes: float) -> int:
    """`auto`'s budget for one call's cache on one device: `AUTO_CACHE_SHARE` of the allocator's limit less
    the served weights (both per device); `CPU_CACHE_BYTES` where the device reports no limit."""
    if not bytes_limit:
        return CPU_CACHE_BYTES
    return max(1, int(AUTO_CACHE_SHARE * (bytes_limit - weights_bytes)))


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """How `prompts` prompts of `n` samples each go to the device."""

    prompts_per_call: int
    """Prompt rows of one call (a bucket size; the last call is padded to it)."""
    calls: int
    n: int
    per_device_cache_bytes: float
    """KV cache of one call on its most loaded device."""

    @property
    def rows_per_call(self) -> int:
        return self.prompts_per_call * self.n


def plan_calls(*, prompts: int, n: int, per_prompt_bytes: int, budget_bytes: float, kv_heads: int = 1,
               data: int = 1, model: int = 1, min_prompts: int = 1) -> CallPlan:
    """The widest call whose cache fits `budget_bytes` per device: all prompts (padded to a bucket, at least
    `min_prompts`) if they fit, else the largest bucket of prompts that does (at least one), repeated."""
    want = bucket(max(prompts, min_prompts))

    def per_device(c: int) -> float:
        return c * per_prompt_bytes / cache_shards(c * n, kv_heads, data, model)

    chunk = want
    while chunk > 1 and per_device(chunk) > budget_bytes:
        chunk = floor_bucket(chunk - 1)
    return CallPlan(chunk, math.ceil(max(prompts, 1) / chunk), n, per_device(chunk))


def decode_windows(t_len: int) -> tuple[int, ...]:
    """The generated-cache window of each decode phase (the last is `t_len`): a step at generated position t
    runs in the first phase whose window exceeds t and reads that many slots of each row's generated cache."""
    if t_len <= PHASE_MIN_TOKENS:
        return (t_len,)
    step = -(-t_len // MAX_PHASES)
    step = -(-step // 16) * 16  # whole blocks of 16 slots
    return tuple(min(t_len, step * (k + 1)) for k in range(-(-t_len // step)))


def decode_blocks(t_len: int) -> tuple[tuple[int, int], ...]:
    """(start, size) of each block of the generated cache: the slots between consecutive `decode_windows`. The
    sampler keeps each block as an array of its own, so a phase reads whole arrays
    (`decoder.GroupedDecodeAttention`)."""
    windows = decode_windows(t_len)
    starts = (0,) + windows[:-1]
    return tuple((a, b - a) for a, b in zip(starts, windows))


def generated_slots_read(t_len: int, steps: int) -> int:
    """Generated-cache slots one row reads over decode steps 1..steps-1 under `decode_windows`: step t writes slot
    t - 1 and reads every block up to the one that holds it."""
    windows = decode_windows(t_len)
    total = 0
    for t in range(1, steps):
        total += next(w for w in windows if t <= w)
    return total


def decode_bytes_per_step(*, weights_bytes: float, kv_bytes_per_token: int, prompts: int, n: int, p_len: int,
                          t_len: int, steps: int) -> float:
    """Bytes one decode step of a call reads on average over `steps` steps (the memory-bound cost of decode):
    every weight once, each prompt's `p_len` cached slots once for its `n` rows, and each row's generated slots
    of its phase's window (`decode_windows`)."""
    steps = max(2, min(steps, t_len))
    gen_slots = generated_slots_read(t_len, steps) / (steps - 1)
    return weights_bytes + kv_bytes_per_token * (prompts * p_len + prompts * n * gen_slots)
