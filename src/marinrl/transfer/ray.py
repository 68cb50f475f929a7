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

With `delta`, each version is a payload of format 3 (a snapshot or a delta, transfer/delta.py) and
the actor holds the chain of refs back to the last snapshot; a client fetches only the links after
the version it holds, or the whole chain when it holds none of it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import ray
from ray.exceptions import RayActorError

from marinrl.config.transfer import RayTransferConfig
from marinrl.transfer.base import (
    VersionId,
    WeightFormatError,
    WeightPublishError,
    WeightTransferClient,
    WeightTransferError,
    WeightTransferServer,
    host_leaves,
    new_epoch,
)
from marinrl.transfer.delta import (
    DELTA,
    SNAPSHOT,
    DeltaPublisher,
    Link,
    delta_metrics,
    receive_model,
)

logger = logging.getLogger(__name__)

PAYLOAD_FORMAT_VERSION = 1
DELTA_PAYLOAD_FORMAT_VERSION = 3  # 3: deltas may use the `ulps` encoding (2: elements and dense only)
_PUBLISH_ATTEMPTS = 4


@ray.remote(num_cpus=0, max_restarts=0)
class WeightCoordinator:
    """Holds the newest published version: its (epoch, weight_step), ObjectRef and size."""

    def __init__(self):
        self._version: tuple[int, int] | None = None
        self._ref = None
        self._nbytes = 0
        self._chain: list | None = None
        self._snapshot_wanted = False

    def publish(self, epoch: int, weight_step: int, boxed_ref: list, nbytes: int,
                chain: list | None = None) -> tuple[bool, tuple | None]:
        """Takes the version if it is newer than the one held; returns (taken, the version held).

        `chain` (delta mode): [(epoch, weight_step, kind, ref), ...] from the last snapshot to this version.
        """
        version = (epoch, weight_step)
        if self._version is not None and version <= self._version:
            return False, self._version
        # The ref arrives in a list so that Ray passes the reference, not the object's value.
        self._version, self._ref, self._nbytes, self._chain = version, boxed_ref[0], nbytes, chain
        if chain is not None and chain[0][2] == "snapshot" and len(chain) == 1:
            self._snapshot_wanted = False
        return True, version

    def request_snapshot(self) -> None:
        """A client found a broken delta: the server's next version should be a snapshot."""
        self._snapshot_wanted = True

    def snapshot_wanted(self) -> bool:
        return self._snapshot_wanted

    def latest(self) -> tuple | None:
        """(epoch, weight_step, [ref], nbytes, chain or None) of the newest version, or None before the first."""
        if self._version is None:
            return None
        return self._version[0], self._version[1], [self._ref], self._nbytes, self._chain


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
        self._delta = DeltaPublisher(config.full_every) if config.delta else None
        self._chain: list = []  # [(epoch, weight_step, kind, ref)] as of the last publish
        self.deltas_published = 0

    def _coordinator(self):
        return WeightCoordinator.options(name=self.config.name, namespace=self.config.namespace,
                                         get_if_exists=True).remote()

    def _publish(self, version: VersionId, model) -> tuple[str, int]:
        names, arrays = host_leaves(model)
        encoded, chain = None, None
        if self._delta is None:
            nbytes = sum(a.nbytes for a in arrays)
            ref = ray.put({"format_version": PAYLOAD_FORMAT_VERSION, "names": names, "arrays": arrays})
        else:
            if self._chain and not self._delta.snapshot_wanted:
                self._delta.snapshot_wanted = ray.get(self._actor.snapshot_wanted.remote(),
                                                      timeout=self.config.timeout_s)
            encoded = self._delta.encode(version, names, arrays)
            nbytes = encoded.nbytes
            ref = ray.put({"format_version": DELTA_PAYLOAD_FORMAT_VERSION, "kind": encoded.kind,
                           "meta": encoded.meta, "names": encoded.names, "arrays": encoded.arrays})
            link = (version.epoch, version.weight_step, encoded.kind, ref)
            chain = [link] if encoded.kind == SNAPSHOT else [*self._chain, link]
        taken, held = self._register(version, ref, nbytes, chain)
        if not taken:
            raise WeightPublishError(
                f"{self.location} holds {VersionId(*held)}, not older than {version}: this trainer was superseded"
            )
        self._ref = ref  # the previous version's object is freed once no client is reading it
        if encoded is not None:
            self._delta.commit(encoded)
            self._chain = chain  # the chain's objects live until the next snapshot replaces it
            self.deltas_published += encoded.kind == DELTA
        return self.location, nbytes

    @property
    def metrics(self) -> dict[str, float]:
        return {**super().metrics, "deltas_published": self.deltas_published}

    def _register(self, version: VersionId, ref, nbytes: int, chain: list | None):
        delay = 0.05
        for attempt in range(_PUBLISH_ATTEMPTS):
            try:
                call = self._actor.publish.remote(version.epoch, version.weight_step, [ref], nbytes, chain)
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
        self._chain = []


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
        epoch, weight_step, boxed_ref, _, chain = latest
        if chain is not None:
            return VersionId(epoch, weight_step), [Link(VersionId(e, s), kind, r) for e, s, kind, r in chain]
        return VersionId(epoch, weight_step), boxed_ref[0]

    def _fetch(self, version: VersionId, ref):
        if isinstance(ref, list):
            return receive_model(self, ref, self._load_link)
        payload = ray.get(ref, timeout=self.config.timeout_s)
        where = f"{self.location} ({version})"
        try:
            fmt, names, arrays = payload["format_version"], payload["names"], payload["arrays"]
        except (TypeError, KeyError) as e:
            raise WeightFormatError(f"{where}: not a weights payload ({e!r})") from e
        if fmt != PAYLOAD_FORMAT_VERSION or not all(isinstance(a, np.ndarray) for a in arrays):
            raise WeightFormatError(f"{where}: payload format {fmt!r} or leaf types this client does not know")
        return self.skeleton.build(names, arrays, where), sum(a.nbytes for a in arrays), version

    def _load_link(self, link: Link):
        payload = ray.get(link.handle, timeout=self.config.timeout_s)
        where = f"{self.location} ({link.version})"
        try:
            fmt, kind, meta, names, arrays = (payload["format_version"], payload["kind"], payload["meta"],
                                              payload["names"], payload["arrays"])
        except (TypeError, KeyError) as e:
            raise WeightFormatError(f"{where}: not a delta payload ({e!r})") from e
        if (fmt != DELTA_PAYLOAD_FORMAT_VERSION or kind != link.kind
                or not all(isinstance(a, np.ndarray) for a in arrays)):
            raise WeightFormatError(f"{where}: payload format {fmt!r}, kind {kind!r} or leaf types this client "
                                    "does not know")
        return meta, names, arrays, sum(a.nbytes for a in arrays)

    def _request_snapshot(self) -> None:
        """Asks the server (through the actor) for a snapshot at its next publish; best effort."""
        try:
            self._actor.request_snapshot.remote()
        except Exception as e:  # noqa: BLE001
            logger.warning("could not ask %s for a snapshot: %s", self.location, e)

    @property
    def metrics(self) -> dict[str, float]:
        return {**super().metrics, **delta_metrics(self)}
