"""Delta weight sync: publish a version as what changed since the previous one (docs/weight_transfer.md).

The publisher keeps a host copy of the last version it committed and encodes each array of the next
one as the cheapest of `same`, `elements`, `ulps`, `blocks` or `dense` (delta_encoding.py). Every K-th
version, and whenever asked, it is a full `snapshot` instead.
The published versions since the last snapshot form a *chain*: [snapshot, delta, delta, ...].

A receiver holds a host mirror of the last version it verified. It applies the deltas after the
version it holds in order, or, when it holds none of the chain (new, restarted, too far behind),
the chain's snapshot and then every delta. Each array's result is checked against the publisher's
CRC-32 of that array. A delta that is missing, unreadable or gives a wrong checksum makes it start
over from the snapshot; if the chain is broken there too it keeps the newest version it could
verify (the snapshot plus the deltas before the broken one), never unverified weights.

Comparisons and writes work on the bits (unsigned views), so NaNs, -0.0 and bf16 round-trip exactly.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import jax
import numpy as np

from marinrl.transfer.base import VersionId, WeightFormatError
from marinrl.transfer.delta_encoding import (
    BLOCK_ELEMENTS,
    ENCODINGS,
    apply_array,
    array_crc,
    data_leaf_names,
    encode_array,
)
from marinrl.transfer.model_leaves import array_tree

logger = logging.getLogger(__name__)

SNAPSHOT, DELTA = "snapshot", "delta"
@dataclasses.dataclass
class Encoded:
    """One version ready to write: its kind, the leaves that carry its data, and its header."""

    version: VersionId
    kind: str
    names: list[str]
    arrays: list[np.ndarray]
    meta: dict
    current: list[np.ndarray]
    """The full arrays of this version (host copies), kept as the next delta's base once committed."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class DeltaPublisher:
    """The server's side: encodes each version against the last one committed."""

    def __init__(self, full_every: int, encodings: Sequence[str] = ("elements", "ulps", "dense")):
        self.full_every = full_every
        self.encodings = tuple(encodings)
        self.block = BLOCK_ELEMENTS
        self._base_version: VersionId | None = None  # the last committed version, its arrays and CRCs
        self._base_names: list[str] = []
        self._base_arrays: list[np.ndarray] = []
        self._base_crcs: list[int] = []
        self.chain: list[tuple[VersionId, str]] = []  # committed versions since the last snapshot
        self.snapshot_wanted = False
        """Set by a client's request (or a failed publish): the next version is a snapshot."""

    def encode(self, version: VersionId, names: list[str], arrays: list[np.ndarray]) -> Encoded:
        """Encodes `arrays` (kept as the next base: the caller must not modify them afterwards). Views of
        other memory are copied (on CPU they may be the trainer's device buffers, which a donating
        train step overwrites). Commit the result once it is published."""
        current = [a if a.flags.owndata and a.flags.writeable else np.array(a, copy=True) for a in arrays]
        base = self._base_version
        snapshot = (base is None or self.snapshot_wanted or len(self.chain) >= self.full_every
                    or base.epoch != version.epoch or self._base_names != list(names))
        entries, out_names, out_arrays = [], [], []
        for i, (name, a) in enumerate(zip(names, current)):
            if snapshot:
                encoding, leaf_names, leaves = "dense", [f"{name}#val"], [a]
            else:
                encoding, leaf_names, leaves = encode_array(name, self._base_arrays[i], a, self.encodings, self.block)
            crc = self._base_crcs[i] if encoding == "same" else array_crc(a)
            entries.append({"name": name, "encoding": encoding, "crc32": crc})
            out_names += leaf_names
            out_arrays += leaves
        kind = SNAPSHOT if snapshot else DELTA
        meta = {"kind": kind, "block": self.block, "arrays": entries,
                "base": None if snapshot else [base.epoch, base.weight_step]}
        return Encoded(version, kind, out_names, out_arrays, meta, current)

    def commit(self, encoded: Encoded) -> None:
        """`encoded` is published: it becomes the base of the next delta."""
        self._base_version = encoded.version
        self._base_names = [e["name"] for e in encoded.meta["arrays"]]
        self._base_arrays = encoded.current
        self._base_crcs = [e["crc32"] for e in encoded.meta["arrays"]]
        if encoded.kind == SNAPSHOT:
            self.chain = []
            self.snapshot_wanted = False
        self.chain.append((encoded.version, encoded.kind))


