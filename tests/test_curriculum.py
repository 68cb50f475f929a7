"""The curriculum: configuration checks, unlocking, graduation on a plateau, sampling weights, the
trainer-step clock, state round trips over fsspec, and the Ray actor (get-or-create, restart after a
kill resumes from the saved state) against a real local Ray."""

from __future__ import annotations

import io
import json
import logging
import os
import time
import uuid

import numpy as np
import pytest

from marinrl.config.curriculum import CurriculumConfig, LessonConfig, LessonDependency
from marinrl.config.env import EnvConfig
from marinrl.curriculum.actor import CurriculumClient, curriculum_actor, load_state, save_state
from marinrl.curriculum.lessons import Curriculum
from marinrl.envs.base import make_env
from marinrl.inference.context import lesson_sampling

ECHO = EnvConfig("echo", {"alphabet_size": 10})


def lesson(lesson_id: str, *deps: tuple[str, float], **kw) -> LessonConfig:
    return LessonConfig(lesson_id, ECHO, dependencies=tuple(LessonDependency(d, t) for d, t in deps), **kw)


def config(*lessons: LessonConfig, **kw) -> CurriculumConfig:
    return CurriculumConfig(lessons=tuple(lessons), **kw)


# ------------------------------------------------------------------------------ configuration


def test_unknown_dependency_is_an_error_naming_the_lesson():
    with pytest.raises(ValueError, match="lesson 'b' depends on unknown lesson 'nope'"):
        config(lesson("a"), lesson("b", ("nope", 0.5)))


@pytest.mark.parametrize(
    "lessons, cycle",
    [
        ([lesson("a", ("a", 0.5))], "a -> a"),
        ([lesson("root"), lesson("a", ("b", 0.5)), lesson("b", ("a", 0.5))], "a -> b -> a"),
        ([lesson("a", ("c", 0.1)), lesson("b", ("a", 0.1)), lesson("c", ("b", 0.1))], "a -> c -> b -> a"),
    ],
)
def test_dependency_cycles_are_errors_naming_the_cycle(lessons, cycle):
    with pytest.raises(ValueError, match=f"cycle: {cycle}"):
        config(*lessons)


def test_other_configuration_errors():
    with pytest.raises(ValueError, match=r"duplicate lesson ids \['a'\]"):
        config(lesson("a"), lesson("a"))
    with pytest.raises(ValueError, match="lessons is empty"):
        CurriculumConfig(lessons=())
    with pytest.raises(ValueError, match="half_life"):
        config(lesson("a"), half_life=0)
    with pytest.raises(ValueError, match="min_weight"):
        config(lesson("a"), min_weight=0)
    with pytest.raises(ValueError, match="lesson 'a': max_tokens"):
        lesson("a", max_tokens=0)
    with pytest.raises(ValueError, match="lesson 'a': plateau_window"):
        lesson("a", plateau_window=0)


def test_configuration_reads_from_yaml_with_draccus():
    import draccus

    yaml = """
lessons:
  - lesson_id: copy
    env: {name: echo, args: {alphabet_size: 10}}
    max_tokens: 1
  - lesson_id: parity
    env: {name: parity, args: {n_bits: 2}}
    dependencies: [{lesson_id: copy, reward_threshold: 0.7}]
    stop: ["\\n"]
half_life: 5
"""
    cfg = draccus.load(CurriculumConfig, io.StringIO(yaml))
    assert cfg.lesson("parity").dependencies == (LessonDependency("copy", 0.7),)
    assert make_env(cfg.lesson("copy").env).alphabet == "abcdefghij" and cfg.half_life == 5


def test_sampling_params_for_training_and_evaluation():
    from marinrl.models.tokenizers import byte_tokenizer

    tok = byte_tokenizer(512)
    x = lesson("a", temperature=0.8, max_tokens=4, stop=("\n\n", "."))
    train, ev = lesson_sampling(x, tok, "train"), lesson_sampling(x, tok, "eval")
    assert (train.temperature, ev.temperature, train.max_tokens) == (0.8, 0.0, 4)
    assert train.stop_sequences == ((10, 10), (46,)) == ev.stop_sequences


