"""Weight transfer: the contract between the trainer (server) and the rollout workers (clients).

The trainer calls `server.publish(model, weight_step)`; each rollout worker calls `client.poll()`,
which returns the newest published version or nothing, and `client.wait_for(min_step, timeout_s)`
in on-policy mode. Modes (filesystem, Ray object store) are registered choices of
`WeightTransferConfig`; adding one touches one file.

Versions are ordered by `VersionId(epoch, weight_step)`. The epoch belongs to one server instance
(it is set when the server starts, later than any epoch already published), so a restarted trainer
that publishes a lower weight step is still newer, while a lower step from the same server
instance, or anything from an older server instance, never is. Docs: docs/weight_transfer.md.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import math
import threading
import time
from typing import Any, NamedTuple, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from haliax.util import is_named_array
from levanter.utils.jax_utils import leaf_key_paths

logger = logging.getLogger(__name__)


class WeightTransferError(RuntimeError):
    """Base of the errors of this package."""


class WeightPublishError(WeightTransferError):
    """A publish that did not complete; the message names the location. The trainer decides."""


class WeightFormatError(WeightTransferError):
    """A published version that is corrupt or does not fit the client's model skeleton."""


class WeightWaitTimeout(WeightTransferError, TimeoutError):
    """`wait_for` saw no version at or above the step it waited for within its timeout."""


class WeightUpdate(NamedTuple):
    """What a client returns: unpacks as `model, weight_step = update`."""

    model: Any
    weight_step: int


@dataclasses.dataclass(frozen=True, order=True)
class VersionId:
    """Orders versions: a later server instance first, then a higher weight step."""

    epoch: int
    weight_step: int

    def __str__(self) -> str:
        return f"weight step {self.weight_step} (epoch {self.epoch})"


_epoch_lock = threading.Lock()
_last_epoch = 0


def new_epoch(after: int | None = None) -> int:
    """A server instance's epoch: the wall clock in ns, above `after` (the newest one published).

    Reading the newest published epoch first makes a restarted server newer even when its host's
    clock is behind the previous one's; the process-wide counter makes two servers of one process
    distinct.
    """
    global _last_epoch
    with _epoch_lock:
        epoch = max(time.time_ns(), _last_epoch + 1, (after or 0) + 1)
        _last_epoch = epoch
        return epoch


# ----------------------------------------------------------------------------- model <-> named host leaves


def _is_array_leaf(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _array_tree(model):
    """(array leaves, everything else); a skeleton may hold ShapeDtypeStructs (`eqx.filter_eval_shape`)."""
    return eqx.partition(model, _is_array_leaf)


def leaf_names(arrays) -> list[str]:
    """Dotted names of the array leaves, in `jax.tree.leaves` order: Levanter's checkpoint names."""
    names = jax.tree.leaves(leaf_key_paths(arrays, is_leaf=is_named_array))
    n_leaves = len(jax.tree.leaves(arrays))
    if len(names) != n_leaves or len(set(names)) != n_leaves:
        raise WeightFormatError(f"cannot name the {n_leaves} array leaves of the model uniquely (got {len(names)})")
    return names


def host_leaves(model) -> tuple[list[str], list[np.ndarray]]:
    """The model's array leaves as named NumPy arrays on this host (a device-to-host copy).

    Needs every leaf fully addressable from this process; a model sharded over several hosts
    goes through the tensorstore format instead, where each host writes its own shards.
    """
    arrays, _ = _array_tree(model)
    names = leaf_names(arrays)
    leaves = jax.tree.leaves(arrays)
    for name, leaf in zip(names, leaves):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise WeightPublishError(
                f"leaf {name} is not fully addressable from process {jax.process_index()}: "
                "a model sharded over several hosts needs the filesystem mode with format='tensorstore'"
            )
    return names, [np.asarray(leaf) for leaf in jax.device_get(leaves)]


def floating_dtypes(model) -> list[str]:
    """The distinct dtypes of the model's floating array leaves, by name (for logs: "bfloat16")."""
    arrays, _ = _array_tree(model)
    names = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(arrays) if jnp.issubdtype(x.dtype, jnp.floating)}
    return sorted(names)


