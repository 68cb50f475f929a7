"""A weight transfer config's two ends: the trainer's server and a rollout worker's client. The configs
(config/transfer.py) stay free of JAX and Ray, so a job config parses in a second; the ends are
built here, where importing them costs nothing extra (docs/architecture.md, "Layers")."""

from __future__ import annotations

from marinrl.config.transfer import FilesystemTransferConfig, RayTransferConfig, WeightTransferConfig
from marinrl.transfer.base import WeightTransferClient, WeightTransferServer


def build_server(config: WeightTransferConfig) -> WeightTransferServer:
    """The trainer's side of `config`."""
    if isinstance(config, FilesystemTransferConfig):
        from marinrl.transfer.checkpoint import FilesystemWeightServer

        return FilesystemWeightServer(config)
    if isinstance(config, RayTransferConfig):
        from marinrl.transfer.ray import RayWeightServer

        return RayWeightServer(config)
    raise TypeError(f"no weight transfer server for {type(config).__name__}")


def build_client(config: WeightTransferConfig, skeleton) -> WeightTransferClient:
    """The rollout side of `config`; `skeleton` is a model of the right structure and placement (e.g. the
    current model) or a ModelSkeleton of one."""
    if isinstance(config, FilesystemTransferConfig):
        from marinrl.transfer.checkpoint import FilesystemWeightClient

        return FilesystemWeightClient(config, skeleton)
    if isinstance(config, RayTransferConfig):
        from marinrl.transfer.ray import RayWeightClient

        return RayWeightClient(config, skeleton)
    raise TypeError(f"no weight transfer client for {type(config).__name__}")
