"""bench/suite_cpu.py: the kinds it sums the suite's processes by, and its /proc sampler on a real process that
burns a known amount of CPU. No wall-clock figure is asserted."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import suite_cpu  # noqa: E402

VENV = "/repo/.venv/bin/python"


@pytest.mark.parametrize("cmdline, comm, expected", [
    ("ray::TrainerActor.__init__", "python", "job actors: trainer"),
    ("ray::TrainerHostActor.run", "python", "job actors: trainer"),
    ("ray::RolloutActor.run", "python", "job actors: rollout"),
    ("ray::fleet-curriculum-d9ea6e4a:CurriculumActor.__init__", "python", "job actors: curriculum"),
    ("ray::WeightCoordinator.latest", "python", "other Ray actors (tests', relays, coordinators)"),
    ("ray::IDLE", "python", "Ray workers never an actor"),
    (f"{VENV} /repo/.venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py --node-ip-address=x",
     "python", "Ray workers never an actor"),
    ("ray::DashboardAgent", "python", "Ray's own processes"),
    ("/repo/.venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --port=1", "gcs_server",
     "Ray's own processes"),
    (f"{VENV} -u /repo/.venv/lib/python3.11/site-packages/ray/_private/log_monitor.py --session-dir=x", "python",
     "Ray's own processes"),
    ("/repo/.venv-verifiers/bin/python -P /repo/src/marinrl/envs/verifiers_bridge.py serve {}", "python",
     "verifiers bridge"),
    (f"{VENV} -u -c import sys;exec(eval(sys.stdin.readline()))", "python", "pytest (workers and controller)"),
    (f"{VENV} -m pytest -q -n 2 --dist loadfile", "python", "pytest (workers and controller)"),
    (f"{VENV} -m marinrl.cli train /tmp/job.yaml", "python", "marinrl CLI drivers"),
    ("/repo/.venv/bin/uv pip install --quiet -e .[dev]", "uv", "install and lint"),
    (f"{VENV} /repo/experiments/grpo_math_qwen3_0p6b.py --dry_run", "python", "other python (processes tests start)"),
    ("/usr/bin/git clone -q . x", "git", "other"),
])
def test_each_process_of_the_suite_has_its_kind(cmdline, comm, expected):
    assert suite_cpu.kind(cmdline, comm) == expected


def test_by_kind_sums_each_kind_and_orders_them():
    rows = suite_cpu.by_kind([("ray::RolloutActor.run", "python", 3.0), ("ray::RolloutActor.run", "python", 1.0),
                              ("ray::TrainerActor.run", "python", 2.0), ("git status", "git", 0.0)])
    assert rows == [
        {"kind": "job actors: rollout", "cpu_s": 4.0, "share": 0.667, "processes": 2, "median_process_cpu_s": 2.0},
        {"kind": "job actors: trainer", "cpu_s": 2.0, "share": 0.333, "processes": 1, "median_process_cpu_s": 2.0}]


_BURN = ("import sys, time\n"
         "while time.process_time() < 0.5: pass\n"
         "print('burnt', flush=True)\n"
         "sys.stdin.read()\n")


def test_the_sampler_counts_what_a_process_burns_after_it_starts():
    """A child that burns 0.5 s of CPU, then idles until its stdin closes: the sampler, started before it, counts
    about those 0.5 s for it. /proc counts CPU in clock ticks the kernel charges statistically, so the bound is
    0.4 s, not the exact figure."""
    sampler = suite_cpu.ProcessCPU(period_s=0.05)
    child = subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"burnt"
        pid = str(child.pid)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # at least one sample after the burn
            rows = [r for (p, _), r in list(sampler.seen.items()) if p == pid]
            if rows and rows[0][3] - rows[0][2] >= 0.4:
                break
            time.sleep(0.05)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    processes = sampler.stop()
    (mine,) = [cpu for cmdline, comm, cpu in processes if cmdline.endswith("sys.stdin.read()")]  # /proc's, stripped
    assert 0.4 <= mine < 60
