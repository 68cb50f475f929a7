"""`env:` of a lesson: which environment it runs (a registered name or a class path) and its constructor's
arguments. A config only: marinrl/envs/base.py resolves and builds it (`make_env`), so a job config parses
without importing any environment (docs/environments.md)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Which environment a lesson runs, as configuration (draccus/YAML friendly)."""

    name: str
    """A registered short name (`echo`, `parity`, `arithmetic`, `math`) or a dotted class path
    (`my_package.envs.MyEnv` or `my_package.envs:MyEnv`)."""
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
