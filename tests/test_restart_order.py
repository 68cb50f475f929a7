"""Restarts in any order: a rollout worker follows the newest trainer epoch even when its weight step is
lower, skips a previous job's weights, and drops a batch generated for a trainer that restarted meanwhile.
Real parts: the session's tiny InferenceServer behind a RolloutManager, Parquet rollout files, and
filesystem weight transfer whose server instances (the trainers) each open a new epoch."""

from __future__ import annotations

import threading
import time
import uuid

import faulty_envs
import pytest
from test_rollout_worker_faults import OneLesson

from marinrl.config.rollout_worker import ModelStream, RolloutWorkerConfig
from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.inference.context import SamplingParams
from marinrl.rollout.manager import LessonRuntime, RolloutManager
from marinrl.rollout.worker import RolloutWorker
from marinrl.storage.rollouts import summarize
from marinrl.transfer.endpoints import build_client, build_server

DEADLINE_S = 120.0


class GatedEnv:
    """`StartsWithA` whose calls, once `hold` is set, wait until `release` is set: a batch the test can
    keep in generation while a trainer restarts."""

    def __init__(self):
        self.inner = faulty_envs.StartsWithA()
        self.hold, self.release, self.waiting = threading.Event(), threading.Event(), threading.Event()

    def sample(self, *args):
        if self.hold.is_set():
            self.waiting.set()
            self.release.wait(DEADLINE_S)
        return self.inner.sample(*args)


def _worker(tmp_path, tiny_server, env, *, final_step: int, min_epoch=None, **config):
    lesson = f"lesson-{uuid.uuid4().hex[:8]}"
    weights = FilesystemTransferConfig(root=f"file://{tmp_path}/weights")
    manager = RolloutManager(tiny_server, {lesson: LessonRuntime(lambda: env,
                                                                 SamplingParams(temperature=1.0, max_tokens=2),
                                                                 env_name="faulty_envs:StartsWithA")})
    config = RolloutWorkerConfig(streams=(ModelStream("policy", (), f"{tmp_path}/rollouts", weights),),
                                 groups_per_batch=1, n_generations=2, final_step=final_step, eval_every=0,
                                 eval_examples=1, weight_timeout_s=DEADLINE_S, warm_up_sampler=False,
                                 **{"max_staleness": 0, **config})
    clients = {"policy": build_client(weights, tiny_server.model)}
    return (RolloutWorker(config, manager, OneLesson(lesson), clients=clients, worker_id="w0", min_epoch=min_epoch),
            weights)


def _steps_written(tmp_path) -> dict[int, int]:
    """Rollout files per weight step."""
    try:
        steps = summarize(f"{tmp_path}/rollouts")["steps"]
    except FileNotFoundError:
        return {}
    return {int(k): int(v["files"]) for k, v in steps.items()}


