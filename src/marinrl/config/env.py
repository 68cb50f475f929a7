"""`env:` of a lesson: which environment it runs (a registered name or a class path) and its constructor's
arguments. A config only: marinrl/envs/base.py resolves and builds it (`make_env`), so a job config parses
without importing any environment (docs/environments.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from marinrl.config.checks import require_above, require_at_least


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Which environment a lesson runs, as configuration (draccus/YAML friendly)."""

    name: str
    """A registered short name (`echo`, `parity`, `arithmetic`, `math`) or a dotted class path
    (`my_package.envs.MyEnv` or `my_package.envs:MyEnv`)."""
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""


@dataclasses.dataclass(frozen=True)
class VerifiersEnvConfig:
    """`env: {name: verifiers, args: ...}`: a verifiers 0.4 environment, run by an EnvServer out of process
    (marinrl/envs/verifiers_env.py; docs/environments.md, "verifiers")."""

    env_id: str
    """The verifiers environment's id: its taskset package as verifiers names it (`vf_letter`, `gsm8k-v1`),
    installed in the virtualenv of `python`."""
    env_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The rest of verifiers' `EnvConfig`, as its TOML/CLI would give it: `taskset: {...}` (the taskset's own
    fields), `agent: {harness: ..., runtime: {type: subprocess}, max_turns: ...}`, `id` (an env to pair)."""
    eval_env_args: Optional[dict[str, Any]] = None
    """Merged over `env_args` (dicts key by key) to load the eval split's tasks, e.g. `{taskset: {split: test}}`;
    None: evaluations draw from the training tasks."""
    python: Optional[str] = None
    """The interpreter of a virtualenv with verifiers and the environment installed (`.venv-verifiers/bin/python`).
    It loads the taskset, and each rollout host starts its own EnvServer with it unless `server_address` is set."""
    server_address: Optional[str] = None
    """A running EnvServer (`tcp://host:port`, verifiers 0.4) that runs the episodes instead of one per host. Tasks
    still load from `python`'s virtualenv; that server must read our endpoint's API key from `api_key_var`."""
    max_tasks: int = 100_000
    """Tasks read from the taskset (the first ones of its `load()`; an infinite taskset needs this bound)."""
    max_concurrency: int = 32
    """Episodes in flight on the EnvServer at once."""
    episode_timeout: float = 600.0
    """Seconds one episode may take; it is cancelled and counted in `episodes_timed_out` after that."""
    max_retries: int = 2
    """Times an episode is run again after the EnvServer died under it (the server is restarted first)."""
    start_timeout: float = 300.0
    """Seconds the EnvServer and the task loader may take to start (importing verifiers alone takes seconds)."""
    api_key_var: str = "MARINRL_API_KEY"
    """The environment variable the EnvServer reads our endpoint's API key from (set in the server it starts)."""
    renderer: Optional[dict[str, Any]] = None
    """A `renderers.RendererConfig` for verifiers' train client (`{name: qwen3}`); None: resolved from the
    tokenizer (the default renderer, no tool-call parsing, for a model its map does not know)."""
    renderer_model: Optional[str] = None
    """The tokenizer the renderer loads (a local HF tokenizer directory or name); None: the policy's own tokenizer,
    saved to a temporary directory, so the tokens the EnvServer renders are the tokens we train."""
    model_name: str = "marinrl-policy"
    """The `model` of each RunRequest (the endpoint serves its policy under any name)."""
    policy: str = "policy"
    """The policy the episodes train (docs/policies.md)."""

    def __post_init__(self):
        if not isinstance(self.env_id, str) or not self.env_id:
            raise ValueError(f"verifiers: env_id must be a verifiers environment id, got {self.env_id!r}")
        if self.python is None and self.server_address is None:
            raise ValueError("verifiers: give python (a virtualenv's interpreter with verifiers installed) "
                             "or server_address (a running EnvServer) and python")
        if self.python is None:
            raise ValueError(f"verifiers: server_address {self.server_address} runs episodes, but the tasks load "
                             "from the taskset: give python too (a virtualenv with verifiers and the environment)")
        if self.server_address is not None and not self.server_address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"verifiers: server_address must be tcp://host:port or ipc://path, "
                             f"got {self.server_address!r}")
        for name in ("env_args", "eval_env_args", "renderer"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"verifiers: {name} must be a mapping, got {type(value).__name__}")
        if "taskset" in self.env_args and not isinstance(self.env_args["taskset"], dict):
            raise ValueError("verifiers: env_args.taskset must be a mapping (the taskset's fields)")
        require_at_least(self, 1, "max_tasks", "max_concurrency")
        require_at_least(self, 0, "max_retries")
        require_above(self, 0, "episode_timeout", "start_timeout")