# ------------------------------------------------------------------------------ unlocking


def test_roots_start_active_and_dependents_unlock_at_their_threshold():
    c = Curriculum(config(lesson("a"), lesson("b", ("a", 0.6)), lesson("c", ("a", 0.6), ("b", 0.3))))
    assert [c.status(x) for x in "abc"] == ["active", "locked", "locked"]
    c.update_from_training("a", [0.5] * 8, step=1)
    assert c.status("b") == "locked"
    c.update_from_training("a", [1.0] * 8, step=1)  # same step: the step's mean is 0.75
    assert c.performance("a") == pytest.approx(0.75) and c.status("b") == "active"
    assert c.status("c") == "locked"  # needs b too
    c.update_from_training("b", [0.4] * 4, step=2)
    assert c.status("c") == "active"
    assert c.state_dict()["lessons"]["b"]["unlocked_at"] == 1


def test_performance_is_the_eval_mean_once_evaluated():
    c = Curriculum(config(lesson("a"), lesson("b", ("a", 0.8))))
    c.update_from_eval("a", [0.0, 1.0], step=1)      # greedy evaluation 0.5 ...
    c.update_from_training("a", [0.9] * 8, step=1)  # ... sampled success high: the evaluation rules
    assert c.performance("a") == 0.5 and c.status("b") == "locked"
    c.update_from_eval("a", [1.0] * 10, step=2)
    assert c.status("b") == "active"


# ------------------------------------------------------------------------------ the clock


def _feed(c: Curriculum, per_step: list[np.ndarray], calls_per_step: int) -> None:
    for step, rewards in enumerate(per_step, start=1):
        for chunk in np.array_split(rewards, calls_per_step):
            c.update_from_training("a", chunk.tolist(), step)


def test_one_trainer_step_is_one_iteration_however_many_workers_deliver_it():
    rng = np.random.default_rng(0)
    per_step = [rng.random(64) for _ in range(30)]
    one, four = Curriculum(config(lesson("a"))), Curriculum(config(lesson("a")))
    _feed(one, per_step, 1)
    _feed(four, per_step, 4)
    a, b = one.state_dict()["lessons"]["a"]["train"], four.state_dict()["lessons"]["a"]["train"]
    assert a["mean"] == pytest.approx(b["mean"], abs=1e-12) and a["weight"] == pytest.approx(b["weight"], rel=1e-12)
    assert one.step == four.step == 30


def test_the_estimate_does_not_depend_on_the_number_of_generations():
    means = np.random.default_rng(1).random(40)
    small, large = Curriculum(config(lesson("a"))), Curriculum(config(lesson("a")))
    _feed(small, [np.full(8, m) for m in means], 1)
    _feed(large, [np.full(64, m) for m in means], 1)
    assert small.performance("a") == pytest.approx(large.performance("a"), abs=1e-12)


def test_weights_halve_every_half_life_steps():
    c = Curriculum(config(lesson("a"), half_life=10))
    _feed(c, [np.zeros(16)] * 300 + [np.ones(16)] * 10, 1)
    assert c.performance("a") == pytest.approx(0.5, abs=1e-6)


# ------------------------------------------------------------------------------ graduation


def test_a_lesson_graduates_on_a_plateau_at_its_threshold():
    c = Curriculum(config(lesson("a", plateau_window=20, graduate_at=0.9), lesson("b")))
    for step in range(1, 21):
        c.update_from_eval("a", [1.0, 1.0], step)
    assert c.status("a") == "active"  # 19 steps of history do not cover a window of 20
    c.update_from_eval("a", [1.0, 1.0], 21)
    assert c.status("a") == "graduated" and c.state_dict()["lessons"]["a"]["graduated_at"] == 21
    assert c.weights() == {"a": 0.0, "b": 1.0}


