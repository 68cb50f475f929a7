"""One trainer over several JAX processes (one per host): joining them, feeding them one batch, and
ending all of them, with a resumable message, when one dies.

Every process calls `initialize` before anything touches JAX, then builds the same `TrainWorker`;
Levanter's Trainer runs SPMD over the global mesh of all processes' devices. What differs by process:

- **Batches: process 0 reads, then broadcasts.** The replay buffer is live (files keep arriving, and
  which ones a step sees depends on when it looks), so independent readers could pick different groups
  and the SPMD step would silently mix batches or hang. Process 0 alone owns the reader, the buffer and
  its cursor (so the checkpoint sidecar has one author); each step it posts a small header (stop flag,
  shapes, group ids) to the coordination service's key-value store, which the others wait on for as
  long as sampling takes, then the arrays go out in one collective (`broadcast_one_to_all`: ICI/DCN on a
  TPU slice, gloo on CPU) and every process builds the same global arrays from them.
- **Checkpoints: per-process shards, one commit.** Levanter's tensorstore checkpointer writes each
  process's shards and, after a barrier, process 0 writes `metadata.json`; process 0 alone writes our
  sidecar (and curriculum state) before it, and applies retention after.
- **Weights: per-process shards** (the filesystem transfer's `tensorstore` format, chosen by `auto` for
  a model no process holds whole): no host gathers the full model, each writes its own shards, process 0
  writes the one pointer after the barrier. All processes share process 0's server epoch (`agree`).
- **A dead peer ends everyone.** A killed process's TCP connections close at once, so each process keeps
  one socket to process 0 (process 0 one to each): a connection closing without a goodbye means a peer
  is gone; the survivor prints which, and the checkpoint a rerun resumes from, and exits with
  `PEER_LOST_EXIT_CODE`, whatever its main thread is blocked on (a collective, the key-value store, the
  replay buffer). A hung host whose sockets stay open is caught by JAX's own heartbeat
  (`heartbeat_timeout_s`), which ends the process with JAX's message instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from typing import Callable, Optional

import numpy as np

from marinrl.config.checks import require_at_least

logger = logging.getLogger(__name__)

__all__ = ["PEER_LOST_EXIT_CODE", "ProcessGroupConfig", "Cohort", "current_cohort", "initialize", "finish"]

PEER_LOST_EXIT_CODE = 75
"""EX_TEMPFAIL: the run did not fail by itself; rerunning the same config resumes it."""
_KEY_PREFIX = "marinrl"
_GOODBYE = b"B"


@dataclasses.dataclass(frozen=True)
class ProcessGroupConfig:
    """How this process joins the trainer's process group (one process per host)."""

    num_processes: int
    """Processes in the group (hosts of the training slice)."""
    process_id: int
    """This process's index, 0 .. num_processes - 1; process 0 hosts the coordinator."""
    coordinator_address: Optional[str] = None
    """host:port of process 0's coordination service; None: JAX detects it (a TPU slice, SLURM)."""
    cpu_devices: int = 0
    """CPU only (tests): fake devices this process contributes, with gloo collectives; 0: the real ones."""
    heartbeat_timeout_s: int = 100
    """JAX's heartbeat: a process silent this long (hung, its host unreachable) ends the group."""
    initialization_timeout_s: int = 300
    """How long `initialize` waits for every process to join."""

    def __post_init__(self):
        require_at_least(self, 1, "num_processes", "heartbeat_timeout_s", "initialization_timeout_s")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"ProcessGroupConfig.process_id must be in [0, {self.num_processes}), "
                             f"got {self.process_id}")
        require_at_least(self, 0, "cpu_devices")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise ValueError("ProcessGroupConfig.coordinator_address must be host:port, "
                             f"got {self.coordinator_address!r}")


class Cohort:
    """The processes of one trainer, as the TrainWorker sees them. This base class is one process."""

    process_id = 0
    num_processes = 1

    @property
    def is_leader(self) -> bool:
        """Process 0: reads rollouts, writes the sidecar, clocks the curriculum, logs."""
        return self.process_id == 0

    @property
    def multiprocess(self) -> bool:
        return self.num_processes > 1

    def barrier(self, name: str) -> None:
        """Returns once every process has called it with the same name."""

    def agree(self, name: str, value: str) -> str:
        """Process 0's `value`, on every process."""
        return value

    def share_batch(self, arrays: Optional[dict[str, np.ndarray]], groups: list[str], stop: bool):
        """(arrays, groups, stop) as process 0 gave them, on every process."""
        return arrays, groups, stop

    def set_resume_hint(self, hint: Callable[[], str]) -> None:
        """What to tell the user when a peer dies: which checkpoint a rerun resumes from."""


