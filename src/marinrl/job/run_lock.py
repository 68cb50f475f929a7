"""One job per run: a lease file in the run folder names the job that holds the run.

`RLJob.run()` takes the lease before Ray starts and releases it when the job ends (normally, on an
exception, on Ctrl-C). A daemon thread renews it every `renew_every_s`. A second job on the same run
folder reads the lease and is refused with one line naming the holder (host, pid, since when), so two
trainers never write checkpoints and weights into one folder. A lease is stale, and taken over with a
warning, when its holder is a dead process on this host, or when it was not renewed for
`stale_after_renewals` renewal periods (a holder on another host that died, or a frozen one).

Every write is conditional (marinrl/storage/conditional.py): an exclusive create on local disk,
generation preconditions on gs://, so two jobs racing for a run get one lease. `marinrl lock check
gs://bucket/tmp` shows whether a store honours them: real GCS does, the in-process test emulator does not
(docs/storage.md, "One job per run"); `marinrl lock show RUN_DIR` (marinrl/cli/lock.py) names the holder.

This module imports no JAX, Ray or torch: a refused job, and `marinrl lock`, answer in well under a second.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from marinrl.storage.conditional import Store, open_store

logger = logging.getLogger(__name__)

LEASE_NAME = "run.lock"
"""The lease's file name in the run folder."""
LEASE_FORMAT_VERSION = 1


class RunLockHeld(RuntimeError):
    """Another live job holds the run; the message is one line naming it."""


class RunLockLost(RuntimeError):
    """This job's lease was taken over by another job (this one looked dead): it must stop."""


@dataclasses.dataclass(frozen=True)
class RunLockConfig:
    renew_every_s: float = 10.0
    """How often the holder rewrites its lease (a daemon thread in the driver)."""
    stale_after_renewals: int = 6
    """A lease not renewed for this many renewal periods is stale: another job takes it over."""

    def __post_init__(self):
        if not self.renew_every_s > 0:
            raise ValueError(f"renew_every_s must be > 0, got {self.renew_every_s}")
        if self.stale_after_renewals < 2:
            raise ValueError(f"stale_after_renewals must be >= 2 (one late renewal is not death), "
                             f"got {self.stale_after_renewals}")

    @property
    def stale_after_s(self) -> float:
        return self.renew_every_s * self.stale_after_renewals