def test_still_improving_or_plateaued_too_low_or_no_threshold_does_not_graduate():
    rising = Curriculum(config(lesson("a", plateau_window=10)))
    for step in range(1, 60):
        rising.update_from_eval("a", [min(1.0, step / 50)], step)
    assert rising.status("a") == "active"
    low = Curriculum(config(lesson("a", plateau_window=10, graduate_at=0.9)))
    never = Curriculum(config(lesson("a", plateau_window=10, graduate_at=None)))
    for step in range(1, 60):
        low.update_from_eval("a", [0.5], step)
        never.update_from_eval("a", [1.0], step)
    assert low.status("a") == "active" and never.status("a") == "active"


def test_the_trainer_clock_alone_can_complete_a_plateau():
    c = Curriculum(config(lesson("a", plateau_window=10)))
    c.update_from_eval("a", [1.0] * 4, step=3)
    c.set_step(12)
    assert c.status("a") == "active"
    c.set_step(13)
    assert c.status("a") == "graduated" and c.step == 13


def test_when_every_lesson_has_graduated_sampling_falls_back_to_them():
    c = Curriculum(config(lesson("a", plateau_window=1), lesson("b", plateau_window=1)))
    for step in (1, 2):
        c.update_from_eval("a", [1.0], step)
        c.update_from_eval("b", [1.0], step)
    assert c.status("a") == c.status("b") == "graduated"
    assert c.weights() == {"a": 0.5, "b": 0.5}
    assert c.sample_lesson(np.random.default_rng(0)) in ("a", "b")


# ------------------------------------------------------------------------------ weights


def test_weights_favour_intermediate_success_with_a_floor_and_exclude_locked_lessons():
    c = Curriculum(config(lesson("mid"), lesson("hard"), lesson("easy"), lesson("new"), lesson("locked", ("hard", 0.9)),
                          min_weight=0.1))
    c.update_from_training("mid", [0.0, 1.0] * 4, 1)
    c.update_from_training("hard", [0.0] * 49 + [1.0], 1)   # p = 0.02 -> 4p(1-p) = 0.078 < floor
    c.update_from_training("easy", [1.0] * 9 + [0.0], 1)    # p = 0.9 -> 0.36
    w = c.weights()
    raw = {"mid": 1.0, "hard": 0.1, "easy": 0.36, "new": 1.0}  # "new": not tried yet
    total = sum(raw.values())
    assert w == pytest.approx({**{k: v / total for k, v in raw.items()}, "locked": 0.0})
    draws = [c.sample_lesson(np.random.default_rng(s)) for s in range(4000)]
    assert "locked" not in draws
    for k, p in w.items():
        assert abs(draws.count(k) / 4000 - p) < 4 * np.sqrt(p * (1 - p) / 4000) + 1e-9, k
    m = c.metrics()
    assert m["curriculum/mid/weight"] == pytest.approx(w["mid"]) and m["curriculum/locked/status"] == 0.0
    assert m["curriculum/easy/train_reward"] == pytest.approx(0.9) and m["curriculum/active_lessons"] == 4


def test_bad_updates_are_errors():
    c = Curriculum(config(lesson("a")))
    with pytest.raises(KeyError, match="unknown lesson 'b'"):
        c.update_from_training("b", [1.0], 1)
    with pytest.raises(ValueError, match="finite"):
        c.update_from_training("a", [float("nan")], 1)
    with pytest.raises(ValueError, match="step"):
        c.update_from_eval("a", [1.0], -1)
    with pytest.raises(ValueError, match="step"):
        c.set_step(1.5)


# ------------------------------------------------------------------------------ state


def _busy() -> Curriculum:
    c = Curriculum(config(lesson("a", plateau_window=3), lesson("b", ("a", 0.5)), lesson("c", ("b", 0.9))))
    rng = np.random.default_rng(3)
    for step in range(1, 12):
        c.update_from_training("a", rng.random(8).tolist(), step)
        c.update_from_eval("a", [1.0, 1.0], step)
        if c.status("b") == "active":
            c.update_from_training("b", rng.random(8).tolist(), step)
    return c


