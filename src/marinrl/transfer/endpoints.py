"""A weight transfer config's two ends: the trainer's server and a rollout worker's client. The configs
(config/transfer.py) stay free of JAX and Ray, so a job config parses in a second; the ends are
built here, where importing them costs nothing extra (docs/architecture.md, "Layers").

To add a weight transport: register its config under a `type:` name in config/transfer.py
(`WeightTransferConfig.register_subclass`), implement `WeightTransferServer` and `WeightTransferClient`
(transfer/base.py: versions, epochs, restarts) in a module of this package, and add one row to `TRANSPORTS`
naming the module and the two classes; tests/test_transfer.py runs every row through the same checks."""

from __future__ import annotations

import importlib

from marinrl.config.transfer import FilesystemTransferConfig, RayTransferConfig, WeightTransferConfig
from marinrl.transfer.base import WeightTransferClient, WeightTransferServer

TRANSPORTS: dict[type, tuple[str, str, str]] = {
    FilesystemTransferConfig: ("marinrl.transfer.checkpoint", "FilesystemWeightServer", "FilesystemWeightClient"),
    RayTransferConfig: ("marinrl.transfer.ray", "RayWeightServer", "RayWeightClient"),
}
"""Config class → (module, server class, client class); the module is imported when a transport is built."""


def _transport(config: WeightTransferConfig, end: int):
    row = TRANSPORTS.get(type(config))
    if row is None:
        side = "server" if end == 1 else "client"
        raise TypeError(f"no weight transfer {side} for {type(config).__name__}: register it in "
                        "marinrl.transfer.endpoints.TRANSPORTS")
    return getattr(importlib.import_module(row[0]), row[end])


def build_server(config: WeightTransferConfig) -> WeightTransferServer:
    """The trainer's side of `config`."""
    return _transport(config, 1)(config)


def build_client(config: WeightTransferConfig, skeleton) -> WeightTransferClient:
    """The rollout side of `config`; `skeleton` is a model of the right structure and placement (e.g. the
    current model) or a ModelSkeleton of one."""
    if isinstance(config, FilesystemTransferConfig) and config.fanout == "relay":
        from marinrl.transfer.relay import RelayWeightClient

        return RelayWeightClient(config, skeleton)
    return _transport(config, 2)(config, skeleton)
