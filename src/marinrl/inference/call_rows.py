"""The host side of one scan sampler call (`sampler.py`): the prompts as left-padded rows, each prompt's sampling
key and adapter slot, the stop sequences as a table. NumPy in, device arrays out; nothing traced."""

from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from marinrl.inference.scan_plan import bucket

STOP_PAD = -1
"""Left padding of a stop sequence: matches anything."""


def prompt_keys(prompt_keys, seed: int, n_prompts: int) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt's sampling key (seed, index) as two arrays: `prompt_keys`, or (seed, i) for prompt i."""
    if prompt_keys is None:
        prompt_keys = [(seed, i) for i in range(n_prompts)]
    if len(prompt_keys) != n_prompts:
        raise ValueError(f"prompt_keys has {len(prompt_keys)} entries for {n_prompts} prompts")
    return (np.array([k[0] % (1 << 32) for k in prompt_keys], dtype=np.uint32),
            np.array([k[1] for k in prompt_keys], dtype=np.int32))


def adapter_slots(adapters, adapter_index, swaps, n_prompts: int, n: int) -> Optional[np.ndarray]:
    """Each prompt's adapter slot (`prompt_slots`); None without adapters."""
    if (adapters is None) != (adapter_index is None):
        raise ValueError("adapters and adapter_index go together: the stack and each prompt's slot in it")
    if adapters is None:
        return None
    if swaps is not None:
        raise ValueError("in-flight weight swaps run the plain model: no adapters")
    return prompt_slots(adapter_index, n_prompts, n, adapters.slots)


def prompt_slots(adapter_index: Sequence[int], prompts: int, n: int, slots: int) -> np.ndarray:
    """The slot of each prompt (int32 [prompts], -1: the base alone) from `adapter_index`, one per prompt or one
    per row (row i * n + j: sample j of prompt i). A prompt's rows share its KV cache, computed once for its n
    rows, so per-row indices must agree within each prompt; ValueError otherwise, or for a slot out of range."""
    index = np.asarray(adapter_index, dtype=np.int64).reshape(-1)
    if index.size == prompts * n and n > 1:
        rows = index.reshape(prompts, n)
        if np.any(rows != rows[:, :1]):
            bad = int(np.argmax(np.any(rows != rows[:, :1], axis=1)))
            raise ValueError(f"adapter_index: the {n} rows of prompt {bad} name different slots "
                             f"{sorted(set(rows[bad].tolist()))}; a prompt's rows share one adapter")
        index = rows[:, 0]
    elif index.size != prompts:
        raise ValueError(f"adapter_index has {index.size} entries for {prompts} prompts of {n} rows each "
                         f"(one per prompt or one per row)")
    if index.size and (index.min() < -1 or index.max() >= slots):
        raise ValueError(f"adapter_index must be -1 (the base alone) or a slot 0..{slots - 1}, got "
                         f"{sorted(set(index[(index < -1) | (index >= slots)].tolist()))}")
    return index.astype(np.int32)


def padded_slots(slots, chunk: int):
    """A call's slot per prompt row, padded to `chunk` with -1 (padding rows run the base alone)."""
    return jnp.asarray(np.pad(slots, (0, chunk - len(slots)), constant_values=-1).astype(np.int32))


def stop_table(stop_sequences) -> tuple[np.ndarray, np.ndarray]:
    """Stop sequences as a left-padded table [bucket(k), bucket(longest)] (`STOP_PAD` matches anything) and which
    of its rows are real."""
    s_max = max((len(s) for s in stop_sequences), default=1)
    stops = np.full((bucket(max(len(stop_sequences), 1)), bucket(s_max)), STOP_PAD, dtype=np.int32)
    stop_valid = np.zeros((stops.shape[0],), dtype=bool)
    for k, s in enumerate(stop_sequences):
        stops[k, stops.shape[1] - len(s):] = np.asarray(s, dtype=np.int32)
        stop_valid[k] = True
    return stops, stop_valid


def prompt_rows(part, chunk: int, p_len: int, lens, key_seeds, key_index, dry_run: bool):
    """One device call's prompt rows, padded to `chunk`: left-padded ids [chunk, p_len], lengths (1 for padding
    rows), which rows generate, and each row's key (seed, index)."""
    k = len(part)
    ids = np.zeros((chunk, p_len), dtype=np.int32)
    for i, p in enumerate(part):
        ids[i, p_len - len(p):] = np.asarray(p, dtype=np.int32)
    part_lens = np.ones((chunk,), dtype=np.int32)
    part_lens[:k] = lens[:k]
    active = np.arange(chunk) < (0 if dry_run else k)
    seeds = np.zeros((chunk,), dtype=np.uint32)
    seeds[:k] = key_seeds[:k]
    index = np.zeros((chunk,), dtype=np.int32)
    index[:k] = key_index[:k]
    return tuple(jnp.asarray(x) for x in (ids, part_lens, active, seeds, index))