def test_state_round_trips_through_json_and_behaves_the_same():
    c = _busy()
    state = json.loads(json.dumps(c.state_dict(), allow_nan=False))
    d = Curriculum(c.config)
    d.load_state_dict(state)
    assert d.state_dict() == c.state_dict() and d.metrics() == c.metrics()
    assert c.status("a") == "graduated" and d.status("b") == "active" and d.status("c") == "locked"
    for x in (c, d):
        x.update_from_training("b", [0.95] * 8, 12)
    assert d.state_dict() == c.state_dict()
    assert [c.sample_lesson(np.random.default_rng(s)) for s in range(20)] == [
        d.sample_lesson(np.random.default_rng(s)) for s in range(20)]


def test_loading_state_into_a_changed_configuration(caplog):
    state = _busy().state_dict()
    smaller = Curriculum(config(lesson("a", plateau_window=3), lesson("new", ("a", 0.5))))
    with caplog.at_level(logging.WARNING):
        smaller.load_state_dict(state)
    assert "lesson 'b' is not in the configuration" in caplog.text
    assert smaller.status("a") == "graduated" and smaller.status("new") == "active"
    with pytest.raises(ValueError, match="version"):
        smaller.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="malformed"):
        smaller.load_state_dict({"version": 1, "lessons": {"a": {"status": "active"}}, "step": 1})


def test_save_and_load_state_on_every_filesystem(fsspec_root):
    root, options = fsspec_root
    path = f"{root}/run/curriculum.json"
    assert load_state(path, options) is None
    state = _busy().state_dict()
    save_state(state, path, options)
    assert load_state(path, options) == state
    state2 = {**state, "step": 99}
    save_state(state2, path, options)
    assert load_state(path, options) == state2
    import fsspec

    fs, plain = fsspec.core.url_to_fs(f"{root}/run", **options)
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(plain, detail=False)] == ["curriculum.json"]  # no temporaries


def test_a_state_file_that_is_not_json_is_a_clear_error(tmp_path):
    (tmp_path / "c.json").write_text("{half")
    with pytest.raises(ValueError, match="is not JSON"):
        load_state(str(tmp_path / "c.json"))


# ------------------------------------------------------------------------------ the Ray actor


@pytest.fixture
def actor_name(ray_session):
    name = f"curriculum-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        ray_session.kill(ray_session.get_actor(name, namespace="marinrl-tests"), no_restart=True)
    except ValueError:
        pass


def _actor(name, cfg, **kw):
    return curriculum_actor(cfg, name=name, namespace="marinrl-tests", **kw)


def test_actor_is_get_or_create_by_name_and_refuses_another_config(ray_session, actor_name):
    cfg = config(lesson("a"), lesson("b", ("a", 0.5)))
    first = CurriculumClient(_actor(actor_name, cfg))
    first.update_from_training("a", [1.0] * 4, 3)
    second = CurriculumClient(_actor(actor_name, cfg))
    assert second.step() == 3 and second.status("b") == "active"
    assert second.sample_lesson(0) in ("a", "b") and sum(second.weights().values()) == pytest.approx(1.0)
    assert second.lesson("b").dependencies == (LessonDependency("a", 0.5),)
    with pytest.raises(ValueError, match="already exists with another configuration"):
        _actor(actor_name, config(lesson("a")))


def test_updates_in_flight_are_kept_until_applied_and_their_failure_raises_from_flush(ray_session, actor_name,
                                                                                       tmp_path):
    """Updates are sent without waiting: those still in flight when the next is sent stay counted, `flush()`
    waits for every one and raises the one that failed on the actor; the others were applied."""
    client = CurriculumClient(_actor(actor_name, config(lesson("a"))))
    gate = tmp_path / "gate"

    def hold_until_the_gate_opens(actor, path):  # the actor runs one call at a time: the updates queue behind it
        while not os.path.exists(path):
            time.sleep(0.01)

    held = client.handle.__ray_call__.remote(hold_until_the_gate_opens, str(gate))
    client.update_from_training("no_such_lesson", [1.0], 1)
    client.update_from_training("a", [1.0] * 4, 2)
    client.update_from_training("a", [0.0] * 4, 3)
    assert client.pending == 3  # none applied yet, none forgotten
    gate.touch()
    with pytest.raises(KeyError, match="unknown lesson 'no_such_lesson'"):
        client.flush()
    ray_session.get(held)
    assert client.pending == 0 and client.step() == 3


