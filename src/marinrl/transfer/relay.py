"""Weights read from storage once per version, whatever the number of rollout hosts: a relay.

With the filesystem transport every host reads the pointer and every byte of each version from storage:
64 hosts of an 8B model read 1 TB a step through GCS. With `weights: {type: filesystem, fanout: relay}`
one Ray actor per weight root (`WeightRelay`, created by the first client that needs it) reads the
pointer and each new packed version from storage once, puts the bytes in Ray's object store, and hands
the hosts (`RelayWeightClient`) the version and the object's ref: a host's poll is one small actor call,
its fetch an object-store read (on another node, Ray moves the bytes from a node that holds them).
A host waiting for a version (`wait_for_news`) holds one call open (`newer_than`, a long poll) that the
relay answers as soon as it holds a newer one: the fleet makes about one call per host per version
instead of polling at its backoff, and hears of a version within the relay's pointer period (50 ms)
instead of up to the backoff's cap (N / 200 s).

The relay never blocks a poll on a read: while it fetches a new version it answers with the one it
holds. A version it cannot serve (a delta chain, a tensorstore version, an unreadable pointer) is
read by the clients from storage themselves, as without a relay; so is every version while the
relay is unreachable (its failures are counted, the transfer never stops).
"""

from __future__ import annotations

import asyncio
import logging
import math
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
RELAY_WAIT_S = 30.0
"""The longest one host's wait for a new version holds a relay call open (`newer_than`); it then asks again."""
STOP_CHECK_S = 0.5
"""How often a host waiting on the relay looks at its stop flag."""
MAX_WAITING_HOSTS = 10_000
"""The relay's concurrent calls (an async actor's `max_concurrency`): every waiting host holds one."""


class WeightRelay:
    """One weight root's relay, an async Ray actor (`relay_actor`): every call runs on one event loop, so a
    fleet of hosts waiting for news costs one open call each and no thread; storage is read in a thread."""

    def __init__(self, config: FilesystemTransferConfig, poll_s: float = RELAY_POLL_S):
        self._root = _Root(config)
        self._poll_s = poll_s
        self._held: tuple[tuple[int, int], dict, list] | None = None  # (version, pointer, [ref])
        self._news = asyncio.Event()  # set (and replaced) each time a newer version is held
        self._checked_at = -1e18
        self._checking = False
        self._waiting = 0
        self._watcher: asyncio.Task | None = None
        self.pointer_reads = 0
        self.version_reads = 0
        self.bytes_read = 0
        self.failures = 0
        self.calls = 0

    async def latest(self):
        """(epoch, weight_step, pointer, [ref]) of the newest version it holds; ref None where clients
        must read that version themselves; None before any version. Never waits for storage."""
        self.calls += 1
        self._maybe_check()
        return self._answer()

    async def newer_than(self, version: tuple[int, int] | None, timeout_s: float):
        """`latest`'s answer as soon as the relay holds a version newer than `version` (the caller's), or
        after `timeout_s`: a long poll, so a waiting fleet makes one call per host per version."""
        self.calls += 1
        deadline = time.monotonic() + timeout_s
        self._waiting += 1
        try:
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.get_running_loop().create_task(self._watch())
            while not self._is_newer(version):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._news.wait(), remaining)
                except TimeoutError:
                    break
        finally:
            self._waiting -= 1
        return self._answer()

    async def metrics(self) -> dict[str, float]:
        return {"pointer_reads": self.pointer_reads, "version_reads": self.version_reads,
                "bytes_read": self.bytes_read, "failures": self.failures, "calls": self.calls}

    def _answer(self):
        return None if self._held is None else (*self._held[0], self._held[1], self._held[2])

    def _is_newer(self, version) -> bool:
        return self._held is not None and (version is None or self._held[0] > tuple(version))

    async def _watch(self) -> None:
        """Reads the pointer every `poll_s` while any host waits for news."""
        while self._waiting > 0:
            self._maybe_check()
            await asyncio.sleep(self._poll_s)

    def _maybe_check(self) -> None:
        now = time.monotonic()
        if self._checking or now - self._checked_at < self._poll_s:
            return
        self._checked_at, self._checking = now, True
        asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        try:
            got = await asyncio.to_thread(self._read, None if self._held is None else self._held[0])
            if got is not None:
                self._held = got
                self._news.set()
                self._news = asyncio.Event()
        except Exception as e:  # noqa: BLE001 - clients read storage themselves meanwhile
            self.failures += 1
            logger.warning("weight relay at %s: %r", self._root.url, e)
        finally:
            self._checking = False

    def _read(self, held: tuple[int, int] | None):
        """(version, pointer, [ref]) of a version other than `held` from storage, or None (run in a thread)."""
        pointer = self._root.read_pointer()
        self.pointer_reads += 1
        if pointer is None:
            return None
        version = (int(pointer["epoch"]), int(pointer["weight_step"]))
        if held == version:
            return None
        ref = None
        if pointer["format"] == "packed" and "chain" not in pointer:
            path = f"{self._root.path}/{pointer['version']}/{PACKED_NAME}"
            data = with_retries(lambda: self._root.fs.cat_file(path), "reading", path)
            self.version_reads += 1
            self.bytes_read += len(data)
            ref = ray.put(data)
        return version, pointer, [ref]


