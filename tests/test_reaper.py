"""The watchdog that takes a local job's processes with its driver (marinrl/job/reaper.py), on real
processes without Ray: a driver killed with SIGKILL takes the job's processes (marked, or descendants of
a marked one) within seconds and leaves its other one alone; a driver that stops its watchdog (after
ray.shutdown) has it sweep without a word.
The same on a real job: tests/test_job_faults.py::test_the_drivers_death_takes_its_local_ray_with_it. A local Ray whose
start times out is swept and started again (`RLJob._start_local_ray`)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

from job_process import alive, poll

from marinrl.job.reaper import OWNER_ENV, Reaper, job_processes

SRC = str(pathlib.Path(__file__).resolve().parent.parent / "src")

_SPAWN = textwrap.dedent("""
    import os, subprocess, sys, time
    env = {k: v for k, v in os.environ.items() if k != "MARINRL_RAY_OWNER"}  # as a retitled process's lost mark
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    time.sleep(float(sys.argv[1]))  # then exits: its child is handed to init, as a dead raylet's workers are
""")

_DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from marinrl.job.reaper import Reaper
    reaper = Reaper(sys.argv[1])
    reaper.start()
    with reaper.marked():  # as around ray.init: what starts now is the job's
        job = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[4]], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    unmarked = int(job.stdout.readline())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # started after: not the job's
    print(job.pid, unmarked, other.pid, flush=True)
    if sys.argv[2] == "end":  # as after ray.shutdown, with stragglers left
        reaper.stop()
        print("stopped", flush=True)
    time.sleep(600)
""")


def _driver(token: str, how: str, job_s: float) -> tuple[subprocess.Popen, int, int, int]:
    """A driver with its watchdog, a marked process (living `job_s`) with an unmarked child, and an unmarked
    process of its own."""
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, token, how, _SPAWN, str(job_s)], stdout=subprocess.PIPE,
                            text=True, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC})
    job, child, other = map(int, proc.stdout.readline().split())
    return proc, job, child, other


def _kill(*pids: int) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_driver_takes_its_processes_and_no_other():
    """The child of a marked process is the job's though unmarked, and stays so once its parent is gone
    and init holds it (the watchdog saw it while the parent lived); the driver's other process is not."""
    token = os.urandom(8).hex()
    proc, job, child, other = _driver(token, "kill", job_s=3.0)
    try:
        assert list(job_processes(token)) == [job]  # the mark is in the job's process only
        poll(lambda: not alive(job), "the marked process to exit, handing its child to init", deadline_s=30)
        proc.kill()
        proc.wait(timeout=30)
        poll(lambda: not alive(child), "the job's process to be killed", deadline_s=30)
        assert alive(other)
        assert "the job's driver ended: killed 1 processes of its local Ray" in proc.stderr.read()  # at its exit
    finally:
        _kill(job, child, other)


def test_a_driver_that_stops_its_watchdog_has_it_sweep_quietly():
    token = os.urandom(8).hex()
    proc, job, child, other = _driver(token, "end", job_s=600.0)
    try:
        assert proc.stdout.readline().strip() == "stopped"
        assert not alive(job) and not alive(child)  # `job` a zombie until its driver reaps it
        assert alive(other) and proc.poll() is None
        watchdog = f"reaper.py {proc.pid} {token}"
        assert not [p for p in os.listdir("/proc") if p.isdigit() and watchdog in _cmdline(int(p))]  # it exited
    finally:
        proc.kill()
        proc.wait(timeout=30)
        _kill(job, child, other)
    assert "killed" not in proc.stderr.read()


def test_the_mark_is_this_block_only():
    reaper = Reaper("t0ken")
    before = os.environ.get(OWNER_ENV)
    with reaper.marked():
        assert os.environ[OWNER_ENV] == "t0ken"
    assert os.environ.get(OWNER_ENV) == before


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _timing_out_ray_init(times: int, started: list):
    """`ray.init` as a machine too busy for Ray's start has it: the first `times` calls start a process (as Ray
    starts its GCS and raylet, inside the watchdog's mark) and then fail as Ray does when its raylet does not
    register within its 30 s; a later call succeeds."""
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) <= times:
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started.append(proc)
            raise Exception("The current node timed out during startup. This could happen because some of the "
                            "raylet failed to startup or the GCS has become overloaded.")

    return init, calls


def test_a_local_ray_that_times_out_starting_is_swept_and_started_again(tmp_path, monkeypatch, capsys):
    import ray
    from test_job import job_config

    from marinrl.job import rl_job

    started: list = []
    init, calls = _timing_out_ray_init(2, started)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(rl_job, "LOCAL_RAY_BACKOFF_S", 0.01)
    job = rl_job.RLJob(job_config(tmp_path))
    job._start_local_ray(num_cpus=3)
    assert len(calls) == 3 and calls[-1]["address"] == "local" and calls[-1]["num_cpus"] == 3
    for proc in started:  # what each failed start left was swept before the next try
        proc.wait(timeout=30)
    out = capsys.readouterr().out
    assert "did not start within Ray's 30 s" in out and "(try 2 of 3)" in out and "(try 3 of 3)" in out, out
    job._reaper.stop()


def test_a_local_ray_that_never_starts_is_one_error_and_other_failures_are_not_retried(tmp_path, monkeypatch):
    import pytest
    import ray
    from test_job import job_config

    from marinrl.job import rl_job

    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(rl_job, "LOCAL_RAY_BACKOFF_S", 0.01)
    started: list = []
    init, calls = _timing_out_ray_init(99, started)
    monkeypatch.setattr(ray, "init", init)
    job = rl_job.RLJob(job_config(tmp_path))
    with pytest.raises(RuntimeError, match=r"local Ray did not start: 3 tries.*set ray\.address"):
        job._start_local_ray(num_cpus=2)
    assert len(calls) == rl_job.LOCAL_RAY_STARTS and job._reaper is None
    for proc in started:
        proc.wait(timeout=30)

    def broken(**kwargs):
        calls.append(kwargs)
        raise ValueError("object_store_memory is more than the machine has")

    calls.clear()
    monkeypatch.setattr(ray, "init", broken)
    with pytest.raises(ValueError, match="object_store_memory"):
        job._start_local_ray(num_cpus=2)
    assert len(calls) == 1  # not a start that timed out: no second try
