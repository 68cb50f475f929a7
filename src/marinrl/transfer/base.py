"""Weight transfer: the contract between the trainer (server) and the rollout workers (clients).

The trainer calls `server.publish(model, weight_step)`; each rollout worker calls `client.poll()`,
which returns the newest published version or nothing, and `client.wait_for(min_step, timeout_s)`
in on-policy mode. Modes (filesystem, Ray object store) are registered choices of
`WeightTransferConfig`; adding one touches one file.

Versions are ordered by `VersionId(epoch, weight_step)`. The epoch belongs to one server instance
(it is set when the server starts, later than any epoch already published), so a restarted trainer
that publishes a lower weight step is still newer, while a lower step from the same server
instance, or anything from an older server instance, never is. Docs: docs/weight_transfer.md.

A model as the named arrays a version carries is `model_leaves.py`; the errors are `errors.py` (both
re-exported here).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import threading
import time
from typing import Any, NamedTuple

import numpy as np

from marinrl.transfer.errors import (  # noqa: F401  (re-exported: the contract's names in one place)
    WeightFormatError,
    WeightPublishError,
    WeightTransferError,
    WeightWaitTimeout,
)
from marinrl.transfer.model_leaves import (  # noqa: F401  (re-exported)
    ModelSkeleton,
    cast_for_publish,
    floating_dtypes,
    host_leaves,
    is_fully_addressable,
    leaf_names,
)

logger = logging.getLogger(__name__)


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