def _until(condition, thread: threading.Thread, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert thread.is_alive(), f"the worker ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {DEADLINE_S:.0f} s"
        time.sleep(0.02)


def _run(worker) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = worker.run()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _train_on_policy(trainer, model, thread, tmp_path, steps):
    """What an on-policy trainer does with the worker: publish step s, wait for a new batch of step s."""
    for s in steps:
        before = _steps_written(tmp_path).get(s, 0)
        trainer.publish(model, s)
        _until(lambda s=s, before=before: _steps_written(tmp_path).get(s, 0) > before, thread,
               f"a new batch for step {s}")


def _publish_final(trainer, model, step: int, thread, outcome) -> dict:
    """The trainer's last weights: the worker stops, having raised nothing; its summary."""
    trainer.publish(model, step)
    thread.join(DEADLINE_S)
    trainer.close()
    assert "result" in outcome, outcome.get("error")
    return outcome["result"]


def test_a_resumed_trainer_at_a_lower_step_is_followed_by_a_new_worker_despite_newer_weights(tmp_path, tiny_server):
    """A job resumes past a corrupt newest checkpoint: the previous job's trainer had published up to the
    final step 6, this job's trainer starts from step 4. The worker must neither stop at the old step 6
    (final) nor wait for a step 6 the new trainer is not about to publish."""
    worker, weights = _worker(tmp_path, tiny_server, faulty_envs.StartsWithA(), final_step=6)
    previous = build_server(weights)
    for s in (0, 6):
        previous.publish(tiny_server.model, s)
    previous.close()
    job_started = time.time_ns()
    worker._min_epoch = job_started  # as RLJob passes its start to its rollout workers
    thread, outcome = _run(worker)
    trainer = build_server(weights)  # this job's trainer: a newer epoch
    _train_on_policy(trainer, tiny_server.model, thread, tmp_path, (4, 5))
    _publish_final(trainer, tiny_server.model, 6, thread, outcome)
    assert sorted(_steps_written(tmp_path)) == [4, 5]  # nothing for the old epoch's 6, nothing beyond


def test_a_trainer_restarted_alone_from_an_older_checkpoint_is_followed(tmp_path, tiny_server):
    worker, weights = _worker(tmp_path, tiny_server, faulty_envs.StartsWithA(), final_step=5)
    first = build_server(weights)
    thread, outcome = _run(worker)
    _train_on_policy(first, tiny_server.model, thread, tmp_path, (0, 1, 2, 3))
    first.close()  # the trainer dies after step 3; its checkpoint is step 2
    restarted = build_server(weights)
    _train_on_policy(restarted, tiny_server.model, thread, tmp_path, (2,))
    assert _steps_written(tmp_path)[2] == 2  # a second batch for step 2: for the restarted trainer
    _train_on_policy(restarted, tiny_server.model, thread, tmp_path, (3, 4))
    _publish_final(restarted, tiny_server.model, 5, thread, outcome)
    assert outcome["result"]["trainer_restarts"] == 1


def test_a_worker_restarted_alone_joins_the_running_trainer(tmp_path, tiny_server):
    """A new worker process (its job started before this trainer's epoch) serves the trainer's current step."""
    job_started = time.time_ns()
    trainer = build_server(FilesystemTransferConfig(root=f"file://{tmp_path}/weights"))
    trainer.publish(tiny_server.model, 0)
    trainer.publish(tiny_server.model, 3)
    worker, _ = _worker(tmp_path, tiny_server, faulty_envs.StartsWithA(), final_step=4, min_epoch=job_started)
    thread, outcome = _run(worker)
    _until(lambda: _steps_written(tmp_path).get(3, 0) >= 1, thread, "a batch for step 3")
    _publish_final(trainer, tiny_server.model, 4, thread, outcome)
    assert sorted(_steps_written(tmp_path)) == [3]


def test_a_batch_generated_for_a_trainer_that_restarted_meanwhile_is_dropped(tmp_path, tiny_server):
    env = GatedEnv()
    worker, weights = _worker(tmp_path, tiny_server, env, final_step=3)
    first = build_server(weights)
    thread, outcome = _run(worker)
    _train_on_policy(first, tiny_server.model, thread, tmp_path, (0,))
    env.hold.set()
    first.publish(tiny_server.model, 1)
    _until(env.waiting.is_set, thread, "the batch for step 1 in generation")
    first.close()
    restarted = build_server(weights)  # restarted from step 0's checkpoint while that batch is generated
    restarted.publish(tiny_server.model, 0)
    env.hold.clear()
    env.release.set()
    _until(lambda: _steps_written(tmp_path).get(0, 0) >= 2, thread, "a batch for the restarted trainer's step 0")
    assert 1 not in _steps_written(tmp_path)  # the old trainer's step-1 batch was never written
    _train_on_policy(restarted, tiny_server.model, thread, tmp_path, (1, 2))
    _publish_final(restarted, tiny_server.model, 3, thread, outcome)
    assert outcome["result"]["batches_dropped_restart"] == 1
    assert _steps_written(tmp_path) == {0: 2, 1: 1, 2: 1}


def test_with_inflight_swaps_a_batch_whose_generation_met_the_restarted_trainer_is_dropped(tmp_path, tiny_server):
    """In-flight swaps take the restarted trainer's weights inside the batch's generation (at the start of its
    `generate`), so the worker learns of the restart there, not in its own poll after it: the batch, made
    for the old trainer's step, must still be dropped."""
    from marinrl.config.inflight import InflightConfig

    env = GatedEnv()
    worker, weights = _worker(tmp_path, tiny_server, env, final_step=3, max_staleness=1,
                              inflight=InflightConfig(enabled=True))
    first = build_server(weights)
    thread, outcome = _run(worker)
    first.publish(tiny_server.model, 0)
    _until(lambda: _steps_written(tmp_path).get(0, 0) >= 2, thread, "the batches for steps 0 and 1")
    env.hold.set()
    first.publish(tiny_server.model, 1)
    _until(env.waiting.is_set, thread, "the batch for step 2 in generation")
    first.close()
    restarted = build_server(weights)  # restarted from step 0's checkpoint while that batch is generated
    restarted.publish(tiny_server.model, 0)
    env.hold.clear()
    env.release.set()
    _until(lambda: _steps_written(tmp_path).get(0, 0) >= 3, thread, "a batch for the restarted trainer")
    assert 1 not in _steps_written(tmp_path)  # the batch begun with the old trainer's weights 1 was dropped
    _publish_final(restarted, tiny_server.model, 3, thread, outcome)
    assert outcome["result"]["batches_dropped_restart"] == 1 and outcome["result"]["inflight_swaps"] >= 1


@pytest.fixture(autouse=True)
def _reset_tiny_server_step(tiny_server):
    """The session's server is shared: leave it serving weight step 0 as other tests expect."""
    yield
    tiny_server.reload(tiny_server.model, weight_step=0)
