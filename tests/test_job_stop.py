"""What the driver does on Ctrl-C and what it shows while a job waits, with real Ray actors standing in for the
trainers (a trainer's `stop` answers whether it was training; its `run` ends once it has checkpointed)."""

from __future__ import annotations

import threading

import pytest
import ray

from marinrl.job.rl_job import stop_trainers
from marinrl.job.terminal import StallNotices


@ray.remote
class StoppableTrainer:
    """`stop()` answers `training`; `run()` returns a summary once stopped, or never when it was not training
    (a trainer still loading, whose run would go on loading and compiling)."""

    def __init__(self, training: bool):
        self.training = training
        self.stopped = threading.Event()

    def stop(self) -> bool:
        if self.training:
            self.stopped.set()
        return self.training

    def run(self) -> dict:
        self.stopped.wait()
        return {"final_step": 3, "checkpoint_step": 3, "stopped": True}


@pytest.mark.parametrize("training", [False, True], ids=["starting", "training"])
def test_ctrl_c_waits_only_for_a_trainer_that_is_training(ray_session, capsys, training):
    """A trainer that answers `stop` with False (still starting) has nothing to save: the driver does not wait
    for its `run`, and says so; one that is training is waited for and its checkpoint named."""
    trainer = StoppableTrainer.options(max_concurrency=2).remote(training)
    run = trainer.run.remote()
    try:
        stop_trainers([(trainer, run, True)], timeout=60.0)  # a mistaken wait here would print "did not stop"
        err = capsys.readouterr().err
        assert "did not stop in time" not in err, err
        if training:
            assert "stopped" in err and "while the trainer was starting" not in err, err
        else:
            assert "stopped while the trainer was starting" in err, err
    finally:
        ray.kill(trainer)


def test_stall_notices_are_kept_per_worker():
    """Two workers waiting on the same server at once are both shown; each worker's own notice repeats once
    per `repeat_s`."""
    what = "openenv: opening a session on http://127.0.0.1:9/ (up to 4 tries of 300 s): no answer for 31 s"
    notices = StallNotices(repeat_s=60.0)
    first = notices.lines(0, [what], now=100.0)
    second = notices.lines(1, [what], now=101.0)
    assert len(first) == 1 and "rollout worker 0 " in first[0]
    assert len(second) == 1 and "rollout worker 1 " in second[0]
    assert notices.lines(0, [what.replace("31 s", "41 s")], now=111.0) == []  # the same wait, 11 s on
    assert len(notices.lines(1, [what], now=161.0)) == 1