@dataclasses.dataclass(frozen=True)
class Link:
    """One version of a chain as a receiver sees it; `handle` tells the transport how to load it."""

    version: VersionId
    kind: str
    handle: object


Loader = Callable[[Link], tuple[dict, list[str], list[np.ndarray], int]]
"""Loads a link: (meta, data leaf names, data leaves, bytes read); raises on missing or corrupt data."""


class DeltaReceiver:
    """The client's side: a host mirror of the last verified version, advanced along chains."""

    def __init__(self, names: Sequence[str], shapes: Sequence[tuple], dtypes: Sequence[np.dtype], where: str):
        self.names, self.shapes, self.dtypes = list(names), [tuple(s) for s in shapes], list(dtypes)
        self.where = where
        self.version: VersionId | None = None
        self.mirror: list[np.ndarray] | None = None
        self.fallbacks = 0
        """Times a delta failed and the receiver went back to the snapshot."""
        self.deltas_applied = 0
        """Deltas applied to the mirror and verified (each version reached from the one before it)."""
        self.snapshots_loaded = 0
        """Snapshots loaded whole (the first version, a fallback, or a client too far behind)."""
        self.broken: set[VersionId] = set()
        """Deltas that failed from the snapshot too: the chain ends before them until the next snapshot."""

    def receive(self, chain: Sequence[Link], load: Loader) -> tuple[VersionId, list[int], int] | None:
        """Advances along `chain` as far as it verifies: (version now held, indices of the arrays that
        changed, bytes read), or None if nothing newer verifies. Raises if the snapshot fails."""
        if not chain or chain[0].kind != SNAPSHOT or any(link.kind != DELTA for link in chain[1:]):
            raise WeightFormatError(f"{self.where}: a chain is one snapshot and then deltas")
        for i, link in enumerate(chain):
            if link.version in self.broken:  # nothing past a broken delta verifies
                chain = chain[:i]
                break
        held = next((i for i, link in enumerate(chain) if link.version == self.version), None)
        if held is not None and held == len(chain) - 1:
            return None
        nbytes = 0
        if held is not None:
            try:
                mirror, changed, nbytes = self._walk(self.mirror, self.version, chain[held + 1:], load)
                self.version, self.mirror = chain[-1].version, mirror
                self.deltas_applied += len(chain) - held - 1
                return self.version, sorted(changed), nbytes
            except Exception as e:  # noqa: BLE001 - any failed delta: start over from the snapshot
                self.fallbacks += 1
                logger.warning("%s: a delta after %s failed (%d fallbacks so far); reloading the snapshot %s: %s",
                               self.where, self.version, self.fallbacks, chain[0].version, e)
        if not chain:
            return None
        meta, names, data, n = load(chain[0])
        nbytes += n
        mirror, version = self._snapshot(chain[0], meta, names, data), chain[0].version
        walked = 0
        for link in chain[1:]:
            try:
                mirror, _, n = self._walk(mirror, version, [link], load)
            except Exception as e:  # noqa: BLE001
                self.broken.add(link.version)
                logger.warning("%s: delta %s is broken (%s); holding %s until the next snapshot",
                               self.where, link.version, e, version)
                break
            nbytes += n
            version = link.version
            walked += 1
        if self.version is not None and version <= self.version:
            return None
        self.version, self.mirror = version, mirror
        self.snapshots_loaded += 1
        self.deltas_applied += walked
        return version, list(range(len(mirror))), nbytes

    def _snapshot(self, link: Link, meta: dict, names, data) -> list[np.ndarray]:
        where = f"{self.where} ({link.version})"
        entries = self._entries(meta, where, SNAPSHOT)
        if [f"{e['name']}#val" for e in entries] != list(names) or any(e["encoding"] != "dense" for e in entries):
            raise WeightFormatError(f"{where}: a snapshot must hold every array whole")
        for e, a, shape, dtype in zip(entries, data, self.shapes, self.dtypes):
            if a.shape != shape or a.dtype != dtype:
                raise WeightFormatError(f"{where}: {e['name']} is {a.dtype.name}{list(a.shape)}, the model expects "
                                        f"{dtype.name}{list(shape)}")
            if array_crc(a) != e["crc32"]:
                raise WeightFormatError(f"{where}: {e['name']} does not match the publisher's checksum")
        return list(data)

    def _walk(self, mirror, base: VersionId, links, load):
        """Applies the deltas `links` in order to `mirror` (version `base`): (new mirror, changed
        array indices, bytes read). Raises WeightFormatError on anything that does not verify."""
        changed: set[int] = set()
        nbytes = 0
        for link in links:
            where = f"{self.where} ({link.version})"
            meta, names, data, n = load(link)
            nbytes += n
            entries = self._entries(meta, where, DELTA)
            if meta.get("base") != [base.epoch, base.weight_step]:
                raise WeightFormatError(f"{where}: a delta from {meta.get('base')}, applied to {base}")
            block = int(meta.get("block", BLOCK_ELEMENTS))
            mirror, pos = list(mirror), 0
            for i, e in enumerate(entries):
                encoding = e["encoding"]
                if encoding == "same":
                    continue
                if encoding not in ENCODINGS:
                    raise WeightFormatError(f"{where}: unknown encoding {encoding!r} of {e['name']}")
                want = data_leaf_names(e["name"], encoding)
                if list(names[pos:pos + len(want)]) != want:
                    raise WeightFormatError(f"{where}: the data of {e['name']} is missing or out of order")
                new = apply_array(e["name"], encoding, mirror[i], data[pos:pos + len(want)], block, where)
                pos += len(want)
                if array_crc(new) != e["crc32"]:
                    raise WeightFormatError(f"{where}: {e['name']} does not match the publisher's checksum "
                                            "after the delta (a corrupt delta or a wrong base)")
                mirror[i] = new
                changed.add(i)
            if pos != len(names):
                raise WeightFormatError(f"{where}: {len(names) - pos} unexpected data leaves")
            base = link.version
        return mirror, changed, nbytes

    def _entries(self, meta: dict, where: str, kind: str) -> list[dict]:
        try:
            entries = [{"name": str(e["name"]), "encoding": str(e["encoding"]), "crc32": int(e["crc32"])}
                       for e in meta["arrays"]]
            got_kind = meta["kind"]
        except (KeyError, TypeError, ValueError) as e:
            raise WeightFormatError(f"{where}: unreadable delta header ({e!r})") from e
        if got_kind != kind:
            raise WeightFormatError(f"{where}: expected a {kind}, found a {got_kind}")
        if [e["name"] for e in entries] != self.names:
            raise WeightFormatError(f"{where}: its arrays do not match the model's leaves")
        return entries


