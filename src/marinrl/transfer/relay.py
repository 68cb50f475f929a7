"""Weights read from storage once per version, whatever the number of rollout hosts: a relay.

With the filesystem transport every host reads the pointer and every byte of each version from storage:
64 hosts of an 8B model read 1 TB a step through GCS. With `weights: {type: filesystem, fanout: relay}`
one Ray actor per weight root (`WeightRelay`, created by the first client that needs it) reads the
pointer and each new packed version from storage once, puts the bytes in Ray's object store, and hands
the hosts (`RelayWeightClient`) the version and the object's ref: a host's poll is one small actor call,
its fetch an object-store read (on another node, Ray moves the bytes from a node that holds them).

The relay never blocks a poll on a read: while it fetches a new version it answers with the one it
holds. A version it cannot serve (a delta chain, a tensorstore version, an unreadable pointer) is
read by the clients from storage themselves, as without a relay; so is every version while the
relay is unreachable (its failures are counted, the transfer never stops).
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.storage.fs import with_retries
from marinrl.transfer.base import VersionId
from marinrl.transfer.checkpoint import PACKED_NAME, FilesystemWeightClient, _Root
from marinrl.transfer.packed import read_packed

logger = logging.getLogger(__name__)

RELAY_POLL_S = 0.05
"""The relay reads the pointer at most this often (every host's poll is answered from what it holds)."""


class WeightRelay:
    """One weight root's relay (run as a Ray actor: `relay_actor`)."""

    def __init__(self, config: FilesystemTransferConfig, poll_s: float = RELAY_POLL_S):
        self._root = _Root(config)
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._held: tuple[tuple[int, int], dict, list] | None = None  # (version, pointer, [ref])
        self._checked_at = -1e18
        self._fetching = False
        self.pointer_reads = 0
        self.version_reads = 0
        self.bytes_read = 0
        self.failures = 0

    def latest(self):
        """(epoch, weight_step, pointer, [ref]) of the newest version it holds; ref None where clients
        must read that version themselves; None before any version."""
        self._maybe_check()
        with self._lock:
            return None if self._held is None else (*self._held[0], self._held[1], self._held[2])

    def _maybe_check(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._fetching or now - self._checked_at < self._poll_s:
                return
            self._checked_at, self._fetching = now, True
        threading.Thread(target=self._check, daemon=True).start()

    def _check(self) -> None:
        try:
            pointer = self._root.read_pointer()
            self.pointer_reads += 1
            if pointer is None:
                return
            version = (int(pointer["epoch"]), int(pointer["weight_step"]))
            with self._lock:
                if self._held is not None and self._held[0] == version:
                    return
            ref = None
            if pointer["format"] == "packed" and "chain" not in pointer:
                path = f"{self._root.path}/{pointer['version']}/{PACKED_NAME}"
                data = with_retries(lambda: self._root.fs.cat_file(path), "reading", path)
                self.version_reads += 1
                self.bytes_read += len(data)
                ref = ray.put(data)
            with self._lock:
                self._held = (version, pointer, [ref])
        except Exception as e:  # noqa: BLE001 - clients read storage themselves meanwhile
            self.failures += 1
            logger.warning("weight relay at %s: %r", self._root.url, e)
        finally:
            with self._lock:
                self._fetching = False

    def metrics(self) -> dict[str, float]:
        return {"pointer_reads": self.pointer_reads, "version_reads": self.version_reads,
                "bytes_read": self.bytes_read, "failures": self.failures}


def relay_name(config: FilesystemTransferConfig) -> str:
    return f"marinrl-weight-relay:{config.root}"


def relay_actor(config: FilesystemTransferConfig):
    """The relay of `config.root`, created if it does not exist (in the process's Ray namespace)."""
    return ray.remote(WeightRelay).options(name=relay_name(config), get_if_exists=True, num_cpus=0,
                                           max_concurrency=64, max_restarts=-1).remote(config)


class RelayWeightClient(FilesystemWeightClient):
    """A rollout host's client of a relayed weight root: the relay's version, the bytes from the object
    store; storage only for what the relay does not serve."""

    def __init__(self, config: FilesystemTransferConfig, skeleton, relay=None):
        super().__init__(config, skeleton)
        self._relay = relay
        self.relay_failures = 0
        self.storage_fetches = 0

    def _handle(self):
        if self._relay is None:
            self._relay = relay_actor(self.config)
        return self._relay

    def _latest(self):
        try:
            got = ray.get(self._handle().latest.remote())
        except Exception as e:  # noqa: BLE001 - the relay is gone: read storage as without one
            self.relay_failures += 1
            self._relay = None
            logger.warning("weight relay unreachable (%r); reading %s directly", e, self.location)
            return super()._latest()
        if got is None:
            return None
        epoch, step, pointer, refs = got
        return VersionId(epoch, step), {**pointer, "_ref": refs[0]}

    def _fetch(self, version: VersionId, pointer: dict):
        ref = pointer.get("_ref")
        if ref is None:
            self.storage_fetches += 1
            return super()._fetch(version, pointer)
        data = ray.get(ref)
        where = f"{self.location} (relayed {pointer['version']})"
        crc = pointer.get("crc32")
        names, arrays = read_packed(data, where, expected_bytes=int(pointer["bytes"]),
                                    expected_crc=None if crc is None else int(crc))
        return self.skeleton.build(names, arrays, where), len(data), version
