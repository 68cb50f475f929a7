"""`marinrl report` on a real short RLJob run (local Ray, two lessons): the page and plots exist and
their numbers are the run's."""

from __future__ import annotations

import pathlib
import re
import statistics

from test_job import ECHO, job_config

from marinrl.cli import main as cli_main
from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.config.env import EnvConfig
from marinrl.job.rl_job import RLJob
from marinrl.report.page import load_run, read_json_logs
from marinrl.storage.rollouts import summarize

PARITY = LessonConfig(lesson_id="parity", env=EnvConfig("parity", {"n_bits": 2}), max_tokens=1, graduate_at=None)


def _cell(page: str, header: str) -> str:
    m = re.search(rf"<th>{re.escape(header)}</th><td>([^<]*)</td>", page)
    assert m, f"no row {header!r} in the page"
    return m.group(1)


def test_report_of_a_real_run(tmp_path, ray_session, capsys):
    cfg = job_config(tmp_path, num_train_steps=4, max_staleness=1, eval_every=2,
                     curriculum=CurriculumConfig(lessons=(ECHO, PARITY)))
    result = RLJob(cfg).run()
    history = result.train["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    run_dir = pathlib.Path(cfg.run_dir)

    assert cli_main(["report", str(run_dir)]) == 0
    out_dir = run_dir / "report"
    assert str(out_dir / "index.html") in capsys.readouterr().out
    for png in ("reward_per_lesson.png", "response_length.png", "staleness.png", "step_time.png", "mismatch.png"):
        assert (out_dir / png).stat().st_size > 5000, png  # a drawn figure, not an empty file
    page = (out_dir / "index.html").read_text()
    for name in re.findall(r'src="([^"]+\.png)"', page):
        assert (out_dir / name).is_file(), name

    # The run's numbers.
    assert _cell(page, "trainer steps") == "4"
    assert _cell(page, "rollout workers") == "1"
    summary = summarize(f"{cfg.run_dir}/rollouts")
    assert _cell(page, "rollouts") == str(summary["totals"]["rollouts"]) == str(result.rollouts[0]["rollouts_written"])
    median_step = statistics.median(h["train/step_s"] for h in history if h["step"] >= 3)
    assert abs(float(_cell(page, "median seconds per step (steps ≥ 3)")) - median_step) < 2e-3
    median_wait = statistics.median(h["train/wait_s"] for h in history if h["step"] >= 3)
    assert abs(float(_cell(page, "median wait seconds")) - median_wait) < 2e-3

    # Every lesson the run sampled or evaluated has a row; rollout counts per lesson add up.
    trained = {env for env in summary["envs"]}  # env names equal lesson ids here
    evaluated = {lesson for e in result.rollouts[0]["evals"] for k in e["metrics"]
                 for lesson in ("echo", "parity") if k.startswith(f"eval/{lesson}/")}
    assert evaluated == {"echo", "parity"}
    for lesson in trained | evaluated:
        assert f"<tr><td>{lesson}</td>" in page, lesson
    for env, stats in summary["envs"].items():
        assert f"<tr><td>{env}</td><td>{stats['rollouts']}</td>" in page

    # Curriculum weights: a curve when the trackers hold `curriculum/<lesson>/weight`, else the page says
    # they are not logged (never an invented curve).
    logged_weights = {t for t in load_run(run_dir).trainer if t.startswith("curriculum/") and t.endswith("/weight")}
    if logged_weights:
        assert logged_weights == {"curriculum/echo/weight", "curriculum/parity/weight"}
        assert "curriculum_weights.png" in page and "Not logged" not in page
        assert (out_dir / "curriculum_weights.png").stat().st_size > 5000
    else:
        assert "curriculum_weights.png" not in page and "Not logged" in page
        assert not (out_dir / "curriculum_weights.png").exists()

    # The readers behind the page: tracker values equal the trainer's own history.
    by_step = {h["step"]: h for h in history}
    data = load_run(run_dir)
    assert "TensorBoard" in data.trainer_source
    for key in ("train/step_s", "train/update_s", "train/wait_s", "batch/staleness_max"):
        assert sorted(data.trainer[key]) == [1, 2, 3, 4]
        for step, value in data.trainer[key].items():
            assert abs(value - by_step[step][key]) < 1e-5, (key, step)
    # The trainer's Levanter JSON log lines hold the same numbers (0-based Levanter steps).
    logged = read_json_logs(run_dir / "logs")
    assert {s + 1: v for s, v in logged["train/step_s"].items()} == {s: h["train/step_s"] for s, h in by_step.items()}
    assert sum(st.n for st in data.lessons.values()) == result.rollouts[0]["rollouts_written"]
    assert {s for st in data.lessons.values() for s in st.rewards} <= set(range(5))

