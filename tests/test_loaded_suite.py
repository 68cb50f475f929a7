"""bench/loaded_suite.py's harness (the suite under load, docs/performance.md): fresh clones run a
command in a row beside burners, stopping at the first red run, with the load sampled; checked here with
a short command instead of the whole suite."""

from __future__ import annotations

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import loaded_suite  # noqa: E402


def _run(tmp_path, capsys, command, runs=2):
    rc = loaded_suite.main(["--runs", str(runs), "--burners", "1", "--sample_s", "0.05", "--workdir", str(tmp_path),
                            "--command", command])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return rc, lines[:-1], lines[-1]


def test_green_runs_in_a_row_each_in_a_fresh_clone_with_the_load_sampled(tmp_path, capsys):
    # each clone is fresh: a file the previous run left does not exist when the next one starts
    command = ("test ! -e left_by_a_run && touch left_by_a_run && test \"$CI\" = true && test -e .ci/run "
               "&& sleep 0.3 && echo '=== 3 passed, 1 skipped in 0.31s ==='")
    rc, runs, summary = _run(tmp_path, capsys, command)
    assert rc == 0 and summary["green_in_a_row"] == 2 and summary["machine"]["cpus"] >= 1
    assert [r["rc"] for r in runs] == [0, 0] and all(r["pytest"] == "3 passed, 1 skipped in 0.31s" for r in runs)
    assert all(r["load_samples"] >= 1 and r["load_min"] <= r["load_median"] <= r["load_max"] for r in runs)
    assert runs[0]["commit"] == runs[1]["commit"] and not (tmp_path / "run-1").exists()  # green clones removed


def test_the_first_red_run_stops_the_series_and_keeps_its_clone(tmp_path, capsys):
    rc, runs, summary = _run(tmp_path, capsys, "echo '1 failed, 2 passed in 0.1s'; exit 3", runs=3)
    assert rc == 1 and summary["green_in_a_row"] == 0
    assert [(r["run"], r["rc"], r["pytest"]) for r in runs] == [(1, 3, "1 failed, 2 passed in 0.1s")]
    assert (tmp_path / "run-1" / ".ci" / "run").exists()  # kept for reading


def test_burners_keep_the_cpu_busy_at_ray_workers_niceness_until_stopped():
    import psutil

    burners = loaded_suite.Burners(2)
    procs = [psutil.Process(p.pid) for p in burners._procs]
    assert all(p.is_running() for p in procs)
    want = min(19, psutil.Process().nice() + loaded_suite.RAY_WORKER_NICENESS)  # added to the parent's, capped
    deadline = time.monotonic() + 60  # os.nice runs first thing in the child: poll until it has
    while any(p.nice() != want for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.nice() for p in procs] == [want, want]
    burners.stop()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)


def test_pytest_summary_and_load_stats():
    log = "x\n==== 1 failed, 1023 passed, 3 warnings in 4861.20s (1:21:01) ====\nmake: *** [test] Error 1\n"
    assert loaded_suite.pytest_summary(log) == "1 failed, 1023 passed, 3 warnings in 4861.20s (1:21:01)"
    assert loaded_suite.pytest_summary("no summary") == ""
    stats = loaded_suite.load_stats([3.0, 5.0, 4.0, 6.0], min_load=4.0)
    assert stats == {"load_samples": 4, "load_median": 4.5, "load_min": 3.0, "load_max": 6.0, "load_at_least_min": 0.75}
