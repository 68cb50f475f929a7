"""`trainer_group:` of a job config: how the processes of a trainer over several hosts are placed and joined
(job/trainer_group.py, docs/multihost.md)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from marinrl.config.errors import ConfigError

STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
"""Ray's placement-group strategies."""


@dataclasses.dataclass(frozen=True)
class TrainerGroupConfig:
    """How the processes of a trainer that spans several hosts (`ray.trainer.num_hosts` > 1, or a
    multi-host `ray.trainer.tpu` slice) are placed and joined."""

    strategy: Optional[str] = None
    """Ray placement-group strategy for the hosts' bundles. None: STRICT_SPREAD (each process on its own
    node) on a cluster (`ray.address` set), PACK on the job's local Ray (one machine: tests, a laptop)."""
    cpu_devices: int = 0
    """CPU only (tests): fake JAX CPU devices each process contributes, with gloo collectives; 0: the
    host's real devices."""
    heartbeat_timeout_s: int = 100
    """JAX's heartbeat: a process silent this long (hung, its host unreachable) ends the group."""
    initialization_timeout_s: int = 300
    """How long the processes wait for each other in `jax.distributed.initialize`."""
    death_grace_s: float = 30.0
    """When one process dies: how long the others get to notice (multihost's peer watch: well under a
    second) and end with their message naming the checkpoint, before they are killed."""

    def errors(self, field: str) -> None:
        """Raises ConfigError naming the first bad field under `field` (e.g. `trainer_group`)."""
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ConfigError(f"{field}.strategy", f"must be one of {list(STRATEGIES)} or null, got {self.strategy!r}")
        if self.cpu_devices < 0:
            raise ConfigError(f"{field}.cpu_devices", f"must be >= 0, got {self.cpu_devices}")
        for name in ("heartbeat_timeout_s", "initialization_timeout_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{field}.{name}", f"must be >= 1, got {getattr(self, name)}")
        if not self.death_grace_s >= 0:
            raise ConfigError(f"{field}.death_grace_s", f"must be >= 0, got {self.death_grace_s}")

    def resolved_strategy(self, on_cluster: bool) -> str:
        return self.strategy or ("STRICT_SPREAD" if on_cluster else "PACK")
