"""What the actors import at startup: no torch where nothing needs it (docs/performance.md, "Memory")."""

from __future__ import annotations

import os
import subprocess
import sys

from marinrl.job import _actor_env

_CHILD = """
import sys, tempfile
import marinrl.job  # what an actor imports first: Levanter, transformers
from marinrl.startup import import_tensorboardx_without_torch
import_tensorboardx_without_torch()
from levanter.tracker.tensorboard import TensorboardConfig
tracker = TensorboardConfig(logdir=tempfile.mkdtemp()).init("run")
tracker.log({"loss": 1.0}, step=0)
tracker.finish()
print("torch loaded:", "torch" in sys.modules)
import torch  # still importable for whoever needs it (Levanter's pytorch_model.bin reader)
print("torch importable:", hasattr(torch, "tensor"))
"""


def test_actors_run_with_use_torch_0_unless_the_driver_sets_it(monkeypatch):
    monkeypatch.delenv("USE_TORCH", raising=False)
    assert _actor_env()["USE_TORCH"] == "0"
    monkeypatch.setenv("USE_TORCH", "1")
    assert _actor_env()["USE_TORCH"] == "1"


def test_an_actor_logs_to_tensorboard_without_importing_torch():
    env = {**os.environ, "USE_TORCH": "0", "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch loaded: False" in out.stdout and "torch importable: True" in out.stdout, out.stdout
