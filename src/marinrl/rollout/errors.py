"""How a rollout worker gives up, importable without the worker's JAX (the job's driver catches it)."""

from __future__ import annotations


class EnvironmentFailedError(RuntimeError):
    """A lesson's environment failed `max_consecutive_env_failures` calls in a row. The message names
    the lesson, the environment and its last error; the job stops with it instead of restarting the
    worker, which would repeat the failure."""
