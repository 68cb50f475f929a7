"""The chaos soak's short version (bench/chaos.py): a small quickstart job whose trainer, driver and
curriculum actor are SIGKILLed at seeded moments, with the newest checkpoint corrupted before the
second restart. The run finishes, and its audit trail (marinrl/train/audit.py) shows every step trained
with nothing lost and nothing trained twice; the learning bar is the long soak's (docs/training.md)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_a_job_killed_three_ways_finishes_losing_and_duplicating_nothing(tmp_path):
    import chaos

    # seed 2: the trainer at step 8 (the job ends: restart), the driver at 24 (its Ray cleaned up, the
    # newest of two checkpoints corrupted, restart), the curriculum actor at 26 (Ray restarts it)
    args = chaos.parse(["--steps", "30", "--kills", "3", "--seed", "2", "--checkpoint_every", "5",
                        "--override", '{"groups_per_step": 8, "n_generations": 8, "eval_every": 10}',
                        "--workdir", str(tmp_path)])
    assert [k.target for k in chaos.schedule(args.seed, args.kills, args.steps)] == ["trainer", "driver", "curriculum"]
    result = chaos.soak(args)
    assert result["kills"] == {"trainer": 1, "rollout": 0, "curriculum": 1, "driver": 1}, result
    assert result["restarts"] == 2 and result["driver_exits"][-1] == 0, result
    assert result["corrupted"] is not None and result["checkpoints_skipped_on_resume"] == 1, result
    assert result["steps"] == 30 and result["missing_steps"] == [] and result["lineage"]["broken"] is None, result
    assert result["groups_trained"] == 30 * 8, result
    assert result["groups_lost"] == 0 and result["groups_duplicated"] == 0, result
    assert result["processes_left"] == 0 and result["final_eval"]["weight_step"] == 30, result
