"""How weights travel from the trainer to the rollout workers: the `weights:` block of a job (YAML picks one
with `type:`). Configs only: `transfer/endpoints.py` builds a config's server and client
(docs/weight_transfer.md)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import draccus

from marinrl.config.errors import ConfigError

FULL_EVERY_DEFAULT = 10
"""Versions between full snapshots of delta sync."""
FORMATS = ("auto", "packed", "tensorstore")
_TENSORSTORE_PROTOCOLS = {"file", "local", "gs", "gcs"}


def _protocol(url: str) -> str:
    """fsspec's protocol of `url` (`gs://b/x` → `gs`; a bare path → `file`)."""
    return url.split("://", 1)[0] if "://" in url else "file"


def check_delta_config(owner: str, delta: bool, full_every: int) -> None:
    """The delta fields' validation, shared by the transfer configs; errors name the field."""
    if not isinstance(delta, bool):
        raise ValueError(f"{owner}.delta must be true or false, got {delta!r}")
    if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
        raise ValueError(f"{owner}.full_every must be an integer >= 1, got {full_every!r}")


@dataclasses.dataclass(frozen=True)
class WeightTransferConfig(draccus.ChoiceRegistry):
    """How weights travel from the trainer to the rollout workers; YAML picks one with `type:`."""

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "filesystem"

    @property
    def route(self) -> str:
        """Its row of `transfer/endpoints.TRANSPORTS` (the server and client built for it): its `type:` name."""
        return WeightTransferConfig.get_choice_name(type(self))

    def for_policy(self, policy: str) -> WeightTransferConfig:
        """This transport for one policy model's own weight stream (a job of several models, docs/policies.md)."""
        raise ConfigError("weights", f"{type(self).__name__} cannot be split into one weight stream per policy "
                                     "model; use {type: filesystem} or {type: ray}")


FANOUTS = ("auto", "storage", "relay")
RELAY_FROM_HOSTS = 193
"""`fanout: auto` relays weights from this many rollout hosts on: the fleet planner's crossover
(`marinrl.dry_run.fleet.relay_crossover` under its stated pod assumptions, a test holds the two equal;
docs/scaling.md, "Which fan-out by default")."""