def delta_metrics(client) -> dict[str, float]:
    """A client's delta counters for its `metrics` (zeros before its first chain)."""
    receiver: DeltaReceiver | None = getattr(client, "_delta_receiver", None)
    if receiver is None:
        return {"delta_fallbacks": 0, "deltas_applied": 0, "snapshots_loaded": 0}
    return {"delta_fallbacks": receiver.fallbacks, "deltas_applied": receiver.deltas_applied,
            "snapshots_loaded": receiver.snapshots_loaded}


def receive_model(client, links: Sequence[Link], load: Loader):
    """Advances `client` (a WeightTransferClient) along `links`: (model, bytes, version) for its `_fetch`,
    or None. Arrays no delta touched keep the device arrays of the model the client holds."""
    skeleton = client.skeleton
    receiver: DeltaReceiver | None = getattr(client, "_delta_receiver", None)
    if receiver is None:
        receiver = client._delta_receiver = DeltaReceiver(skeleton.names, skeleton.shapes, skeleton.dtypes,
                                                          client.location)
    before, n_broken = receiver.version, len(receiver.broken)
    try:
        got = receiver.receive(links, load)
    finally:
        if len(receiver.broken) > n_broken and hasattr(client, "_request_snapshot"):
            client._request_snapshot()  # so that the chain is whole again at the next publish
    if got is None:
        return None
    version, changed, nbytes = got
    arrays = list(receiver.mirror)
    if client.model is not None and before is not None and client.version == before and len(changed) < len(arrays):
        held = jax.tree.leaves(array_tree(client.model)[0])
        changed_set = set(changed)
        arrays = [a if i in changed_set else held[i] for i, a in enumerate(arrays)]
    return skeleton.build(skeleton.names, arrays, f"{client.location} ({version})"), nbytes, version