@dataclasses.dataclass(frozen=True)
class Lease:
    """What the lease file holds (JSON)."""

    job_id: str
    """Unique per job (a uuid): tells this job's lease from another's on the same host and pid."""
    run_id: str
    host: str
    pid: int
    process_started_at: float
    """The holder process's start time (psutil): a reused pid on the same host is not the holder."""
    started_at: float
    """When the job took the lease (unix seconds)."""
    renewed_at: float
    stale_after_s: float
    """The holder's own staleness bound, so a job with other settings judges it the same way."""

    def to_json(self) -> bytes:
        return json.dumps({"format_version": LEASE_FORMAT_VERSION, **dataclasses.asdict(self)}).encode()

    @staticmethod
    def from_json(data: bytes, where: str) -> Lease:
        try:
            raw = json.loads(data)
            fields = {f.name for f in dataclasses.fields(Lease)}
            return Lease(**{k: raw[k] for k in fields})
        except Exception as e:  # noqa: BLE001 - a torn or foreign file: said, and treated as stale
            raise ValueError(f"{where}: not a run lease ({type(e).__name__}: {e})") from e

    def describe(self, now: float) -> str:
        since = datetime.datetime.fromtimestamp(self.started_at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"host {self.host}, pid {self.pid}, since {since} (renewed {max(0.0, now - self.renewed_at):.0f} s ago)"


def stale_reason(lease: Lease, now: float, host: Optional[str] = None) -> Optional[str]:
    """Why `lease` no longer holds its run, or None while its holder may be alive."""
    host = host or socket.gethostname()
    if lease.host == host and not _process_alive(lease.pid, lease.process_started_at):
        return f"its holder (pid {lease.pid}) is no longer running on this host"
    if now - lease.renewed_at > lease.stale_after_s:
        return f"it was not renewed for {now - lease.renewed_at:.0f} s (> {lease.stale_after_s:.0f} s)"
    return None


def _process_alive(pid: int, started_at: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - started_at) < 1.0  # a reused pid is another process
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # exists but not ours to inspect: assume alive
        return True


# ---------------------------------------------------------------------------- the lock


class RunLock:
    """The lease of one job on one run folder: `acquire()`, renewed by a daemon thread, `release()`.

        lock = RunLock(config.run_dir, config.run_id)
        lock.acquire()          # RunLockHeld (one line naming the holder) if a live job has the run
        try: ...                # lock.lost is set (and logged) if another job took the run over
        finally: lock.release()
    """

    def __init__(self, run_dir: str, run_id: str, config: RunLockConfig = RunLockConfig(),
                 storage_options: Optional[dict] = None):
        self.config = config
        self.run_id = run_id
        self._store, self.location = _store(run_dir, storage_options)
        self.job_id = uuid.uuid4().hex
        self._host = socket.gethostname()
        self._lease: Optional[Lease] = None
        self._token: object = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[str] = None
        """Set when another job took the run over: who holds it now (one line)."""
        self.renewals = 0

    def acquire(self, attempts: int = 5) -> Lease:
        """Takes the lease (a stale one with a warning) and starts renewing it; RunLockHeld if a live
        job holds it. A few attempts cover a concurrent taker racing this one."""
        import psutil

        now = time.time()
        self._lease = Lease(job_id=self.job_id, run_id=self.run_id, host=self._host, pid=os.getpid(),
                            process_started_at=psutil.Process().create_time(), started_at=now, renewed_at=now,
                            stale_after_s=self.config.stale_after_s)
        for _ in range(attempts):
            current = self._store.read()
            if current is None:
                self._token = self._store.create(self._lease.to_json())
            else:
                data, token = current
                try:
                    holder = Lease.from_json(data, self.location)
                except ValueError as e:
                    logger.warning("%s; taking the run over", e)
                    self._token = self._store.replace(self._lease.to_json(), token)
                else:
                    if holder.job_id == self.job_id:  # our own create, answered late (a retried request)
                        self._token = token
                        break
                    reason = stale_reason(holder, time.time(), self._host)
                    if reason is None:
                        raise RunLockHeld(_held_message(self.run_id, holder, self.location))
                    logger.warning("taking over run %r from a stale lease (%s; %s): %s", self.run_id,
                                   holder.describe(time.time()), reason, self.location)
                    self._token = self._store.replace(self._lease.to_json(), token)
            if self._token is not None:
                break
            time.sleep(0.05)  # another job wrote between our read and our write: judge its lease
        else:
            raise RunLockHeld(f"run {self.run_id!r}: could not take the lease {self.location} "
                              f"({attempts} attempts lost to concurrent jobs)")
        self._thread = threading.Thread(target=self._renew_loop, name=f"run-lock-{self.run_id}", daemon=True)
        self._thread.start()
        return self._lease

    def renew(self) -> bool:
        """Rewrites the lease with a new `renewed_at`; False (and `lost` set) if another job holds it."""
        assert self._lease is not None, "renew() before acquire()"
        current = self._store.read()
        if current is not None:
            try:
                holder = Lease.from_json(current[0], self.location)
            except ValueError:
                holder = None
            if holder is not None and holder.job_id != self.job_id:
                self._mark_lost(holder)
                return False
        lease = dataclasses.replace(self._lease, renewed_at=time.time())
        token = (self._store.replace(lease.to_json(), current[1]) if current is not None
                 else self._store.create(lease.to_json()))  # deleted by hand: take it back
        if token is None:  # changed between our read and our write: the next renewal reads who has it
            return True
        self._lease, self._token = lease, token
        self.renewals += 1
        return True

    def _mark_lost(self, holder: Lease) -> None:
        self.lost = f"another job took run {self.run_id!r} over: {holder.describe(time.time())}"
        logger.error("%s (lease %s); this job stops", self.lost, self.location)
        self._stop.set()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.config.renew_every_s):
            try:
                if not self.renew():
                    return
            except Exception as e:  # noqa: BLE001 - storage hiccup: the next period tries again
                logger.warning("renewing the run lease %s failed: %r", self.location, e)

    def release(self) -> None:
        """Stops renewing and deletes the lease if it is still this job's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._lease is None or self.lost:
            return
        try:
            current = self._store.read()
            if current is not None and Lease.from_json(current[0], self.location).job_id == self.job_id:
                self._store.delete(current[1])
        except Exception as e:  # noqa: BLE001 - the next job sees a stale lease and takes it over
            logger.warning("releasing the run lease %s failed: %r", self.location, e)
        self._lease = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _held_message(run_id: str, holder: Lease, location: str) -> str:
    return (f"run {run_id!r} is held by another job: {holder.describe(time.time())}; lease {location}. Wait for "
            f"that job to end or stop it (a lease not renewed for {holder.stale_after_s:.0f} s is taken over)")


def refuse_if_held(run_dir: str, run_id: str, storage_options: Optional[dict] = None) -> None:
    """RunLockHeld if a live job holds `run_dir`; takes nothing. The CLI calls it before the config's
    heavy imports so that a second job is refused in about a second; `RunLock.acquire` decides."""
    store, location = _store(run_dir, storage_options)
    current = store.read()
    if current is None:
        return
    try:
        holder = Lease.from_json(current[0], location)
    except ValueError:
        return
    if stale_reason(holder, time.time()) is None:
        raise RunLockHeld(_held_message(run_id, holder, location))


def _store(run_dir: str, storage_options: Optional[dict]) -> tuple[Store, str]:
    return open_store(f"{run_dir.rstrip('/')}/{LEASE_NAME}", storage_options)


def read_lease(run_dir: str, storage_options: Optional[dict] = None) -> Optional[Lease]:
    """The lease in `run_dir`, or None."""
    store, location = _store(run_dir, storage_options)
    current = store.read()
    return None if current is None else Lease.from_json(current[0], location)


if __name__ == "__main__":  # the tool is a subcommand (marinrl/cli/lock.py): the job layer never imports the CLI
    raise SystemExit("the run lock's tool is `marinrl lock show RUN_DIR` / `marinrl lock check URL`")
