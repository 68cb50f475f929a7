"""The verifiers virtualenv in tests: its interpreter (`verifiers_interpreter`) and
one or more chat turns through verifiers 0.4's own `TrainClient` run in it (`run_verifiers_client`, which starts
tests/verifiers_train_client.py there). A test that needs the virtualenv fails without it, never skips: it is
what checks our endpoints against the real client."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

CLIENT_SCRIPT = pathlib.Path(__file__).with_name("verifiers_train_client.py")
REPO = pathlib.Path(__file__).resolve().parent.parent


def verifiers_interpreter() -> str:
    """The interpreter of a virtualenv with verifiers 0.4.0: the one `MARINRL_VERIFIERS_PYTHON` names, else the
    repo's `.venv-verifiers`; the calling test fails without one. Test files take it through a session fixture
    named `verifiers_python`."""
    path = os.environ.get("MARINRL_VERIFIERS_PYTHON") or str(REPO / ".venv-verifiers" / "bin" / "python")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no verifiers virtualenv: {path} is not an executable; build it with `make verifiers-venv` (or "
                    "set MARINRL_VERIFIERS_PYTHON to the python of a virtualenv with verifiers 0.4.0 and "
                    "tests/verifiers_envs installed)", pytrace=False)
    return path


def run_verifiers_client(python: str, *, base_url: str, api_key: str, tokenizer_dir: str, turns: list,
                         model: str = "marinrl-policy") -> list[dict]:
    """Each turn (messages, sampling) through verifiers' `TrainClient` in `python`: one dict per turn, the
    tokens verifiers keeps for training or `{"error", "status_code"}`."""
    args = {"base_url": base_url, "api_key": api_key, "tokenizer": tokenizer_dir, "model": model, "turns": turns}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([python, str(CLIENT_SCRIPT), json.dumps(args)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
