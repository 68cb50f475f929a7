"""Lets bench/device_check.py run on a device image whose JAX is newer than our pin (constraints.txt).

Haliax 1.4.dev453 calls `jax.core.is_constant_dim`, which JAX 0.11 removed; the GPU image the check runs on
has JAX 0.11. On such a JAX this module (imported by every Python process whose path holds this folder, Ray's
workers included) puts back the function's meaning: a dimension is constant when it is an integer. On our
pinned JAX it does nothing and imports nothing. `MARINRL_JAX_SHIM` tells the check's JSON that it ran.
"""

import importlib.metadata
import os

try:
    _major_minor = tuple(int(x) for x in importlib.metadata.version("jax").split(".")[:2])
except (importlib.metadata.PackageNotFoundError, ValueError):
    _major_minor = (0, 0)

if _major_minor >= (0, 11):
    import operator

    import jax.core

    if not hasattr(jax.core, "is_constant_dim"):
        def is_constant_dim(d) -> bool:
            try:
                operator.index(d)
                return True
            except TypeError:
                return False

        jax.core.is_constant_dim = is_constant_dim
        os.environ["MARINRL_JAX_SHIM"] = "1"
