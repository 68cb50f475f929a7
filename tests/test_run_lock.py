"""One job per run (marinrl/job/run_lock.py): the lease's content, renewal, refusal of a second job by a
live lease, takeover of a stale one, release; on local disk and on the GCS emulator.

The emulator ignores generation preconditions (checked below), so what rests on them alone (two jobs
racing to create or take over) is tested on local disk, where the exclusive create is real."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from marinrl.job.run_lock import (
    Lease,
    RunLock,
    RunLockConfig,
    RunLockHeld,
    read_lease,
    stale_reason,
)
from marinrl.storage.conditional import check_preconditions

FAST = RunLockConfig(renew_every_s=0.05, stale_after_renewals=4)


@pytest.fixture(params=["file", "gs"])
def run_dir(request, tmp_path) -> str:
    if request.param == "file":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs_root") + "/run"


def _wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _foreign_lease(run_dir: str, **fields) -> Lease:
    """Writes a lease of another job into `run_dir` (as that job would have) and returns it."""
    now = time.time()
    lease = Lease(**{**dict(job_id="other-job", run_id="r", host="elsewhere.example", pid=4242, process_started_at=0.0,
                            started_at=now - 100, renewed_at=now, stale_after_s=60.0), **fields})
    holder = RunLock(run_dir, "r")
    assert holder._store.create(lease.to_json()) is not None
    return lease


def test_the_lease_names_its_holder_and_is_renewed_then_released(run_dir):
    lock = RunLock(run_dir, "r", FAST)
    lease = lock.acquire()
    try:
        on_disk = read_lease(run_dir)
        assert (on_disk.job_id, on_disk.host, on_disk.pid) == (lock.job_id, socket.gethostname(), os.getpid())
        assert on_disk.started_at == lease.started_at and on_disk.stale_after_s == FAST.stale_after_s
        _wait_for(lambda: lock.renewals >= 2, "two renewals")
        renewed = read_lease(run_dir)
        assert renewed.job_id == lock.job_id and renewed.started_at == lease.started_at
        assert renewed.renewed_at > lease.renewed_at
    finally:
        lock.release()
    assert read_lease(run_dir) is None
    again = RunLock(run_dir, "r")
    again.acquire()  # free again
    again.release()


def test_a_second_job_is_refused_by_a_live_lease_with_one_line_naming_it(run_dir):
    first = RunLock(run_dir, "r", FAST)
    first.acquire()
    try:
        _wait_for(lambda: first.renewals >= 1, "a renewal")
        with pytest.raises(RunLockHeld) as refused:
            RunLock(run_dir, "r").acquire()
        message = str(refused.value)
        assert len(message.splitlines()) == 1
        assert f"host {socket.gethostname()}, pid {os.getpid()}, since " in message and "UTC" in message
        assert read_lease(run_dir).job_id == first.job_id  # the refused job wrote nothing
    finally:
        first.release()


def test_a_live_lease_of_another_host_is_refused(run_dir):
    _foreign_lease(run_dir)
    with pytest.raises(RunLockHeld, match="host elsewhere.example, pid 4242"):
        RunLock(run_dir, "r").acquire()


def test_a_lease_not_renewed_in_time_is_taken_over_with_a_warning(run_dir, caplog):
    _foreign_lease(run_dir, renewed_at=time.time() - 61.0, stale_after_s=60.0)
    lock = RunLock(run_dir, "r", FAST)
    with caplog.at_level(logging.WARNING, logger="marinrl.job.run_lock"):
        lock.acquire()
    try:
        assert read_lease(run_dir).job_id == lock.job_id
        assert any("taking over" in r.message and "not renewed for" in r.message and "elsewhere.example" in r.message
                   for r in caplog.records), caplog.text
    finally:
        lock.release()


def test_a_dead_holder_on_this_host_is_taken_over_at_once(run_dir, caplog):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    _foreign_lease(run_dir, host=socket.gethostname(), pid=dead_pid, renewed_at=time.time())
    lock = RunLock(run_dir, "r")
    with caplog.at_level(logging.WARNING, logger="marinrl.job.run_lock"):
        lock.acquire()
    try:
        assert read_lease(run_dir).pid == os.getpid()
        assert any(f"pid {dead_pid}) is no longer running" in r.message for r in caplog.records), caplog.text
    finally:
        lock.release()


def test_a_job_whose_lease_was_taken_over_notices_and_leaves_the_new_one(run_dir):
    lock = RunLock(run_dir, "r", FAST)
    lock.acquire()
    current = lock._store.read()
    now = time.time()
    taker = Lease(job_id="taker", run_id="r", host="elsewhere.example", pid=7, process_started_at=0.0,
                  started_at=now, renewed_at=now, stale_after_s=60.0)
    assert lock._store.replace(taker.to_json(), current[1]) is not None  # what a takeover writes
    _wait_for(lambda: lock.lost is not None, "the renewal thread to see the takeover")
    assert "host elsewhere.example, pid 7" in lock.lost
    lock.release()
    assert read_lease(run_dir).job_id == "taker"


def test_an_unreadable_lease_is_taken_over(run_dir):
    holder = RunLock(run_dir, "r")
    holder._store.create(b"{not json")
    lock = RunLock(run_dir, "r")
    lock.acquire()
    try:
        assert read_lease(run_dir).job_id == lock.job_id
    finally:
        lock.release()


def test_stale_reason_judges_pid_reuse_and_age():
    me = Lease(job_id="j", run_id="r", host=socket.gethostname(), pid=os.getpid(), process_started_at=0.0,
               started_at=0.0, renewed_at=time.time(), stale_after_s=60.0)
    assert "no longer running" in stale_reason(me, time.time())  # this pid, another start time: a reused pid
    import psutil

    alive = dataclasses.replace(me, process_started_at=psutil.Process().create_time())
    assert stale_reason(alive, time.time()) is None
    assert "not renewed" in stale_reason(alive, time.time() + 61.0)


def test_jobs_racing_for_a_free_run_on_local_disk_get_exactly_one_lease(tmp_path):
    run_dir = str(tmp_path / "run")
    locks = [RunLock(run_dir, "r") for _ in range(8)]
    outcomes: list = [None] * len(locks)
    start = threading.Barrier(len(locks))

    def take(i):
        start.wait()
        try:
            locks[i].acquire()
            outcomes[i] = "held"
        except RunLockHeld:
            outcomes[i] = "refused"

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(locks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("held") == 1 and outcomes.count("refused") == len(locks) - 1
    winner = locks[outcomes.index("held")]
    assert read_lease(run_dir).job_id == winner.job_id
    winner.release()


def test_local_disk_honours_every_precondition_and_the_emulator_none(tmp_path, gcs_root):
    assert check_preconditions(str(tmp_path)) == []
    # The in-process GCS emulator ignores ifGenerationMatch on create, overwrite and delete; real GCS
    # honours them (docs/storage.md says how to check a bucket with `marinrl lock check`).
    assert check_preconditions(gcs_root) == ["create over an existing object", "overwrite of a changed version",
                                             "delete of a changed version"]


def test_bad_lock_settings_are_refused():
    with pytest.raises(ValueError, match="renew_every_s"):
        RunLockConfig(renew_every_s=0)
    with pytest.raises(ValueError, match="stale_after_renewals"):
        RunLockConfig(stale_after_renewals=1)


def test_the_cli_refuses_a_second_train_on_a_held_run_with_exit_2_before_its_imports(tmp_path):
    """A live job (another process holding the lease) makes `marinrl train` exit 2 with one line naming
    it, before the config's imports (JAX, Levanter: seconds) and before anything of the job starts."""
    from test_cli_errors import _config

    config = _config(tmp_path)
    run_dir = tmp_path / "runs" / "quickstart"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from marinrl.job.run_lock import RunLock; "
         f"RunLock({str(run_dir)!r}, 'quickstart').acquire(); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run(
            [sys.executable, "-c", "import sys; from marinrl.cli import main\n"
             f"try:\n    main(['train', {config!r}])\nexcept SystemExit as e:\n"
             "    print('exit', e.code, 'job_config imported:', 'marinrl.config.job' in sys.modules)"],
            capture_output=True, text=True, env=env, timeout=120)
        assert second.stdout.strip() == "exit 2 job_config imported: False", second
        err = second.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"pid {holder.pid}, since " in err and f"host {socket.gethostname()}" in err, err
        assert json.loads((run_dir / "run.lock").read_text())["pid"] == holder.pid
        assert not (run_dir / "logs").exists() and not (run_dir / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_job_on_a_held_run_is_refused_before_ray_starts(tmp_path):
    """RLJob.run() itself (the API, without the CLI's early check) takes the lease before Ray."""
    import ray
    from test_job import job_config

    from marinrl.job.rl_job import RLJob

    cfg = job_config(tmp_path, run_id="held")
    _foreign_lease(cfg.run_dir, run_id="held")
    was_running = ray.is_initialized()
    with pytest.raises(RunLockHeld, match="host elsewhere.example, pid 4242"):
        RLJob(cfg).run()
    assert ray.is_initialized() == was_running  # no Ray started (nor shut down) for a refused job
    assert read_lease(cfg.run_dir).job_id == "other-job"


def test_a_superseded_trainer_is_not_told_to_rerun_its_config(tmp_path):
    """The weight publisher's "superseded" means another trainer publishes into this run now: rerunning
    would fight it, so the job's message says not to (marinrl/job/rl_job.py, `trainer_death_message`)."""
    import ray

    from marinrl.job.outcomes import trainer_death_message
    from marinrl.transfer.base import WeightPublishError

    cause = WeightPublishError("w/LATEST points to weight step 6 of a newer server (epoch 2 > this server's 1): "
                               "this trainer was superseded")
    error = ray.exceptions.RayTaskError("TrainerActor.run", "Traceback (most recent call last): ...", cause)
    message = trainer_death_message(error, str(tmp_path / "checkpoints"))
    assert message.startswith("the trainer died: WeightPublishError: ") and "superseded" in message
    assert "do not run this config again while it runs" in message and "run the same config again" not in message


# ---------------------------------------------------------------------------- `marinrl lock`


def _lock_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`marinrl lock ...` through the console script's main: (exit status, stdout, stderr)."""
    from marinrl.cli import main

    try:
        code = main(["lock", *argv])
    except SystemExit as e:  # an input error (2), or argparse's usage error
        code = e.code
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_lock_show_names_a_live_holder_and_says_when_the_next_job_takes_a_stale_one_over(run_dir, capsys):
    _foreign_lease(run_dir)  # another host, renewed now: live
    assert _lock_cli(["show", run_dir], capsys) == (
        0, f"{run_dir}: held by {read_lease(run_dir).describe(time.time())}; job other-job", "")
    stale_run = f"{run_dir}-stale"
    _foreign_lease(stale_run, renewed_at=time.time() - 100.0, stale_after_s=60.0)
    code, out, err = _lock_cli(["show", stale_run], capsys)
    assert (code, err) == (0, "")
    assert out.startswith(f"{stale_run}: stale lease of host elsewhere.example, pid 4242, since ")
    assert out.endswith("; job other-job: it was not renewed for 100 s (> 60 s); the next job on this run takes "
                        "it over")


def test_lock_show_of_a_free_run_and_of_a_dead_holder_on_this_host(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert _lock_cli(["show", str(run_dir)], capsys) == (0, f"{run_dir}: no lease (no job holds this run)", "")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _foreign_lease(str(run_dir), host=socket.gethostname(), pid=int(done.stdout))
    code, out, _ = _lock_cli(["show", str(run_dir)], capsys)
    assert code == 0 and f"stale lease of host {socket.gethostname()}, pid {int(done.stdout)}, " in out
    assert f"its holder (pid {int(done.stdout)}) is no longer running on this host" in out


def test_lock_show_of_a_run_root_names_its_runs_in_one_line(run_dir, capsys):
    root = run_dir.rsplit("/", 1)[0]
    _foreign_lease(f"{root}/b")
    _foreign_lease(f"{root}/a")
    code, out, err = _lock_cli(["show", root], capsys)
    assert (code, out) == (2, "")
    assert err == f"marinrl lock show: {root} is a run root, not a run folder: give one of its runs, {root}/a, {root}/b"


def test_lock_check_says_whether_a_store_honours_the_leases_writes_and_leaves_nothing(tmp_path, gcs_root, capsys):
    import gcsfs

    assert _lock_cli(["check", str(tmp_path)], capsys) == (0, f"{tmp_path}: preconditions honoured", "")
    assert list(tmp_path.iterdir()) == []
    assert _lock_cli(["check", gcs_root], capsys) == (
        1, f"{gcs_root}: IGNORES create over an existing object; overwrite of a changed version; delete of a "
           "changed version", "")
    assert gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True).find(gcs_root) == []


def test_lock_refuses_what_it_cannot_use_in_one_line_and_writes_nothing(tmp_path, capsys):
    missing, a_file, garbled, unreadable = (tmp_path / n for n in ("not-made", "job.yaml", "garbled", "unreadable"))
    a_file.write_text("x: 1")
    garbled.mkdir()
    (garbled / "run.lock").write_text("{not json")
    (unreadable / "run.lock").mkdir(parents=True)  # read as a file: an OSError, as root too
    answers = [_lock_cli(argv, capsys) for argv in (["check", str(missing)], ["show", str(missing)],
                                                    ["show", str(a_file)], ["show", str(garbled)],
                                                    ["show", str(unreadable)], ["show"], ["break", str(garbled)])]
    assert [code for code, _, _ in answers] == [2] * 7 and all(out == "" for _, out, _ in answers)
    errors = [err for _, _, err in answers]
    run_folder = "give a run folder, <run_root>/<run_id>"
    assert errors[:3] == [
        f"marinrl lock check: {missing}: no such folder; give an existing folder to try the writes in",
        f"marinrl lock show: {missing}: no such folder; {run_folder}",
        f"marinrl lock show: {a_file}: a file, not a folder; {run_folder}"]
    assert errors[3].startswith(f"marinrl lock show: {garbled}/run.lock: not a run lease (")
    assert errors[3].endswith("; if no job runs there, delete it") and len(errors[3].splitlines()) == 1
    assert errors[4] == (f"marinrl lock show: {unreadable}: cannot read its lease (IsADirectoryError: [Errno 21] "
                         f"Is a directory: '{unreadable}/run.lock'); give a run folder, <run_root>/<run_id> you can "
                         "read")
    assert "the following arguments are required: run_dir" in errors[5]
    assert "invalid choice: 'break'" in errors[6]
    assert not missing.exists() and (garbled / "run.lock").read_text() == "{not json"


def test_the_lock_console_script_answers_without_ray_jax_or_the_config_layer(tmp_path):
    """`marinrl lock show` in a fresh interpreter, as a user runs it: one line, none of the heavy imports."""
    run_dir = tmp_path / "runs" / "quickstart"
    _foreign_lease(str(run_dir))
    script = ("import sys; from marinrl.cli import main\n"
              f"code = main(['lock', 'show', {str(run_dir)!r}])\n"
              "print('exit', code, 'heavy:', sorted(m for m in ('ray', 'jax', 'levanter', 'marinrl.config.job') "
              "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "exit 0 heavy: []", done
    assert lines[0].startswith(f"{run_dir}: held by host elsewhere.example, pid 4242, since "), done
    console = subprocess.run([str(pathlib.Path(sys.executable).parent / "marinrl"), "lock", "show",
                              str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert (console.returncode, console.stderr.strip()) == (
        2, f"marinrl lock show: {tmp_path / 'nowhere'}: no such folder; give a run folder, <run_root>/<run_id>")


def test_running_the_lock_module_points_at_marinrl_lock_instead_of_doing_nothing():
    done = subprocess.run([sys.executable, "-m", "marinrl.job.run_lock", "show", "runs/demo"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert (done.returncode, done.stdout, done.stderr.strip()) == (
        1, "", "the run lock's tool is `marinrl lock show RUN_DIR` / `marinrl lock check URL`")
