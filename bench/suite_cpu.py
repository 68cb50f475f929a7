"""Where the test suite's CPU goes: one quiet fresh clone runs `.ci/run` while every process on the machine is
sampled from /proc, and the CPU seconds each used are summed by kind (pytest's workers, the jobs' trainer, rollout
and curriculum actors, Ray's own processes, the verifiers bridge, the processes tests start, the install). On a
machine the suite keeps busy, its wall time is this total over the cores it has, so the table says what a shorter
CI run must take away (docs/performance.md, "The suite under load").

    python bench/suite_cpu.py [--rev HEAD] [--workdir DIR] [--junit PATH] [--sample_s 0.25]

Prints one JSON line per kind (CPU seconds, share, processes, the median process's seconds) and a last line with
the run (rc, seconds, pytest's summary, total CPU seconds, mean busy cores) and the machine. `--junit` keeps
pytest's per-test times (`python tests/file_seconds.py PATH` refreshes the suite's ordering table from it). Run it
on a quiet machine: other processes are counted too (as "other")."""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

_TICK = os.sysconf("SC_CLK_TCK")

_JOB_ACTORS = (("TrainerActor", "job actors: trainer"), ("TrainerHostActor", "job actors: trainer"),
               ("RolloutActor", "job actors: rollout"), ("CurriculumActor", "job actors: curriculum"))
_RAY_PROCESSES = ("gcs_server", "raylet", "ray/dashboard/", "ray/_private/log_monitor", "ray/autoscaler/",
                  "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def kind(cmdline: str, comm: str) -> str:
    """The kind of a process, from its command line (its `ray::` title for an actor) and its `comm`."""
    if any(p in cmdline for p in _RAY_PROCESSES):
        return "Ray's own processes"
    if cmdline.startswith("ray::"):
        title = cmdline.split()[0]
        if title.startswith("ray::IDLE"):
            return "Ray workers never an actor"
        for name, label in _JOB_ACTORS:
            if f"{name}." in title or title.endswith(name):
                return label
        return "other Ray actors (tests', relays, coordinators)"
    if "default_worker.py" in cmdline:
        return "Ray workers never an actor"
    if ".venv-verifiers/" in cmdline:
        return "verifiers bridge"
    if "exec(eval(sys.stdin.readline()))" in cmdline or " -m pytest" in cmdline:
        return "pytest (workers and controller)"
    if "marinrl.cli" in cmdline or "/bin/marinrl " in cmdline:
        return "marinrl CLI drivers"
    if any(p in cmdline for p in ("/uv ", "pip install", "-m venv", "/ruff ")) or comm in ("uv", "ruff", "make"):
        return "install and lint"
    if "python" in comm or "python" in cmdline.split(" ", 1)[0]:
        return "other python (processes tests start)"
    return "other"


def _read(pid: str) -> tuple[str, str, float, str] | None:
    """(cmdline, comm, CPU seconds, start time in ticks) of `pid`, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return cmdline, comm, (int(fields[11]) + int(fields[12])) / _TICK, fields[19]


class ProcessCPU:
    """Samples every process's CPU time every `period_s` seconds in a thread, from now until `stop()`. A process
    seen at the first sample counts only what it used after it; a process's last `period_s` is missed, so short
    processes count a little low. A Ray worker's kind is its actor's title, kept once it has one."""

    def __init__(self, period_s: float = 0.25):
        self.seen: dict[tuple[str, str], list] = {}  # (pid, start) -> [cmdline, comm, first cpu, last cpu]
        self._first = True
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        me = str(os.getpid())
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            got = _read(pid)
            if got is None:
                continue
            cmdline, comm, cpu, start = got
            row = self.seen.get((pid, start))
            if row is None:
                self.seen[(pid, start)] = [cmdline, comm, cpu if self._first else 0.0, cpu]
                continue
            row[3] = max(row[3], cpu)
            named = row[0].startswith("ray::") and not row[0].startswith("ray::IDLE")
            if cmdline and not named and not (row[0].startswith("ray::") and cmdline.startswith("ray::IDLE")):
                row[0] = cmdline  # a Ray worker takes its actor's title after it starts
        self._first = False

    def _run(self, period_s: float) -> None:
        self._sample()
        while not self._done.wait(period_s):
            self._sample()

    def stop(self) -> list[tuple[str, str, float]]:
        """Every process seen: (cmdline, comm, CPU seconds used while sampled)."""
        self._done.set()
        self._thread.join()
        return [(cmd, comm, last - first) for cmd, comm, first, last in self.seen.values()]


def by_kind(processes: list[tuple[str, str, float]]) -> list[dict]:
    """One row per kind, most CPU first."""
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    for cmdline, comm, cpu in processes:
        if cpu > 0:
            seconds[kind(cmdline, comm)].append(cpu)
    total = sum(sum(v) for v in seconds.values()) or 1.0
    rows = [{"kind": k, "cpu_s": round(sum(v), 1), "share": round(sum(v) / total, 3), "processes": len(v),
             "median_process_cpu_s": round(statistics.median(v), 2)} for k, v in seconds.items()]
    return sorted(rows, key=lambda r: -r["cpu_s"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="the commit the fresh clone checks out")
    parser.add_argument("--command", default="bash .ci/run", help="what the clone runs (in its root, CI=true)")
    parser.add_argument("--workdir", default=None, help="where the clone and its log go (default: a temp dir)")
    parser.add_argument("--junit", default=None, help="write pytest's junit XML here (per-test seconds)")
    parser.add_argument("--sample_s", type=float, default=0.25, help="seconds between samples of /proc")
    args = parser.parse_args(argv)
    from loaded_suite import one_run
    from machine import machine

    rev = subprocess.run(["git", "rev-parse", args.rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="suite-cpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.junit:
        os.environ["PYTEST_ADDOPTS"] = f"{os.environ.get('PYTEST_ADDOPTS', '')} --junitxml={args.junit}".strip()
    sampler = ProcessCPU(args.sample_s)
    try:
        run = one_run(1, rev, workdir, args.command, burners=0, period_s=30.0, min_load=0.0, keep=False)
    finally:
        rows = by_kind(sampler.stop())
    for row in rows:
        print(json.dumps(row), flush=True)
    total = sum(r["cpu_s"] for r in rows)
    keep = ("rc", "commit", "seconds", "pytest", "load_median", "log")
    print(json.dumps({**{k: run.get(k) for k in keep}, "cpu_s": round(total, 1),
                      "busy_cores": round(total / run["seconds"], 2), "machine": machine()}), flush=True)
    return run["rc"]


if __name__ == "__main__":
    sys.exit(main())