def cast_for_publish(model, dtype):
    """`model` with every floating array leaf in `dtype`: what a weight version carries when rollouts sample
    in another dtype than the trainer's parameters (docs/weight_transfer.md, "Dtype"). One jitted cast of
    all leaves, each output laid out exactly as its input (a sharded parameter stays sharded: no gather,
    and on several hosts every process casts its own shards). `model` itself when nothing needs a cast
    (float32 rollouts of float32 parameters cost nothing). Integer leaves are never touched."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"the publish dtype must be a float dtype, got {dtype.name}")
    arrays, static = eqx.partition(model, lambda x: eqx.is_inexact_array(x) and jnp.dtype(x.dtype) != dtype)
    leaves, treedef = jax.tree.flatten(arrays)
    if not leaves:
        return model
    if all(isinstance(x, jax.Array) for x in leaves):
        cast = _caster(dtype.name, tuple(x.sharding for x in leaves))(leaves)
    else:  # host (NumPy) leaves: nothing to keep in place
        cast = [np.asarray(x).astype(dtype) for x in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, cast), static)


@functools.lru_cache(maxsize=8)
def _caster(dtype_name: str, shardings: tuple):
    """The jitted cast for one model's leaf layouts (compiled once per run, not per publish)."""
    dtype = jnp.dtype(dtype_name)
    return jax.jit(lambda xs: [x.astype(dtype) for x in xs], out_shardings=list(shardings))


def is_fully_addressable(model) -> bool:
    arrays, _ = _array_tree(model)
    return all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in jax.tree.leaves(arrays))


class ModelSkeleton:
    """What a client needs to rebuild a model: its structure, its static (non-array) fields, and
    each array leaf's name, shape, dtype and placement. Holds no array data.

    Leaves that are `jax.Array`s (or `jax.ShapeDtypeStruct`s with a sharding) in the model given are
    loaded with the same sharding; other array leaves (NumPy) are loaded onto the default device.
    """

    def __init__(self, model):
        arrays, self._static = _array_tree(model)
        leaves, self._treedef = jax.tree.flatten(arrays)
        self.names: list[str] = leaf_names(arrays)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [np.dtype(x.dtype) for x in leaves]
        self.shardings = [x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None for x in leaves]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    def check(self, names: Sequence[str], shapes: Sequence[tuple], dtypes: Sequence, where: str) -> None:
        """Raises WeightFormatError naming `where` and the first leaf that does not fit."""
        if list(names) != self.names:
            missing = sorted(set(self.names) - set(names))[:3]
            extra = sorted(set(names) - set(self.names))[:3]
            raise WeightFormatError(f"{where}: leaves do not match the model (missing {missing}, unexpected {extra})")
        for name, shape, dtype, want_shape, want_dtype in zip(names, shapes, dtypes, self.shapes, self.dtypes):
            if tuple(shape) != want_shape or np.dtype(dtype) != want_dtype:
                raise WeightFormatError(
                    f"{where}: leaf {name} is {np.dtype(dtype).name}{list(shape)}, the model expects "
                    f"{want_dtype.name}{list(want_shape)}"
                )

    def build(self, names: Sequence[str], arrays: Sequence, where: str):
        """The model with these arrays, placed like the skeleton's leaves; waits until they are there."""
        self.check(names, [a.shape for a in arrays], [a.dtype for a in arrays], where)
        placed = [self._place(a, sharding) for a, sharding in zip(arrays, self.shardings)]
        jax.block_until_ready(placed)
        return eqx.combine(jax.tree.unflatten(self._treedef, placed), self._static)

    @staticmethod
    def _place(array, sharding):
        if sharding is None:
            return jax.device_put(array)
        if isinstance(array, jax.Array):
            return array if array.sharding == sharding else jax.device_put(array, sharding)
        # Works for a sharding over several hosts too: each host copies the slices its devices hold.
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


# ----------------------------------------------------------------------------- server


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    version: VersionId
    location: str
    bytes: int
    seconds: float


