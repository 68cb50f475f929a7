"""What a process's programs and memory hold: the audit a real-size run is checked by.

- `constant_bytes(fn, *args)`: the bytes of every constant baked into the traced program of `fn` (nested
  jits, scans and conditionals included). A weight that reaches a jitted function by closure instead of
  as an argument becomes such a constant: compiled into the executable, once per program, on every host.
  Weights must always be arguments, so a train step or sampler program holds at most a few scalars and
  small tables (rotary frequencies, masks): tests bound it at 1% of the parameters' bytes.
- `process_stats()`: this process's peak RSS, its RSS before its model was built (the baseline the dry
  run's prediction leaves out), how often it read a Hugging Face checkpoint and how many of its bytes.

The job's actors report these in their results (`process`), where `bench/rehearsal.py` reads them.
Measuring the programs costs one extra trace of each, so actors do it only when the environment variable
`MARINRL_AUDIT_PROGRAMS=1` is set (docs/performance.md, "Rehearsal").
"""

from __future__ import annotations

import os
import resource
from typing import Any, Optional

AUDIT_ENV = "MARINRL_AUDIT_PROGRAMS"


def auditing() -> bool:
    """Whether this process measures its programs' constants (`MARINRL_AUDIT_PROGRAMS=1`)."""
    return os.environ.get(AUDIT_ENV, "") not in ("", "0")


def constant_bytes(fn, *args, **kwargs) -> int:
    """Bytes of the constants in the program `fn(*args, **kwargs)` traces to (arrays in `args` are inputs;
    non-array leaves are static, as `equinox.filter_jit` treats them). Nothing runs."""
    import equinox as eqx

    closed, _, _ = eqx.filter_make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    return jaxpr_constant_bytes(closed)


def jaxpr_constant_bytes(closed) -> int:
    """Bytes of the constants of a closed jaxpr and of every jaxpr nested in its equations' parameters,
    each constant counted once."""
    seen: set[int] = set()
    total = 0

    def visit(node: Any) -> None:
        nonlocal total
        consts = getattr(node, "consts", None)
        inner = getattr(node, "jaxpr", None)
        if consts is not None and inner is not None:  # a closed jaxpr
            for c in consts:
                if id(c) not in seen:
                    seen.add(id(c))
                    total += int(getattr(c, "nbytes", 0) or 0)
            visit(inner)
            return
        eqns = getattr(node, "eqns", None)
        if eqns is None:
            return
        for eqn in eqns:
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(item, "eqns") or (hasattr(item, "consts") and hasattr(item, "jaxpr")):
                        visit(item)

    visit(closed)
    return total


def sampler_constant_bytes(model, mesh=None, *, prompt_tokens: int = 16, max_new: int = 16) -> int:
    """Bytes of the constants in the scan sampler's program for `model` (one prompt row at a small bucket;
    the weights are its arguments, so its constants do not grow with the model)."""
    import functools

    import jax.numpy as jnp

    from marinrl.inference import sampler

    rows = 1
    args = (jnp.zeros((rows, prompt_tokens), jnp.int32), jnp.ones((rows,), jnp.int32), jnp.ones((rows,), bool),
            jnp.full((1, 1), sampler.STOP_PAD, jnp.int32), jnp.zeros((1,), bool), jnp.asarray(max_new, jnp.int32),
            jnp.asarray(1.0, jnp.float32), jnp.zeros((rows,), jnp.uint32), jnp.zeros((rows,), jnp.int32))
    program = functools.partial(sampler._generate, n=1, max_new=max_new, mesh=mesh)
    return constant_bytes(program, model, *args)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def process_stats(rss_before_model_bytes: Optional[int], jit_constant_bytes: Optional[int]) -> dict:
    """What an actor reports about its process (`bench/rehearsal.py` reads it from the job's result)."""
    from marinrl.models.hf_checkpoints import hf_read_bytes, hf_reads

    return {"peak_rss_bytes": peak_rss_bytes(), "rss_before_model_bytes": rss_before_model_bytes,
            "hf_reads": hf_reads(), "hf_read_bytes": hf_read_bytes(), "jit_constant_bytes": jit_constant_bytes}