def test_killed_actor_restarts_and_resumes_from_the_saved_state(ray_session, actor_name, tmp_path):
    cfg = config(lesson("a"), lesson("b", ("a", 0.5)))
    state_path = f"file://{tmp_path}/curriculum.json"
    client = CurriculumClient(_actor(actor_name, cfg, state_path=state_path))
    client.update_from_training("a", [1.0] * 8, 5)
    assert client.save() == state_path
    saved = client.state_dict()
    client.update_from_training("b", [0.25] * 8, 6)  # after the save: lost with the process
    assert client.step() == 6
    before = client.incarnation()
    ray_session.kill(client.handle, no_restart=False)
    deadline = time.monotonic() + 60
    while True:  # calls during the restart are retried by Ray; wait for the new incarnation to answer
        try:
            if client.incarnation() != before:
                break
        except ray_session.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the actor did not restart within 60 s"
    assert client.state_dict() == saved
    assert client.step() == 5 and client.status("b") == "active"
    assert "curriculum/b/train_reward" not in client.metrics()


def _sigkill_and_wait_for_restart(ray_session, client):
    """SIGKILL the actor's process (as a crash or the OOM killer would) and wait for Ray's restart."""
    import os
    import signal

    before = client.incarnation()
    os.kill(ray_session.get(client.handle.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # calls during the restart are retried by Ray; wait for the new incarnation to answer
        try:
            if client.incarnation() != before:
                return
        except ray_session.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the actor did not restart within 60 s"


@pytest.mark.timeout(1200)  # a whole job: the suite's job-file limit
def test_a_jobs_curriculum_actor_killed_mid_run_resumes_from_its_last_trainer_step(ray_session, tmp_path):
    """The job's actor (RLJob._start_curriculum) saves at every trainer step: SIGKILLed, Ray's restart
    has the lessons' statistics and statuses as of the last step, not fresh ones (a dependent lesson
    locked again, a graduated one sampled again). Fails with the job's former save_every=0."""
    from test_job import job_config

    from marinrl.job.rl_job import RLJob

    cfg = job_config(tmp_path, curriculum=config(lesson("a", max_tokens=1), lesson("b", ("a", 0.5), max_tokens=1)))
    job = RLJob(cfg)
    client = CurriculumClient(ray_session.get_actor(job._start_curriculum("marinrl-tests"), namespace="marinrl-tests"))
    try:
        for step in range(1, 4):  # a trainer's clock and a rollout worker's rewards
            client.update_from_training("a", [1.0] * 4, step)
            client.set_step(step)
        assert client.status("b") == "active"
        at_last_step = client.state_dict()
        _sigkill_and_wait_for_restart(ray_session, client)
        assert client.state_dict() == at_last_step and client.status("b") == "active"

        # A resumed trainer restores an older checkpoint's state: that is the state a restart comes back to.
        checkpoint = str(tmp_path / "step-1" / "curriculum.json")
        save_state({**at_last_step, "step": 1}, checkpoint)
        client.load(checkpoint)
        _sigkill_and_wait_for_restart(ray_session, client)
        assert client.step() == 1
    finally:
        job.shutdown()


def test_actor_saves_every_n_steps_and_loads_a_trainer_checkpoint(ray_session, actor_name, tmp_path):
    cfg = config(lesson("a"))
    state_path = str(tmp_path / "auto.json")
    client = CurriculumClient(_actor(actor_name, cfg, state_path=state_path, save_every=5))
    client.update_from_training("a", [0.5] * 4, 4)
    assert load_state(state_path) is None
    client.set_step(5)
    assert load_state(state_path)["step"] == 5
    checkpoint = str(tmp_path / "step-5" / "curriculum.json")
    client.save(checkpoint)
    client.update_from_training("a", [1.0] * 4, 7)
    client.load(checkpoint)  # what a trainer resuming from step 5 does
    assert client.step() == 5 and client.metrics()["curriculum/a/train_reward"] == 0.5
    with pytest.raises(Exception, match="no curriculum state"):
        client.load(str(tmp_path / "missing.json"))
