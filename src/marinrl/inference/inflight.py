"""In-flight weight updates for the scan sampler: newer weights are swapped in between chunks of decode
steps while sequences are still being generated (PipelineRL-style partial rollouts).

A generation advances `every_tokens` decode steps at a time. At each chunk boundary (and before the
prompts' prefill) `WeightSwaps.poll()` is asked for newer weights; when it returns some, the rows
that are still running continue with them. Their KV cache is kept as the old weights wrote it
(`kv="keep"`, the default: no extra compute, the new weights attend to old keys and values), or
rebuilt by the new weights from the prompt and the tokens so far (`kv="recompute"`: one prefill of
the whole sequence, after which every logprob is exactly the new weights' forward pass). Either way
each token's logprob is that of the distribution it was actually sampled from, which is what the
loss's importance correction needs, and each token records the weight step that sampled it.

Every row steps in lockstep, so the weights of token t are the same for all rows of a device call:
the call's steps are one array over t (`weight_steps_by_token`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from marinrl.config.inflight import INFLIGHT_KV, InflightKV
from marinrl.inference import sampler as scan_sampler
from marinrl.inference.decoder import DenseAttention, cache_layout, forward, pack_layer
from marinrl.inference.scan_plan import decode_blocks


@dataclasses.dataclass
class WeightSwaps:
    """Where a generate call gets newer weights from while it runs, and what it used.

    `poll()` returns `(model, weight_step)` of weights newer than the ones in use, or None; the model
    must have the served model's structure (the server places it before returning it). `model` and
    `step` are the weights in use now: a call starts with them and leaves the newest it swapped to."""

    poll: Callable[[], Optional[tuple[Any, int]]]
    model: Any
    step: int
    every_tokens: int = 16
    kv: InflightKV = "keep"
    swaps: int = 0
    """How many swaps happened (for metrics)."""

    def __post_init__(self):
        if self.every_tokens < 1:
            raise ValueError(f"every_tokens must be >= 1, got {self.every_tokens}")
        if self.kv not in INFLIGHT_KV:
            raise ValueError(f"kv must be one of {INFLIGHT_KV}, got {self.kv!r}")

    def generate(self, *args, **kwargs):
        """`generate(self, ...)`: what the sampler calls for a batch with in-flight swaps (this module builds
        on the sampler, so the sampler reaches it through the object it is given, not by importing it)."""
        return generate(self, *args, **kwargs)

    def check(self) -> bool:
        """Takes newer weights if `poll()` has some; True if it did. A lower step is a restarted trainer
        (resumed from an older checkpoint): the server serves its weights from the next call on, this call
        finishes with the weights it has (as after `reload`), and the rollout worker drops its batch, made
        for the trainer before the restart (issue 33: this raised, and the batch counted as an environment
        failure)."""
        update = self.poll()
        if update is None:
            return False
        model, step = update
        if step <= self.step:
            return False
        self.model, self.step = model, int(step)
        self.swaps += 1
        return True


@functools.partial(jax.jit, static_argnames=("n", "max_new", "mesh", "lm_head_float32", "greedy"))
def _start(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index, *, n, max_new,
           mesh, lm_head_float32, greedy):
    return scan_sampler._start(model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds,
                               key_index, n=n, max_new=max_new, mesh=mesh, lm_head_float32=lm_head_float32,
                               greedy=greedy)


@functools.partial(jax.jit, static_argnames=("mesh", "lm_head_float32", "greedy", "attention"),
                   donate_argnames=("state",))
def _decode(model, state, stops, stop_valid, budget, temperature, t_stop, *, mesh, lm_head_float32, greedy, attention):
    return scan_sampler._decode_until(model, state, stops, stop_valid, budget, temperature, t_stop, mesh=mesh,
                                      lm_head_float32=lm_head_float32, greedy=greedy, attention=attention)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def _recompute(model, state, stops, *, mesh):
    """The decode state with every row's KV cache rebuilt by `model` from its prompt and the tokens
    sampled so far (slots past them get filler that decoding overwrites before it attends to them): one
    dense pass over each row's whole sequence, then its prompt part kept once per prompt (a prompt's rows
    hold the same prompt) and its generated part per row in blocks, as `sampler._start` lays them out."""
    stop_len = stops.shape[1]
    generated = state["out_tokens"][:, stop_len - 1:]
    ids = jnp.concatenate([state["row_ids"], jnp.maximum(generated, 0)], axis=1)  # filler -> token 0
    rows, s_len = ids.shape
    p_len = state["row_ids"].shape[1]
    n = rows // state["prompt_caches"][0][0].shape[0]
    pad = state["pad"]
    slots = jnp.arange(s_len)
    pos = jnp.maximum(slots[None, :] - pad[:, None], 0)
    key_ok = (slots[None, None, :] >= pad[:, None, None]) & (slots[None, None, :] <= slots[None, :, None])
    key_ok = key_ok | (slots[None, None, :] == slots[None, :, None])
    layers = model.transformer.layers.unstacked()
    packed = [pack_layer(layer, mesh) for layer in layers]
    lm_head = model.get_lm_head().rearrange(("embed", "vocab")).array
    kg = state["caches"][0][0]
    empty = jnp.zeros((rows, kg.shape[1], s_len, kg.shape[3]), kg.dtype)  # shaped as a generated block
    caches = cache_layout([(empty, empty) for _ in layers], mesh)
    _, caches = forward(model, layers, packed, lm_head, ids, pos, caches,
                        DenseAttention(jnp.asarray(0, jnp.int32), key_ok))
    prompt_caches = cache_layout([(k[::n, :, :p_len], v[::n, :, :p_len]) for k, v in caches], mesh)
    blocks = decode_blocks(s_len - p_len)
    generated = [tuple(x[:, :, p_len + a:p_len + a + size] for a, size in blocks for x in (k, v)) for k, v in caches]
    return dict(state, prompt_caches=prompt_caches, caches=cache_layout(generated, mesh))


_outputs = jax.jit(scan_sampler._outputs)


def generate(swaps: WeightSwaps, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index,
             *, n: int, max_new: int, mesh, lm_head_float32: bool = False, greedy: bool = False,
             attention: str = "xla"):
    """One device call of the scan sampler in chunks of `swaps.every_tokens` steps, swapping weights
    between chunks. Returns what `sampler._generate` returns, plus int64 [max_new]: the weight step of
    the weights that sampled token t (the same for every row)."""
    swaps.check()  # before the prefill: a call (a turn of a multi-turn episode) starts with the newest weights
    steps_by_token = np.full((max_new,), swaps.step, dtype=np.int64)
    state = _start(swaps.model, ids, lens, active, stops, stop_valid, budget, temperature, key_seeds, key_index,
                   n=n, max_new=max_new, mesh=mesh, lm_head_float32=lm_head_float32, greedy=greedy)
    t = 1  # the prefill sampled token 0
    while t < max_new:
        if t % swaps.every_tokens == 0 and swaps.check():  # chunks end at multiples of every_tokens
            steps_by_token[t:] = swaps.step
            if swaps.kv == "recompute":
                state = _recompute(swaps.model, state, stops, mesh=mesh)
        t_stop = (t // swaps.every_tokens + 1) * swaps.every_tokens
        state = _decode(swaps.model, state, stops, stop_valid, budget, temperature, jnp.asarray(t_stop, jnp.int32),
                        mesh=mesh, lm_head_float32=lm_head_float32, greedy=greedy, attention=attention)
        t, finished = jax.device_get((state["t"], jnp.all(state["done"])))
        t = int(t)
        if finished:
            break
    return (*_outputs(state, stops), steps_by_token)
