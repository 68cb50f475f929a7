"""Weight transfer from the trainer to the rollout workers (docs/weight_transfer.md)."""

from marinrl.transfer.base import (
    ModelSkeleton,
    PublishedVersion,
    VersionId,
    WeightFormatError,
    WeightPublishError,
    WeightTransferClient,
    WeightTransferConfig,
    WeightTransferError,
    WeightTransferServer,
    WeightUpdate,
    WeightWaitTimeout,
)
from marinrl.transfer.checkpoint import FilesystemTransferConfig, FilesystemWeightClient, FilesystemWeightServer
from marinrl.transfer.ray import RayTransferConfig, RayWeightClient, RayWeightServer, WeightCoordinator

__all__ = [
    "FilesystemTransferConfig",
    "FilesystemWeightClient",
    "FilesystemWeightServer",
    "ModelSkeleton",
    "PublishedVersion",
    "RayTransferConfig",
    "RayWeightClient",
    "RayWeightServer",
    "VersionId",
    "WeightCoordinator",
    "WeightFormatError",
    "WeightPublishError",
    "WeightTransferClient",
    "WeightTransferConfig",
    "WeightTransferError",
    "WeightTransferServer",
    "WeightUpdate",
    "WeightWaitTimeout",
]
