"""Weight transfer through Ray's object store.

The server `ray.put`s the model's arrays as host NumPy arrays and hands the ObjectRef to a named
coordinator actor, which keeps the newest version's ref and its `VersionId`. A client asks the actor
for the newest version (one small call) and fetches the object only when it is newer than what it
holds; on the same node the fetch reads shared memory without a copy, from another node Ray moves
the bytes.

The trainer's process owns the objects: if it dies, its versions are gone and clients count a
failed transfer until the restarted trainer publishes. The actor lives as long as the process that
created it (the server's); if it dies, clients count failures and keep their weights, and the next
publish creates a new one.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import ray
from ray.exceptions import RayActorError

from marinrl.transfer.base import (
    VersionId,
    WeightFormatError,
    WeightPublishError,
    WeightTransferClient,
    WeightTransferConfig,
    WeightTransferError,
    WeightTransferServer,
    host_leaves,
    new_epoch,
)

logger = logging.getLogger(__name__)

PAYLOAD_FORMAT_VERSION = 1
_PUBLISH_ATTEMPTS = 4


@ray.remote(num_cpus=0, max_restarts=0)
class WeightCoordinator:
    """Holds the newest published version: its (epoch, weight_step), ObjectRef and size."""

    def __init__(self):
        self._version: tuple[int, int] | None = None
        self._ref = None
        self._nbytes = 0

    def publish(self, epoch: int, weight_step: int, boxed_ref: list, nbytes: int) -> tuple[bool, tuple | None]:
        """Takes the version if it is newer than the one held; returns (taken, the version held)."""
        version = (epoch, weight_step)
        if self._version is not None and version <= self._version:
            return False, self._version
        # The ref arrives in a list so that Ray passes the reference, not the object's value.
        self._version, self._ref, self._nbytes = version, boxed_ref[0], nbytes
        return True, version

    def latest(self) -> tuple | None:
        """(epoch, weight_step, [ref], nbytes) of the newest version, or None before the first publish."""
        if self._version is None:
            return None
        return self._version[0], self._version[1], [self._ref], self._nbytes


@WeightTransferConfig.register_subclass("ray")
@dataclasses.dataclass(frozen=True)
class RayTransferConfig(WeightTransferConfig):
    name: str = "marinrl-weights"
    """Name of the coordinator actor: one per run (runs sharing a Ray cluster need distinct names)."""
    namespace: str | None = None
    """Ray namespace of the actor; None: the namespace of the process's Ray connection."""
    timeout_s: float = 60.0
    """Limit in seconds for one call to the coordinator and for one fetch of the weights."""

    def __post_init__(self):
        if not self.name:
            raise ValueError("RayTransferConfig.name must be set")
        if self.timeout_s <= 0:
            raise ValueError(f"RayTransferConfig.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def location(self) -> str:
        return f"ray actor {self.namespace + '/' if self.namespace else ''}{self.name}"

    def build_server(self) -> "RayWeightServer":
        return RayWeightServer(self)

    def build_client(self, skeleton) -> "RayWeightClient":
        return RayWeightClient(self, skeleton)


def _require_ray(location: str) -> None:
    if not ray.is_initialized():
        raise WeightTransferError(f"{location}: Ray is not initialized; call ray.init() first (or run in a Ray job)")


class RayWeightServer(WeightTransferServer):
    """Puts each version in the object store and registers it with the coordinator actor."""

    def __init__(self, config: RayTransferConfig):
        super().__init__()
        self.config = config
        self.location = config.location
        _require_ray(self.location)
        self._actor = self._coordinator()
        latest = ray.get(self._actor.latest.remote(), timeout=config.timeout_s)
        self.epoch = new_epoch(after=latest and latest[0])
        self._ref = None

    def _coordinator(self):
        return WeightCoordinator.options(name=self.config.name, namespace=self.config.namespace,
                                         get_if_exists=True).remote()

    def _publish(self, version: VersionId, model) -> tuple[str, int]:
        names, arrays = host_leaves(model)
        nbytes = sum(a.nbytes for a in arrays)
        ref = ray.put({"format_version": PAYLOAD_FORMAT_VERSION, "names": names, "arrays": arrays})
        taken, held = self._register(version, ref, nbytes)
        if not taken:
            raise WeightPublishError(
                f"{self.location} holds {VersionId(*held)}, not older than {version}: this trainer was superseded"
            )
        self._ref = ref  # the previous version's object is freed once no client is reading it
        return self.location, nbytes

    def _register(self, version: VersionId, ref, nbytes: int):
        delay = 0.05
        for attempt in range(_PUBLISH_ATTEMPTS):
            try:
                call = self._actor.publish.remote(version.epoch, version.weight_step, [ref], nbytes)
                return ray.get(call, timeout=self.config.timeout_s)
            except RayActorError as e:
                if attempt == _PUBLISH_ATTEMPTS - 1:
                    raise WeightPublishError(f"{self.location} died and could not be recreated: {e!r}") from e
                # A killed actor's name is released asynchronously: until it is, get_if_exists may
                # return the dead one again, so back off between attempts.
                logger.warning("%s died (%s); recreating it", self.location, type(e).__name__)
                time.sleep(delay)
                delay *= 4
                self._actor = self._coordinator()
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Kills the coordinator (clients then count failures) and releases the newest version."""
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already gone
            logger.debug("killing %s: %r", self.location, e)
        self._ref = None


class RayWeightClient(WeightTransferClient):
    """Asks the coordinator for the newest version; fetches the object only when it is newer."""

    def __init__(self, config: RayTransferConfig, skeleton):
        super().__init__(skeleton)
        self.config = config
        self.location = config.location
        _require_ray(self.location)
        self._actor = None

    def _latest(self):
        if self._actor is None:
            try:
                self._actor = ray.get_actor(self.config.name, namespace=self.config.namespace)
            except ValueError:  # not created yet (or gone and not yet recreated): nothing published
                return None
        try:
            latest = ray.get(self._actor.latest.remote(), timeout=self.config.timeout_s)
        except Exception:
            self._actor = None  # look it up again next time: the server may have recreated it
            raise
        if latest is None:
            return None
        epoch, weight_step, boxed_ref, _ = latest
        return VersionId(epoch, weight_step), boxed_ref[0]

    def _fetch(self, version: VersionId, ref):
        payload = ray.get(ref, timeout=self.config.timeout_s)
        where = f"{self.location} ({version})"
        try:
            fmt, names, arrays = payload["format_version"], payload["names"], payload["arrays"]
        except (TypeError, KeyError) as e:
            raise WeightFormatError(f"{where}: not a weights payload ({e!r})") from e
        if fmt != PAYLOAD_FORMAT_VERSION or not all(isinstance(a, np.ndarray) for a in arrays):
            raise WeightFormatError(f"{where}: payload format {fmt!r} or leaf types this client does not know")
        return self.skeleton.build(names, arrays, where), sum(a.nbytes for a in arrays)
