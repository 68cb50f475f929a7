"""The test suite under load: fresh clones of this repository run `.ci/run` one after another while CPU
burners (busy processes, `stress`-style) run beside them, and the load average is sampled the whole time.
A test that passes only on a quiet machine (a fixed wait, a learning bar that depends on timing) fails
here. Stops at the first red run: the point is N green runs in a row (docs/performance.md, "The suite
under load").

    python bench/loaded_suite.py [--runs 3] [--burners 2] [--rev HEAD] [--workdir DIR] [--keep]

Prints one JSON line per run (rc, seconds, pytest's summary line, the 1-minute load average's median /
min / max and the share of samples at or above `--min_load`) and a last line with the machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


RAY_WORKER_NICENESS = 15
"""Ray starts its workers (every actor of a job) at this niceness: a burner at the default 0 would take the
CPU from them almost entirely (weights 1024 vs 36), starving the job rather than loading the machine."""


def _burn(stop, niceness: int) -> None:
    os.nice(niceness)
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


class Burners:
    """`n` busy processes, at Ray's worker niceness, until `stop()`."""

    def __init__(self, n: int, niceness: int = RAY_WORKER_NICENESS):
        self._stop = multiprocessing.Event()
        self._procs = [multiprocessing.Process(target=_burn, args=(self._stop, niceness), daemon=True)
                       for _ in range(n)]
        for p in self._procs:
            p.start()

    def stop(self) -> None:
        self._stop.set()
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


class LoadSampler:
    """The 1-minute load average every `period_s` seconds, in a thread."""

    def __init__(self, period_s: float):
        self.samples: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._done.wait(period_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> list[float]:
        self._done.set()
        self._thread.join()
        return self.samples


def pytest_summary(log: str) -> str:
    """pytest's last `N passed, ...` line ('' if it printed none)."""
    lines = [ln.strip().strip("=").strip() for ln in log.splitlines()]
    hits = [ln for ln in lines if (" passed" in ln or " failed" in ln or " error" in ln) and " in " in ln]
    return hits[-1] if hits else ""


def load_stats(samples: list[float], min_load: float) -> dict:
    if not samples:
        return {"load_samples": 0}
    return {"load_samples": len(samples), "load_median": round(statistics.median(samples), 2),
            "load_min": round(min(samples), 2), "load_max": round(max(samples), 2),
            "load_at_least_min": round(sum(s >= min_load for s in samples) / len(samples), 3)}


def one_run(index: int, rev: str, workdir: pathlib.Path, command: str, burners: int, period_s: float,
            min_load: float, keep: bool) -> dict:
    clone = workdir / f"run-{index}"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", rev], cwd=clone, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True,
                            text=True, check=True).stdout.strip()
    log_path = workdir / f"run-{index}.log"
    burn, sampler = Burners(burners), LoadSampler(period_s)
    start = time.monotonic()
    try:
        with open(log_path, "w") as log:
            rc = subprocess.run(command, shell=True, cwd=clone, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "CI": "true"}).returncode
    finally:
        seconds = time.monotonic() - start
        burn.stop()
        samples = sampler.stop()
    result = {"run": index, "commit": commit, "rc": rc, "seconds": round(seconds, 1),
              "pytest": pytest_summary(log_path.read_text(errors="replace")), "burners": burners,
              **load_stats(samples, min_load), "log": str(log_path)}
    if not keep and rc == 0:
        shutil.rmtree(clone, ignore_errors=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--burners", type=int, default=2, help="busy processes beside each run")
    parser.add_argument("--rev", default="HEAD", help="the commit each fresh clone checks out")
    parser.add_argument("--command", default="bash .ci/run", help="what each clone runs (in its root, CI=true)")
    parser.add_argument("--workdir", default=None, help="where the clones and logs go (default: a temp dir)")
    parser.add_argument("--sample_s", type=float, default=30.0, help="seconds between load samples")
    parser.add_argument("--min_load", type=float, default=4.0, help="the load each run should see")
    parser.add_argument("--keep", action="store_true", help="keep green runs' clones")
    args = parser.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", args.rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="loaded-suite-"))
    workdir.mkdir(parents=True, exist_ok=True)
    green = 0
    for index in range(1, args.runs + 1):
        result = one_run(index, rev, workdir, args.command, args.burners, args.sample_s, args.min_load, args.keep)
        print(json.dumps(result), flush=True)
        if result["rc"] != 0:
            break
        green += 1
    from machine import machine

    print(json.dumps({"green_in_a_row": green, "runs": args.runs, "machine": machine()}), flush=True)
    return 0 if green == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