class _ProcessGroup(Cohort):
    def __init__(self, config: ProcessGroupConfig, client):
        self.process_id, self.num_processes = config.process_id, config.num_processes
        self._client = client
        self._counters: dict[str, int] = {}
        host = config.coordinator_address.rsplit(":", 1)[0] if config.coordinator_address else socket.gethostname()
        self._watch = _PeerWatch(self, host)

    def _key(self, name: str) -> str:
        n = self._counters.get(name, 0)
        self._counters[name] = n + 1
        return f"{_KEY_PREFIX}/{name}/{n}"

    def barrier(self, name: str) -> None:
        self._client.wait_at_barrier(self._key(f"barrier/{name}"), 24 * 3600 * 1000)

    def agree(self, name: str, value: str) -> str:
        key = self._key(f"agree/{name}")
        if self.is_leader:
            self._client.key_value_set(key, value)
            return value
        return self._client.blocking_key_value_get(key, 24 * 3600 * 1000)

    def share_batch(self, arrays, groups, stop):
        from jax.experimental import multihost_utils

        key = self._key("batch")
        if self.is_leader:
            header = {"stop": stop, "groups": groups,
                      "arrays": {} if arrays is None else {k: [list(v.shape), v.dtype.str] for k, v in arrays.items()}}
            self._client.key_value_set(key, json.dumps(header))
        else:  # waits as long as process 0's sampling does; a dead process 0 is the watch's business
            header = json.loads(self._client.blocking_key_value_get(key, 24 * 3600 * 1000))
        if header["stop"]:
            return None, header["groups"], True
        if not self.is_leader:
            arrays = {k: np.zeros(shape, np.dtype(dt)) for k, (shape, dt) in header["arrays"].items()}
        arrays = multihost_utils.broadcast_one_to_all(arrays)  # every process has read the header by now
        if self.is_leader:
            self._client.key_value_delete(key)
        return arrays, header["groups"], False

    def set_resume_hint(self, hint):
        self._watch.hint = hint

    def close(self) -> None:
        self.barrier("finish")
        self._watch.close()


class _PeerWatch:
    """Socket liveness between process 0 and each other process (a star): see the module docstring."""

    def __init__(self, group: _ProcessGroup, leader_host: str):
        self.group = group
        self.hint: Callable[[], str] = lambda: ""
        self._closing = threading.Event()
        self._conns: list[socket.socket] = []
        client = group._client
        if group.is_leader:
            server = socket.create_server(("", 0), backlog=group.num_processes)
            port = server.getsockname()[1]
            client.key_value_set(f"{_KEY_PREFIX}/peer_watch", f"{leader_host}:{port}")
            for _ in range(group.num_processes - 1):
                conn, _ = server.accept()
                peer = int(conn.recv(16).decode())
                self._watch(conn, peer)
            server.close()
        else:
            host, port = client.blocking_key_value_get(f"{_KEY_PREFIX}/peer_watch", 300_000).rsplit(":", 1)
            conn = socket.create_connection((host, int(port)), timeout=60)
            conn.settimeout(None)
            conn.sendall(f"{group.process_id:<16d}".encode())
            self._watch(conn, 0)

    def _watch(self, conn: socket.socket, peer: int) -> None:
        self._conns.append(conn)
        threading.Thread(target=self._wait_on, args=(conn, peer), daemon=True,
                         name=f"marinrl-peer-watch-{peer}").start()

    def _wait_on(self, conn: socket.socket, peer: int) -> None:
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if data == _GOODBYE or self._closing.is_set():
            return
        self._peer_lost(peer)

    def _peer_lost(self, peer: int) -> None:
        g = self.group
        try:
            hint = self.hint()
        except Exception as e:  # noqa: BLE001 - the message must go out regardless
            hint = f"(could not list the checkpoints: {e!r})"
        message = (f"[marinrl] trainer process {peer} of {g.num_processes} is gone (its connection to process "
                   f"{g.process_id} closed without a goodbye at {time.strftime('%H:%M:%S')}): ending process "
                   f"{g.process_id} too. Rerun the same config on all {g.num_processes} hosts to resume; {hint}")
        logger.error(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(PEER_LOST_EXIT_CODE)  # the main thread may be blocked in a collective that never returns

    def close(self) -> None:
        self._closing.set()
        for conn in self._conns:
            try:
                conn.sendall(_GOODBYE)
                conn.close()
            except OSError:
                pass


_cohort: Cohort = Cohort()


def current_cohort() -> Cohort:
    """The process group `initialize` joined; a one-process cohort if none."""
    return _cohort


def initialize(config: ProcessGroupConfig) -> Cohort:
    """Joins the process group: `jax.distributed.initialize`, then the peer watch. Call it before anything
    touches JAX (its device list is fixed by then)."""
    global _cohort
    import jax

    if config.cpu_devices:  # a forced device count inherited from the environment (a test session) would disagree
        os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                                         os.environ.get("XLA_FLAGS", "")).strip()
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", config.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.num_processes == 1:
        return _cohort
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                               initialization_timeout=config.initialization_timeout_s,
                               heartbeat_timeout_seconds=config.heartbeat_timeout_s)
    from jax._src import distributed

    _cohort = _ProcessGroup(config, distributed.global_state.client)
    logger.info("process %d of %d joined: %d global devices, %d local", config.process_id, config.num_processes,
                jax.device_count(), jax.local_device_count())
    return _cohort


def finish() -> None:
    """Leaves the group cleanly: once every process is here, goodbyes, then JAX's shutdown."""
    global _cohort
    if isinstance(_cohort, _ProcessGroup):
        import jax

        _cohort.close()
        _cohort = Cohort()
        jax.distributed.shutdown()


def levanter_trainer_config(trainer_config):
    """The trainer config as Levanter should see it here: in a process group `initialize` already joined,
    Levanter must not call `jax.distributed.initialize` again (it would on a TPU slice, which it detects)."""
    if not _cohort.multiprocess:
        return trainer_config
    from levanter.distributed import DistributedConfig

    return dataclasses.replace(trainer_config, distributed=DistributedConfig(initialize_jax_distributed=False))
