"""A weight transfer config's two ends: the trainer's server and a rollout worker's client. The configs
(config/transfer.py) stay free of JAX and Ray, so a job config parses in a second; the ends are
built here, where importing them costs nothing extra (docs/architecture.md, "Layers").

To add a weight transport: register its config under a `type:` name in config/transfer.py
(`WeightTransferConfig.register_subclass`; its `route` is that name unless the config picks among rows,
as a relayed filesystem root does, and its `for_policy` gives one policy model's stream), implement
`WeightTransferServer` and `WeightTransferClient` (transfer/base.py: versions, epochs, restarts) in a module
of this package, and add its row to `TRANSPORTS`; tests/test_transfer.py runs every row through the same
checks."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Mapping

from marinrl.config.transfer import WeightTransferConfig
from marinrl.transfer.base import WeightTransferClient, WeightTransferServer


@dataclasses.dataclass(frozen=True)
class Transport:
    """One way weights travel: the trainer's server and a rollout worker's client, each `module:Class`
    (the module is imported when one is built)."""

    server: str
    client: str


TRANSPORTS: Mapping[str, Transport] = {
    "filesystem": Transport("marinrl.transfer.checkpoint:FilesystemWeightServer",
                            "marinrl.transfer.checkpoint:FilesystemWeightClient"),
    "filesystem/relay": Transport("marinrl.transfer.checkpoint:FilesystemWeightServer",
                                  "marinrl.transfer.relay:RelayWeightClient"),
    "ray": Transport("marinrl.transfer.ray:RayWeightServer", "marinrl.transfer.ray:RayWeightClient"),
}
"""A config's `route` -> its transport: the one place a transport's ends are chosen."""


def _end(config: WeightTransferConfig, side: str):
    row = TRANSPORTS.get(getattr(config, "route", None))
    if row is None:
        raise TypeError(f"no weight transfer {side} for {type(config).__name__}: register it in "
                        "marinrl.transfer.endpoints.TRANSPORTS")
    module, name = getattr(row, side).split(":")
    return getattr(importlib.import_module(module), name)


def build_server(config: WeightTransferConfig) -> WeightTransferServer:
    """The trainer's side of `config`."""
    return _end(config, "server")(config)


def build_client(config: WeightTransferConfig, skeleton) -> WeightTransferClient:
    """The rollout side of `config`; `skeleton` is a model of the right structure and placement (e.g. the
    current model) or a ModelSkeleton of one."""
    return _end(config, "client")(config, skeleton)
