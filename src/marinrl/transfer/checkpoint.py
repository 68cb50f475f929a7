"""Weight transfer through a filesystem: gs://, a local path (file://) or memory://.

Layout under ROOT:

    ROOT/step-000000042-e<epoch>/weights.bin      one version, packed format (transfer/packed.py), or
    ROOT/step-000000042-e<epoch>/delta.bin        one version as a delta from the previous (delta: true), or
    ROOT/step-000000042-e<epoch>/<leaf>/<path>/   one version, a Levanter tensorstore checkpoint
    ROOT/latest.json                              the pointer: the newest committed version (and its
                                                  delta chain back to the last snapshot)
    ROOT/want-snapshot-<id>                       a client's request for a snapshot (a broken delta)

A version folder is written once and never changed (its name holds the server's epoch, so a
restarted trainer never overwrites the folder of a version a client may be reading). The pointer
is written last, as a single atomic object (an atomic put on object stores, a rename on local
disks), so a reader that follows it never sees a half-written version. After each commit the
server deletes the versions older than the newest that are not among the `keep_last` it
committed itself, and the chain the pointer names.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections import deque

import equinox as eqx
import jax
import numpy as np
from jax.experimental.array_serialization.serialization import GlobalAsyncCheckpointManager
from levanter.tensorstore_serialization import tree_serialize_leaves_tensorstore

from marinrl import multihost
from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.storage.fs import ATOMIC_PUT_PROTOCOLS, list_names, open_root, with_retries
from marinrl.transfer.base import (
    VersionId,
    WeightFormatError,
    WeightPublishError,
    WeightTransferClient,
    WeightTransferServer,
    host_leaves,
    is_fully_addressable,
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
from marinrl.transfer.packed import read_packed, read_packed_meta, write_packed

logger = logging.getLogger(__name__)

POINTER_NAME = "latest.json"
PACKED_NAME = "weights.bin"
DELTA_NAME = "delta.bin"
SNAPSHOT_REQUEST_PREFIX = "want-snapshot-"
POINTER_FORMAT_VERSION = 3
"""2: a pointer may carry a delta chain (readers of 1 refuse it); 3: its deltas may use the `ulps`
encoding (readers of 2 refuse it rather than fall back to a snapshot at every delta)."""
_VERSION_DIR = re.compile(r"^step-(\d+)-e(\d+)$")
_LOCAL_PROTOCOLS = {"file", "local"}


def version_dir_name(version: VersionId) -> str:
    return f"step-{version.weight_step:09d}-e{version.epoch}"


def parse_version_dir(name: str) -> VersionId | None:
    m = _VERSION_DIR.match(name)
    return VersionId(int(m.group(2)), int(m.group(1))) if m else None


class _Root:
    """The filesystem and root path both sides share, with the pointer's read and write."""

    def __init__(self, config: FilesystemTransferConfig):
        self.url = config.root
        self.fs, self.path = open_root(config.root, config.storage_options, None)
        self.protocols = set(np.atleast_1d(self.fs.protocol))
        self.pointer_path = f"{self.path}/{POINTER_NAME}"

    def display(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def tensorstore_url(self, path: str) -> str:
        if self.protocols & _LOCAL_PROTOCOLS:
            return path
        if self.protocols & {"gs", "gcs"}:
            return f"gs://{path}"
        raise WeightFormatError(f"{self.url}: tensorstore reads and writes gs:// or local paths only")

    def read_pointer(self) -> dict | None:
        """The pointer's content, None if nothing was published; WeightFormatError if it is unreadable."""
        try:
            data = with_retries(lambda: self.fs.cat_file(self.pointer_path), "reading", self.pointer_path)
        except FileNotFoundError:
            return None
        where = self.display(self.pointer_path)
        try:
            pointer = json.loads(data)
            version = VersionId(int(pointer["epoch"]), int(pointer["weight_step"]))
            if pointer["version"] != version_dir_name(version) or pointer["format"] not in ("packed", "tensorstore"):
                raise ValueError(f"version {pointer['version']!r} or format {pointer['format']!r}")
            int(pointer["bytes"])
            if "chain" in pointer:
                chain = [_chain_link(link) for link in pointer["chain"]]
                if not chain or chain[-1].handle["version"] != pointer["version"]:
                    raise ValueError("the chain does not end at the version")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightFormatError(f"{where}: unreadable pointer ({e!r})") from e
        if int(pointer.get("format_version", 0)) > POINTER_FORMAT_VERSION:
            raise WeightFormatError(f"{where}: pointer format {pointer['format_version']} is newer than this reader's")
        return pointer

    def write_pointer(self, pointer: dict) -> None:
        data = json.dumps(pointer, indent=1).encode()
        if self.protocols & ATOMIC_PUT_PROTOCOLS:
            with_retries(lambda: self.fs.pipe_file(self.pointer_path, data), "writing", self.pointer_path)
            return
        tmp = f"{self.path}/.{POINTER_NAME}.{uuid.uuid4().hex[:12]}.tmp"
        with_retries(lambda: self.fs.makedirs(self.path, exist_ok=True), "creating", self.path)
        with_retries(lambda: self.fs.pipe_file(tmp, data), "writing", tmp)
        with_retries(lambda: self.fs.mv(tmp, self.pointer_path), "renaming", tmp)


def _chain_link(record: dict) -> Link:
    """A pointer's chain entry {"version", "kind", "file", "bytes", "crc32"} as a Link; ValueError if bad."""
    version = parse_version_dir(str(record["version"]))
    if version is None or record["kind"] not in (SNAPSHOT, DELTA) or record["file"] not in (PACKED_NAME, DELTA_NAME):
        raise ValueError(f"bad chain entry {record!r:.200}")
    int(record["bytes"]), int(record["crc32"])
    return Link(version, record["kind"], record)


def _attempt(what: str, where: str, fn):
    """Runs one step of a publish; any failure becomes a WeightPublishError naming `where`."""
    try:
        return fn()
    except WeightPublishError:
        raise
    except Exception as e:
        raise WeightPublishError(f"{what} {where} failed: {e!r}") from e


class FilesystemWeightServer(WeightTransferServer):
    """Writes each version to its own folder, then the pointer, then deletes old versions."""

    def __init__(self, config: FilesystemTransferConfig):
        super().__init__()
        self.config = config
        self._root = _Root(config)
        self.location = config.root
        try:
            current = self._root.read_pointer()
        except Exception as e:  # noqa: BLE001 - a broken pointer is overwritten by the first publish
            logger.warning("ignoring the existing pointer at %s: %s", self._root.url, e)
            current = None
        self.epoch = new_epoch(after=current and int(current["epoch"]))
        # A trainer over several processes writes one version together: all use process 0's epoch.
        self.epoch = int(multihost.current_cohort().agree("weights-epoch", str(self.epoch)))
        self._committed: deque[str] = deque(maxlen=config.keep_last)
        self.versions_deleted = 0
        self._delta = DeltaPublisher(config.full_every) if config.delta else None
        self._chain: list[dict] = []  # the pointer's chain as of the last commit
        self.deltas_published = 0

    def _publish(self, version: VersionId, model) -> tuple[str, int]:
        fmt = self.config.format
        if fmt == "auto":
            fmt = "packed" if is_fully_addressable(model) else "tensorstore"
        name = version_dir_name(version)
        folder = f"{self._root.path}/{name}"
        crc, encoded, chain = None, None, None
        if fmt == "packed" and self._delta is not None:
            encoded, (nbytes, crc) = self._write_delta(folder, version, model)
        elif fmt == "packed":
            nbytes, crc = self._write_packed(folder, model)
        else:
            if self._delta is not None:
                logger.warning("%s: the model is sharded over several hosts: publishing full tensorstore "
                               "versions, not deltas", self._root.url)
                self._delta = None
            nbytes = self._write_tensorstore(folder, model)
        if encoded is not None:
            record = {"version": name, "kind": encoded.kind, "file": PACKED_NAME if encoded.kind == SNAPSHOT
                      else DELTA_NAME, "bytes": nbytes, "crc32": crc}
            chain = [record] if encoded.kind == SNAPSHOT else [*self._chain, record]
        if jax.process_index() == 0:
            self._commit(version, fmt, nbytes, crc, chain)
            if encoded is not None:
                self._delta.commit(encoded)
                self._chain = chain
                self.deltas_published += encoded.kind == DELTA
            self._collect_garbage(version)
        return self._root.display(folder), nbytes

    def _write_delta(self, folder: str, version: VersionId, model):
        """Writes `model` as a snapshot (weights.bin) or a delta from the last commit (delta.bin)."""
        names, arrays = _attempt("gathering the weights for", self._root.display(folder), lambda: host_leaves(model))
        if jax.process_index() != 0:
            return None, (sum(a.nbytes for a in arrays), 0)
        if self._chain and not self._delta.snapshot_wanted:
            self._delta.snapshot_wanted = self._take_snapshot_requests()
        encoded = self._delta.encode(version, names, arrays)
        path = f"{folder}/{PACKED_NAME if encoded.kind == SNAPSHOT else DELTA_NAME}"
        fs = self._root.fs

        def write():
            fs.makedirs(folder, exist_ok=True)
            with fs.open(path, "wb") as f:
                return write_packed(f, encoded.names, encoded.arrays, encoded.meta)

        return encoded, _attempt("writing", self._root.display(path), lambda: with_retries(write, "writing", path))

    def _take_snapshot_requests(self) -> bool:
        """Whether a client asked for a snapshot (a broken delta); deletes the requests. Best effort."""
        fs, root = self._root.fs, self._root.path
        fs.invalidate_cache(root)
        try:
            requests = [n for n in list_names(fs, root) if n.startswith(SNAPSHOT_REQUEST_PREFIX)]
        except Exception as e:  # noqa: BLE001
            logger.warning("could not list %s for snapshot requests: %s", self._root.url, e)
            return False
        for name in requests:
            try:
                fs.rm(f"{root}/{name}")
            except Exception as e:  # noqa: BLE001
                logger.warning("could not delete the snapshot request %s: %s", name, e)
        if requests:
            logger.info("%s: a client asked for a snapshot; publishing one", self._root.url)
        return bool(requests)

    def _commit(self, version: VersionId, fmt: str, nbytes: int, crc: int | None, chain: list | None) -> None:
        """Writes the pointer, unless a newer server has taken over the root."""
        where = self._root.display(self._root.pointer_path)
        try:
            current = self._root.read_pointer()
        except WeightFormatError as e:
            logger.warning("overwriting an unreadable pointer: %s", e)
            current = None
        except Exception as e:
            raise WeightPublishError(f"reading {where} failed: {e!r}") from e
        if current is not None and int(current["epoch"]) > self.epoch:
            raise WeightPublishError(
                f"{where} points to weight step {current['weight_step']} of a newer server "
                f"(epoch {current['epoch']} > this server's {self.epoch}): this trainer was superseded"
            )
        name = version_dir_name(version)
        pointer = {"format_version": POINTER_FORMAT_VERSION, "weight_step": version.weight_step,
                   "epoch": version.epoch, "version": name, "format": fmt, "bytes": nbytes,
                   "crc32": crc, "written_at": time.time()}
        if chain is not None:
            pointer["chain"] = chain
        else:
            pointer["format_version"] = 1  # what readers without delta support read
        _attempt("writing", where, lambda: self._root.write_pointer(pointer))
        self._committed.append(name)

    def _write_packed(self, folder: str, model) -> tuple[int, int]:
        path = f"{folder}/{PACKED_NAME}"
        where = self._root.display(path)
        names, arrays = _attempt("gathering the weights for", where, lambda: host_leaves(model))
        if jax.process_index() != 0:
            return sum(a.nbytes for a in arrays), 0
        fs = self._root.fs

        def write():
            fs.makedirs(folder, exist_ok=True)
            with fs.open(path, "wb") as f:
                return write_packed(f, names, arrays)

        return _attempt("writing", where, lambda: with_retries(write, "writing", path))

    def _write_tensorstore(self, folder: str, model) -> int:
        arrays = eqx.filter(model, eqx.is_array)
        url = self._root.tensorstore_url(folder)
        _attempt("writing the tensorstore checkpoint", self._root.display(folder),
                 lambda: tree_serialize_leaves_tensorstore(url, arrays))
        return sum(int(x.nbytes) for x in jax.tree.leaves(arrays))

    def _collect_garbage(self, newest: VersionId) -> None:
        """Deletes versions older than `newest` except the last `keep_last` this server committed.

        Housekeeping: a failure is logged, never raised. Versions newer than `newest` (being
        written by a newer server) are never touched.
        """
        fs, root = self._root.fs, self._root.path
        fs.invalidate_cache(root)
        try:
            names = list_names(fs, root)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not list %s to delete old versions: %s", self._root.url, e)
            return
        chain = {record["version"] for record in self._chain}
        for name in names:
            version = parse_version_dir(name)
            if version is None or name in self._committed or name in chain or not version < newest:
                continue
            path = f"{root}/{name}"
            try:
                with_retries(lambda path=path: fs.rm(path, recursive=True), "deleting", path)
                self.versions_deleted += 1
            except FileNotFoundError:
                pass
            except Exception as e:  # noqa: BLE001
                logger.warning("could not delete old version %s: %s", self._root.display(path), e)

    @property
    def metrics(self) -> dict[str, float]:
        return {**super().metrics, "versions_deleted": self.versions_deleted, "deltas_published": self.deltas_published}


class FilesystemWeightClient(WeightTransferClient):
    """Reads the pointer on each poll and loads the version it names when it is newer."""

    def __init__(self, config: FilesystemTransferConfig, skeleton):
        super().__init__(skeleton)
        self.config = config
        self._root = _Root(config)
        self.location = config.root

    def _latest(self) -> tuple[VersionId, dict] | None:
        pointer = self._root.read_pointer()
        if pointer is None:
            return None
        return VersionId(int(pointer["epoch"]), int(pointer["weight_step"])), pointer

    def _fetch(self, version: VersionId, pointer: dict):
        folder = f"{self._root.path}/{pointer['version']}"
        if "chain" in pointer:
            return self._fetch_chain(pointer)
        if pointer["format"] == "packed":
            path = f"{folder}/{PACKED_NAME}"
            where = self._root.display(path)
            data = with_retries(lambda: self._root.fs.cat_file(path), "reading", path)
            crc = pointer.get("crc32")
            names, arrays = read_packed(data, where, expected_bytes=int(pointer["bytes"]),
                                        expected_crc=None if crc is None else int(crc))
            return self.skeleton.build(names, arrays, where), len(data), version
        return self._read_tensorstore(folder), self.skeleton.nbytes, version

    def _fetch_chain(self, pointer: dict):
        def load(link: Link):
            record = link.handle
            path = f"{self._root.path}/{record['version']}/{record['file']}"
            data = with_retries(lambda: self._root.fs.cat_file(path), "reading", path)
            meta, names, arrays = read_packed_meta(data, self._root.display(path), expected_bytes=int(record["bytes"]),
                                                   expected_crc=int(record["crc32"]))
            return meta, names, arrays, len(data)

        return receive_model(self, [_chain_link(r) for r in pointer["chain"]], load)

    def _request_snapshot(self) -> None:
        """Asks the server for a snapshot at its next publish (a delta was broken); best effort."""
        path = f"{self._root.path}/{SNAPSHOT_REQUEST_PREFIX}{uuid.uuid4().hex[:12]}"
        try:
            with_retries(lambda: self._root.fs.pipe_file(path, b"{}"), "writing", path)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not ask for a snapshot at %s: %s", self._root.display(path), e)

    @property
    def metrics(self) -> dict[str, float]:
        return {**super().metrics, **delta_metrics(self)}

    def _read_tensorstore(self, folder: str):
        url = self._root.tensorstore_url(folder)
        skeleton = self.skeleton
        # The leaf paths of a Levanter tensorstore checkpoint: one folder per dotted leaf name.
        paths = [os.path.join(url, *name.split(".")) for name in skeleton.names]
        default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = [s if s is not None else default for s in skeleton.shardings]
        arrays = GlobalAsyncCheckpointManager().deserialize_with_paths(shardings=shardings, paths=paths)
        return skeleton.build(skeleton.names, arrays, self._root.display(folder))