@WeightTransferConfig.register_subclass("filesystem")
@dataclasses.dataclass(frozen=True)
class FilesystemTransferConfig(WeightTransferConfig):
    root: str
    """Where versions go: gs://bucket/prefix, file:///path (or a bare path) or memory://name."""
    keep_last: int = 2
    """Versions the server keeps after each commit (the newest and the ones before it, for slow readers)."""
    format: str = "auto"
    """packed: one object, NumPy views (fastest for models one host can hold); tensorstore: a Levanter
    checkpoint, each host writing its own shards (needed for models sharded over several hosts;
    gs:// or local only); auto: packed unless the model is not fully addressable from one process."""
    storage_options: dict = dataclasses.field(default_factory=dict)
    """fsspec options (e.g. {"token": "anon"}). tensorstore takes its credentials from the environment."""
    delta: bool = False
    """Publish each version as the elements that changed since the previous one, with a full snapshot
    every `full_every` versions (packed format only; checked per array by CRC-32 on the client). Pays
    off for bf16 weights at small learning rates; fp32 weights change almost everywhere every step, so
    off by default (docs/weight_transfer.md, docs/performance.md)."""
    full_every: int = FULL_EVERY_DEFAULT
    """With `delta`: every how many versions a full snapshot is written (a client that is further
    behind, or new, loads the snapshot and the deltas after it)."""
    fanout: str = "auto"
    """How rollout hosts get a version: `storage`, each host reads the pointer and the version from
    storage; `relay`, one Ray actor per root reads each packed version once and the hosts fetch it
    from Ray's object store (transfer/relay.py); `auto`, the job picks `relay` from `RELAY_FROM_HOSTS`
    rollout hosts on, else `storage` (docs/scaling.md, "Which fan-out by default")."""

    def __post_init__(self):
        if self.fanout not in FANOUTS:
            raise ValueError(f"FilesystemTransferConfig.fanout must be one of {FANOUTS}, got {self.fanout!r}")
        if not self.root:
            raise ValueError("FilesystemTransferConfig.root must be set")
        if self.keep_last < 1:
            raise ValueError(f"FilesystemTransferConfig.keep_last must be >= 1, got {self.keep_last}")
        if self.format not in FORMATS:
            raise ValueError(f"FilesystemTransferConfig.format must be one of {FORMATS}, got {self.format!r}")
        if self.format == "tensorstore" and _protocol(self.root) not in _TENSORSTORE_PROTOCOLS:
            raise ValueError(f"format='tensorstore' needs a gs:// or local root, got {self.root!r}")
        check_delta_config("FilesystemTransferConfig", self.delta, self.full_every)
        if self.delta and self.format == "tensorstore":
            raise ValueError("FilesystemTransferConfig.delta needs format 'packed' or 'auto', not 'tensorstore'")

    @property
    def route(self) -> str:
        """`filesystem/relay` when relayed (its clients read through the relay), else `filesystem`."""
        return "filesystem/relay" if self.fanout == "relay" else "filesystem"

    def for_policy(self, policy: str) -> FilesystemTransferConfig:
        """The policy model's own folder under `root`."""
        return dataclasses.replace(self, root=f"{self.root.rstrip('/')}/{policy}")

    def for_fleet(self, rollout_hosts: int) -> FilesystemTransferConfig:
        """This config with `fanout: auto` decided for a fleet of `rollout_hosts` hosts."""
        if self.fanout != "auto":
            return self
        return dataclasses.replace(self, fanout="relay" if rollout_hosts >= RELAY_FROM_HOSTS else "storage")


@WeightTransferConfig.register_subclass("ray")
@dataclasses.dataclass(frozen=True)
class RayTransferConfig(WeightTransferConfig):
    name: str = "marinrl-weights"
    """Name of the coordinator actor: one per run (runs sharing a Ray cluster need distinct names)."""
    namespace: str | None = None
    """Ray namespace of the actor; None: the namespace of the process's Ray connection."""
    timeout_s: float = 60.0
    """Limit in seconds for one call to the coordinator and for one fetch of the weights."""
    delta: bool = False
    """Publish each version as the elements that changed since the previous one, with a full snapshot
    every `full_every` versions (checked per array by CRC-32 on the client). Pays off for bf16 weights
    at small learning rates; off by default (docs/weight_transfer.md, docs/performance.md)."""
    full_every: int = FULL_EVERY_DEFAULT
    """With `delta`: every how many versions a full snapshot is published; the actor holds the chain
    from it (a client that holds none of the chain, e.g. a new one, fetches all of it)."""

    def __post_init__(self):
        if not self.name:
            raise ValueError("RayTransferConfig.name must be set")
        if self.timeout_s <= 0:
            raise ValueError(f"RayTransferConfig.timeout_s must be > 0, got {self.timeout_s}")
        check_delta_config("RayTransferConfig", self.delta, self.full_every)

    @property
    def location(self) -> str:
        return f"ray actor {self.namespace + '/' if self.namespace else ''}{self.name}"

    def for_policy(self, policy: str) -> RayTransferConfig:
        """The policy model's own coordinator actor."""
        return dataclasses.replace(self, name=f"{self.name}-{policy}")


def stream_weights(weights: Optional[WeightTransferConfig], run_dir: str, rollout_hosts: int) -> WeightTransferConfig:
    """A weight stream as its trainer and rollout hosts use it: `weights` (None: files under `run_dir/weights`),
    with `fanout: auto` decided for a fleet of `rollout_hosts`."""
    weights = weights if weights is not None else FilesystemTransferConfig(root=f"{run_dir}/weights")
    return weights.for_fleet(rollout_hosts) if isinstance(weights, FilesystemTransferConfig) else weights