class WeightTransferServer(abc.ABC):
    """The trainer's side. `publish` raises WeightPublishError naming the location on failure."""

    location: str
    epoch: int

    def __init__(self) -> None:
        self.last_published: VersionId | None = None
        self.versions_published = 0
        self.last_bytes = 0
        self.last_publish_s = 0.0

    def publish(self, model, weight_step: int) -> PublishedVersion:
        """Makes `model` the newest version, `weight_step` (0 = the initial weights).

        Steps of one server instance must increase; a restarted trainer builds a new server,
        whose epoch makes its versions newer than the old instance's whatever their steps.
        """
        if isinstance(weight_step, bool) or not isinstance(weight_step, (int, np.integer)) or weight_step < 0:
            raise ValueError(f"weight_step must be an integer >= 0, got {weight_step!r}")
        weight_step = int(weight_step)
        if self.last_published is not None and weight_step <= self.last_published.weight_step:
            raise ValueError(
                f"weight_step {weight_step} is not above {self.last_published.weight_step}, which this server "
                f"already published to {self.location}; a restarted trainer must build a new server"
            )
        version = VersionId(self.epoch, weight_step)
        start = time.perf_counter()
        try:
            where, nbytes = self._publish(version, model)
        except WeightPublishError:
            raise
        except Exception as e:
            raise WeightPublishError(f"publishing {version} to {self.location} failed: {e!r}") from e
        seconds = time.perf_counter() - start
        self.last_published = version
        self.versions_published += 1
        self.last_bytes, self.last_publish_s = nbytes, seconds
        logger.info("published %s to %s: %.1f MB of %s weights in %.3f s", version, where, nbytes / 1e6,
                    "/".join(floating_dtypes(model)) or "no floating", seconds)
        return PublishedVersion(version, where, nbytes, seconds)

    @abc.abstractmethod
    def _publish(self, version: VersionId, model) -> tuple[str, int]:
        """Makes `model` visible as `version`; returns (where it went, bytes)."""

    @property
    def metrics(self) -> dict[str, float]:
        return {"publish_s": self.last_publish_s, "bytes": self.last_bytes,
                "versions_published": self.versions_published}

    def close(self) -> None:  # noqa: B027  # optional hook: servers that hold nothing need not close
        """Releases what the server holds (a no-op where it holds nothing)."""


# ----------------------------------------------------------------------------- client

WAIT_FIRST_INTERVAL_S = 0.01
WAIT_MAX_INTERVAL_S = 0.05  # a waiting rollout worker sees new weights within 50 ms (on-policy waits every step)
POINTER_READS_PER_S = 200.0
"""The pointer reads per second a whole fleet of waiting rollout hosts may make together (`PollBackoff`)."""


class PollBackoff:
    """The sleeps of a client waiting for weights: from `WAIT_FIRST_INTERVAL_S`, doubling up to a cap that
    keeps the fleet's reads of the pointer under `reads_per_s` in all, `max(WAIT_MAX_INTERVAL_S,
    fleet_size / reads_per_s)` (50 ms up to 10 hosts at the default, 1.28 s at 256), each sleep
    multiplied by a uniform draw in [0.5, 1.5] so that hosts which started waiting together spread out.
    Pointer reads per second then stay bounded however many hosts wait (docs/scaling.md, "A fleet of
    rollout hosts")."""

    def __init__(self, fleet_size: int = 1, reads_per_s: float = POINTER_READS_PER_S, seed=None):
        if fleet_size < 1 or reads_per_s <= 0:
            raise ValueError(f"PollBackoff: fleet_size must be >= 1 and reads_per_s > 0, got {fleet_size}, "
                             f"{reads_per_s}")
        self.cap_s = max(WAIT_MAX_INTERVAL_S, fleet_size / reads_per_s)
        self._rng = np.random.default_rng(seed)
        self._interval = WAIT_FIRST_INTERVAL_S

    def reset(self) -> None:
        self._interval = WAIT_FIRST_INTERVAL_S

    def next(self) -> float:
        """The next sleep, jittered; the interval behind it doubles up to the cap."""
        sleep = self._interval * float(self._rng.uniform(0.5, 1.5))
        self._interval = min(2 * self._interval, self.cap_s)
        return sleep


