"""The machine a benchmark ran on, printed with its numbers: `lscpu`'s model name, the CPU count, the
vector-extension flags (sessions get AVX2 or AVX-512 machines), the load average and JAX's version."""

from __future__ import annotations

import os
import subprocess


def machine() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:  # no lscpu (macOS): the rest still says something
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    import jax

    return {"cpu": fields.get("Model name", "?").strip(), "cpus": os.cpu_count(),
            "flags": " ".join(f for f in flags if f.startswith(("avx", "sse4", "fma", "sha", "vaes"))) or "?",
            "load_avg": round(os.getloadavg()[0], 2), "jax": jax.__version__}