def relay_name(config: FilesystemTransferConfig) -> str:
    return f"marinrl-weight-relay:{config.root}"


def relay_actor(config: FilesystemTransferConfig):
    """The relay of `config.root`, created if it does not exist (in the process's Ray namespace)."""
    return ray.remote(WeightRelay).options(name=relay_name(config), get_if_exists=True, num_cpus=0,
                                           max_concurrency=MAX_WAITING_HOSTS, max_restarts=-1).remote(config)


class RelayWeightClient(FilesystemWeightClient):
    """A rollout host's client of a relayed weight root: the relay's version, the bytes from the object
    store; storage only for what the relay does not serve."""

    def __init__(self, config: FilesystemTransferConfig, skeleton, relay=None):
        super().__init__(config, skeleton)
        self._relay = relay
        self._announced = None  # the relay's answer to a wait for news, for the next poll
        self.relay_failures = 0
        self.storage_fetches = 0

    def _handle(self):
        if self._relay is None:
            self._relay = relay_actor(self.config)
        return self._relay

    def _unreachable(self, e: BaseException) -> None:
        self.relay_failures += 1
        self._relay = None
        logger.warning("weight relay unreachable (%r); reading %s directly", e, self.location)

    def wait_for_news(self, stop: threading.Event, backoff, max_s: float = math.inf) -> None:
        """One long-poll call (`WeightRelay.newer_than`) answered when the relay holds a newer version:
        no backoff, so a host hears of a version as soon as the relay does; `stop` looked at every
        `STOP_CHECK_S`. An unreachable relay falls back to the backoff's sleep."""
        held = None if self.version is None else (self.version.epoch, self.version.weight_step)
        wait_s = min(RELAY_WAIT_S, max_s)
        try:
            ref = self._handle().newer_than.remote(held, wait_s)
            deadline = time.monotonic() + wait_s + STOP_CHECK_S
            while not stop.is_set():
                ready, _ = ray.wait([ref], timeout=max(0.0, min(STOP_CHECK_S, deadline - time.monotonic())))
                if ready:
                    self._announced = ray.get(ref)
                    return
                if time.monotonic() >= deadline:
                    return
        except Exception as e:  # noqa: BLE001 - the relay is gone: storage's pace
            self._unreachable(e)
            super().wait_for_news(stop, backoff, max_s)

    def _latest(self):
        got, self._announced = self._announced, None
        try:
            if got is None:
                got = ray.get(self._handle().latest.remote())
        except Exception as e:  # noqa: BLE001 - the relay is gone: read storage as without one
            self._unreachable(e)
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