class WeightTransferClient(abc.ABC):
    """The rollout side. `poll` never raises: a failed transfer keeps the old weights and is counted.

    The client holds the newest model it received (`model`, `weight_step`, `version`); before the
    first one arrives they are None.
    """

    location: str

    def __init__(self, skeleton) -> None:
        self.skeleton = skeleton if isinstance(skeleton, ModelSkeleton) else ModelSkeleton(skeleton)
        self.model = None
        self.version: VersionId | None = None
        self.versions_received = 0
        self.failures = 0
        self.last_transfer_s = 0.0
        self.last_bytes = 0
        self._ignored: VersionId | None = None

    @property
    def weight_step(self) -> int | None:
        return None if self.version is None else self.version.weight_step

    @abc.abstractmethod
    def _latest(self) -> tuple[VersionId, Any] | None:
        """The newest published version and a handle to fetch it with, or None if none is published."""

    @abc.abstractmethod
    def _fetch(self, version: VersionId, handle) -> tuple[Any, int, VersionId] | None:
        """Loads the version `handle` refers to into a model like the skeleton: (model, bytes, the version
        loaded), which a delta chain that breaks may leave older than `version` (but newer than the one
        held); None if nothing newer than the version held can be loaded."""

    def poll(self) -> WeightUpdate | None:
        """Returns the newest version if it is newer than the one held, else None. Never raises."""
        try:
            latest = self._latest()
            if latest is None:
                return None
            version, handle = latest
            if self.version is not None and version <= self.version:
                if version < self.version and version != self._ignored:
                    self._ignored = version
                    logger.warning("ignoring %s at %s: older than the %s held", version, self.location, self.version)
                return None
            start = time.perf_counter()
            fetched = self._fetch(version, handle)
            seconds = time.perf_counter() - start
            if fetched is None:
                return None
            model, nbytes, version = fetched
        except Exception as e:  # noqa: BLE001 - any failed transfer keeps the old weights
            self.failures += 1
            logger.warning("weight transfer from %s failed (%d so far); keeping %s: %s",
                           self.location, self.failures, self.version, e, exc_info=logger.isEnabledFor(logging.DEBUG))
            return None
        if self.version is not None and version.epoch != self.version.epoch:
            logger.warning("trainer restarted: accepting %s after %s", version, self.version)
        self.model, self.version = model, version
        self.versions_received += 1
        self.last_transfer_s, self.last_bytes = seconds, nbytes
        logger.info("received %s from %s: %.1f MB (%s weights) in %.3f s", version, self.location, nbytes / 1e6,
                    "/".join(floating_dtypes(model)) or "no floating", seconds)
        return WeightUpdate(model, version.weight_step)

    def wait_for(self, min_step: int, timeout_s: float, backoff: PollBackoff | None = None) -> WeightUpdate:
        """Polls, backing off (`backoff`: one host's share of the fleet's pointer reads), until the client
        holds weights of step >= `min_step`, and returns them.

        Always polls at least once, so a restarted trainer's lower step replaces what is held before
        the comparison. Raises WeightWaitTimeout after `timeout_s` seconds.
        """
        deadline = time.monotonic() + timeout_s
        backoff = backoff or PollBackoff()
        backoff.reset()
        while True:
            self.poll()
            if self.version is not None and self.version.weight_step >= min_step:
                return WeightUpdate(self.model, self.version.weight_step)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WeightWaitTimeout(
                    f"no weights of step >= {min_step} at {self.location} after {timeout_s:.1f} s "
                    f"(holding {self.version or 'nothing'}; {self.failures} failed transfers)"
                )
            self.wait_for_news(threading.Event(), backoff, remaining)

    def wait_for_news(self, stop: threading.Event, backoff: PollBackoff, max_s: float = math.inf) -> None:
        """Blocks until a version newer than the one held may be there for `poll`, `stop` is set, or
        `max_s` passed. Storage can only be asked again: this sleeps the backoff's next interval (a relayed
        client is told instead, `transfer/relay.py`)."""
        stop.wait(min(backoff.next(), max_s))

    @property
    def metrics(self) -> dict[str, float]:
        out = {"transfer_s": self.last_transfer_s, "bytes": self.last_bytes,
               "versions_received": self.versions_received, "failures": self.failures}
        if self.version is not None:
            out["weight_step"] = self.version.weight_step
        return out

    def close(self) -> None:  # noqa: B027  # optional hook: clients that hold nothing need not close
        """Releases what the client holds besides its model (a no-op where it holds nothing)."""
