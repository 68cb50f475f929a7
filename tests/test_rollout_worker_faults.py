"""A RolloutWorker whose environment fails: backoff, the failure budget, one log line per distinct
error, running-total counters and the reason a nan eval carries. Real parts throughout: the session's
tiny InferenceServer behind a RolloutManager, a RolloutWriter on a tmp dir and filesystem weight
transfer with the step-0 weights published."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import faulty_envs
import pytest

from marinrl.config.rollout_worker import ModelStream, RolloutWorkerConfig
from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.inference.context import SamplingParams
from marinrl.rollout.manager import LessonRuntime, RolloutManager
from marinrl.rollout.worker import BACKOFF_FIRST_S, EnvironmentFailedError, RolloutWorker
from marinrl.storage.rollouts import summarize
from marinrl.transfer.endpoints import build_client, build_server

DEADLINE_S = 120.0


class OneLesson:
    def __init__(self, lesson_id: str):
        self.lesson_id = lesson_id

    def sample_lesson(self, seed: int) -> str:
        return self.lesson_id


class RecordingTracker:
    def __init__(self):
        self.logged: list[dict] = []

    def log(self, metrics, *, step, commit=None):
        self.logged.append(dict(metrics))

    def series(self, key: str) -> list[float]:
        return [m[key] for m in self.logged if key in m]


class TimedEnv:
    """Records when each call started (to check the waits between failures), then runs `inner`."""

    def __init__(self, inner):
        self.inner, self.started = inner, []

    def sample(self, *args):
        self.started.append(time.monotonic())
        return self.inner.sample(*args)


def make_worker(tmp_path, tiny_server, env, *, budget: int, env_name: str = "faulty_envs:X"):
    lesson = f"lesson-{uuid.uuid4().hex[:8]}"  # distinct errors are counted per process: a fresh lesson id
    weights = FilesystemTransferConfig(root=f"file://{tmp_path}/weights")
    publisher = build_server(weights)
    publisher.publish(tiny_server.model, 0)
    manager = RolloutManager(tiny_server, {lesson: LessonRuntime(lambda: env,
                                                                 SamplingParams(temperature=1.0, max_tokens=2),
                                                                 env_name=env_name)})
    config = RolloutWorkerConfig(streams=(ModelStream("policy", (), f"{tmp_path}/rollouts", weights),),
                                 groups_per_batch=2, n_generations=2, max_staleness=1000, final_step=1000,
                                 eval_examples=2, max_consecutive_env_failures=budget, weight_timeout_s=DEADLINE_S,
                                 warm_up_sampler=False)  # the calls counted here are the worker's own (test_warmup.py)
    tracker = RecordingTracker()
    worker = RolloutWorker(config, manager, OneLesson(lesson),
                           clients={"policy": build_client(weights, tiny_server.model)}, worker_id="w0",
                           tracker=tracker)
    return worker, lesson, tracker, publisher


def test_a_failing_env_backs_off_then_raises_naming_lesson_env_and_error(tmp_path, tiny_server, caplog):
    env = TimedEnv(faulty_envs.RaisesInSample())
    budget = 4
    worker, lesson, tracker, publisher = make_worker(tmp_path, tiny_server, env, budget=budget,
                                                     env_name="faulty_envs:RaisesInSample")
    with caplog.at_level(logging.INFO, logger="marinrl"), pytest.raises(EnvironmentFailedError) as failed:
        worker.run()
    publisher.close()
    message = str(failed.value)
    assert f"lesson {lesson!r}" in message and "TimedEnv (env 'faulty_envs:RaisesInSample')" in message
    assert message.endswith(f"{budget} calls in a row (max_consecutive_env_failures={budget}); last error: "
                            f"RuntimeError: {faulty_envs.ERROR_TEXT}")

    # One eval call, then `budget` training calls, each failure but the last followed by a doubling wait.
    assert len(env.started) == 1 + budget
    gaps = [b - a for a, b in zip(env.started[1:], env.started[2:])]
    for k, gap in enumerate(gaps):  # lower bounds only: a loaded machine waits longer, never shorter
        assert gap >= 0.9 * BACKOFF_FIRST_S * 2**k, (k, gaps)

    # One traceback for the distinct error; its repeats are counted (at the 2nd, 4th, 8th, ...), never
    # re-logged in full; a summary line gives the total.
    mine = [r.getMessage() for r in caplog.records if faulty_envs.ERROR_TEXT in r.getMessage()]
    assert sum(r.exc_info is not None for r in caplog.records if faulty_envs.ERROR_TEXT in r.getMessage()) == 1
    assert [n for n in range(2, 6) if any(f"seen {n} times" in m for m in mine)] == [2, 4]
    assert sum(m.startswith(f"failure summary: {1 + budget} x ") for m in mine) == 1

    # Running totals, and empty batches logged.
    assert tracker.series(f"env/{lesson}/env_failures") == [1.0, 2.0, 3.0, 4.0]
    assert tracker.series("rollout/empty_batches") == [1, 2, 3, 4]

    # The nan eval says why.
    (first_eval,) = worker.eval_history
    key = f"eval/{lesson}/reward_mean"
    assert first_eval["metrics"][key] != first_eval["metrics"][key]  # nan
    assert first_eval["reasons"][key] == f"environment failed: RuntimeError: {faulty_envs.ERROR_TEXT}"


def test_a_good_batch_resets_the_count(tmp_path, tiny_server):
    env = faulty_envs.FailsTwiceInThree()  # 2 failures in a row at most, never 3
    worker, lesson, tracker, publisher = make_worker(tmp_path, tiny_server, env, budget=3)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("result", worker.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while worker.counters.batches_written < 3 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.stop()  # also interrupts a backoff wait
    thread.join(DEADLINE_S)
    publisher.close()
    assert not thread.is_alive() and "result" in outcome, "the worker raised or did not stop"
    assert outcome["result"]["batches_written"] >= 3
    failures = tracker.series(f"env/{lesson}/env_failures")
    assert failures == sorted(failures) and failures[-1] >= 5  # a running total across the good batches
    assert summarize(f"{tmp_path}/rollouts")["totals"]["rollouts"] == outcome["result"]["rollouts_written"]


def test_nan_rewards_for_every_group_use_up_the_budget_and_say_so(tmp_path, tiny_server):
    worker, lesson, tracker, publisher = make_worker(tmp_path, tiny_server, faulty_envs.NaNGrader(), budget=2,
                                                     env_name="faulty_envs:NaNGrader")
    with pytest.raises(EnvironmentFailedError, match="NaNGrader.grade returned a non-finite reward") as failed:
        worker.run()
    publisher.close()
    assert f"lesson {lesson!r}: environment NaNGrader (env 'faulty_envs:NaNGrader') failed 2 calls" in str(failed.value)
    assert tracker.series(f"env/{lesson}/malformed_groups") == [2.0, 4.0]  # both groups of each call dropped
    assert tracker.series(f"env/{lesson}/env_failures") == [0.0, 0.0]  # the calls themselves did not fail
    key = f"eval/{lesson}/reward_mean"
    assert worker.eval_history[0]["reasons"][key].startswith("no usable group: NaNGrader.grade returned")

