"""Where a job's first step goes: one `startup:` line per actor log with the wall time of each phase.

The job passes the wall-clock time at which `RLJob.run()` began to every actor; each actor's
`StartupClock` starts from it, so its first phase (`ready`: Ray start, the actor's process, its
imports) is measured from the same origin on every actor of a host. Later phases are each the time
since the previous mark. docs/performance.md ("First step") reads these lines.

    clock = StartupClock(origin=job_started_at)   # in the actor's __init__: marks "ready"
    clock.mark("state")                            # after each phase
    clock.log(logger, "trainer")                   # once: "startup: ready=31.2s state=4.1s ... total=52.0s"

The line ends with the process's resident memory after each phase (MB), which shows what startup
loads (imports, the model, the reference, compiled programs) beside its peak (VmHWM).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional

import psutil


class StartupClock:
    """Phase durations of one process's startup, in the order they were marked."""

    def __init__(self, origin: Optional[float] = None):
        self.origin = time.time() if origin is None else float(origin)
        """Wall-clock time (time.time()) the phases count from: `RLJob.run()`'s start, or now."""
        self.phases: dict[str, float] = {}
        self.rss_mb: dict[str, float] = {}
        """Resident memory of this process at the end of each phase."""
        self._last = self.origin
        self._logged = False
        if origin is not None:
            self.mark("ready")

    def mark(self, phase: str, seconds: Optional[float] = None) -> None:
        """End `phase` now (its duration: the time since the previous mark), or record `seconds` for a
        phase measured elsewhere (the clock's position moves on by that much)."""
        now = time.time()
        duration = now - self._last if seconds is None else float(seconds)
        self.phases[phase] = self.phases.get(phase, 0.0) + duration
        self.rss_mb[phase] = psutil.Process().memory_info().rss / 2**20
        self._last = now if seconds is None else self._last + duration

    @property
    def total(self) -> float:
        return self._last - self.origin

    def summary(self) -> str:
        parts = " ".join(f"{k}={v:.2f}s" for k, v in self.phases.items())
        rss = " ".join(f"{k}={v:.0f}" for k, v in self.rss_mb.items())
        return f"startup: {parts} total={self.total:.2f}s; rss MB: {rss} peak={_peak_rss_mb():.0f}"

    def log(self, log: logging.Logger, role: str) -> None:
        """Log the summary once (later calls do nothing)."""
        if not self._logged:
            self._logged = True
            log.info("%s (%s)", self.summary(), role)


def import_tensorboardx_without_torch() -> None:
    """Import tensorboardX (Levanter's TensorBoard tracker) with torch hidden, where the actors run with
    USE_TORCH=0 (marinrl/job/rl_job.py `actor_env`). tensorboardX imports torch whenever it is installed, only
    to accept torch tensors as values; hidden, it takes numpy arrays (all we log) and the process skips
    torch: ~230 MB of resident memory and seconds of CPU (docs/performance.md, "Memory"). torch stays
    importable afterwards (Levanter's pytorch_model.bin reader imports it when it needs it). Call it
    before anything imports tensorboardX, from one thread (an actor's __init__)."""
    if os.environ.get("USE_TORCH", "").upper() not in ("0", "FALSE", "NO", "OFF"):
        return
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
    try:
        import tensorboardX.writer  # noqa: F401
    except ImportError:  # not installed: nothing to do
        pass
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def _peak_rss_mb() -> float:
    """VmHWM: the most resident memory this process has held (Linux; 0 where /proc has no such line)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
