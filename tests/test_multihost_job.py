"""RLJob with a trainer over 2 hosts, on a real local Ray: 2 TrainerHostActors (one placement group, PACK
on this one machine), each a JAX process with 2 CPU devices (gloo) in one 4-device global mesh, and one
rollout worker. The job completes with the curriculum clocked once per optimizer step and every group
trained once; killing one trainer process ends `RLJob.run()` with an error naming the checkpoint, and the
same config then resumes and trains every group exactly once across the lineage."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import ray
from test_job import job_config
from test_job_faults import _committed_checkpoint_step, _poll, _Saboteur

from marinrl.config.placement import PlacementConfig
from marinrl.config.trainer_group import TrainerGroupConfig
from marinrl.job.rl_job import ConfigError, RayJobConfig, RLJob
from marinrl.storage.rollouts import RolloutReader

pytestmark = pytest.mark.timeout(1200)  # whole jobs: twice the suite's default (pyproject.toml), for a loaded machine


def two_host_config(tmp_path, **overrides):
    """2 hosts x 2 CPU devices. JAX's heartbeat is long (300 s): a dead process is noticed by the peer
    watch in well under a second, and a short heartbeat only kills healthy processes that a loaded
    machine starves of CPU (a 30 s one did, with three suites sharing 2 cores)."""
    return job_config(tmp_path, ray=RayJobConfig(trainer=PlacementConfig(num_hosts=2)),
                      trainer_group=TrainerGroupConfig(cpu_devices=2, heartbeat_timeout_s=300), **overrides)


def _written_groups(run_dir: str, below_step: int) -> set[str]:
    return {g.group_id for batch in RolloutReader(f"{run_dir}/rollouts").read_new() for g in batch.groups
            if batch.weight_step < below_step}


def _scalar_events(folder) -> list[tuple[str, int]]:
    """(tag, step) of every scalar in the TensorBoard events files directly in `folder`, read as TFRecords
    (u64 length, u32 crc, the Event, u32 crc) with tensorboardX's Event proto."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            out += [(v.tag, int(event.step)) for v in event.summary.value]
    return out


def _placement_groups_alive() -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


def test_a_two_host_trainer_job_trains_every_group_once_and_clocks_the_curriculum_per_step(tmp_path, ray_session):
    cfg = two_host_config(tmp_path, run_id="two-hosts", num_train_steps=3, max_staleness=0, eval_every=10)
    result = RLJob(cfg).run()
    train = result.train
    assert (train["process_id"], train["processes"], train["global_devices"], train["local_devices"]) == (0, 2, 4, 2)
    assert train["final_step"] == 3 and [h["step"] for h in train["history"]] == [1, 2, 3]
    assert all(h["batch/staleness_max"] == 0 for h in train["history"])
    assert result.curriculum_step == 3  # process 0 alone clocks it, once per optimizer step
    trained = [g for step in train["trained_groups"] for g in step]
    assert len(trained) == len(set(trained)) == 3 * cfg.groups_per_step
    assert set(trained) == _written_groups(cfg.run_dir, below_step=3)  # on-policy: every group written, once
    assert (tmp_path / "two-hosts" / "logs" / "trainer-1.log").exists()
    # One writer: process 0 alone logs for the group (two processes raced to create the folder before). Its
    # tracker may open more than one events file (tensorboardX names them by the second they open in), so the
    # check is on what they hold: each (tag, step) once, and the loss of each of the 3 steps.
    logged = _scalar_events(tmp_path / "two-hosts" / "tensorboard" / "trainer" / "two-hosts")
    assert len(logged) == len(set(logged)), "a scalar was logged twice: more than one process writes"
    assert len({step for tag, step in logged if tag == "train/policy_loss"}) == 3  # every step's loss, once
    assert _placement_groups_alive() == 0  # the job gave its hosts back


def test_killing_one_trainer_process_ends_the_job_naming_the_checkpoint_and_the_rerun_resumes_once(tmp_path,
                                                                                                 ray_session):
    cfg = two_host_config(tmp_path, run_id="two-hosts-fault", num_train_steps=4, checkpoint_every=2, max_staleness=2)
    ckpt_root = f"{cfg.run_dir}/checkpoints"
    job = RLJob(cfg)

    def kill_process_1_after_the_first_checkpoint():
        ckpt_step = _poll(lambda: _committed_checkpoint_step(ckpt_root), "the group's first checkpoint")
        group = job._group
        trained = _poll(lambda: (t := ray.get(group.leader.trained_groups.remote(), timeout=10)) and
                        t[-1][0] >= ckpt_step and t, f"process 0 to report step {ckpt_step}")
        ray.kill(group.actors[1], no_restart=True)
        return trained

    saboteur = _Saboteur(kill_process_1_after_the_first_checkpoint)
    with pytest.raises(RuntimeError) as died:
        saboteur.beside(job.run)
    before = dict(saboteur.result())  # step -> group ids, as process 0 trained them
    message = str(died.value)
    assert message.startswith("the trainer died: trainer process 1 of 2 died: "), message
    assert "[marinrl] trainer process 1 of 2 is gone" in message  # process 0's own words (exit 75), from its log
    assert f"run the same config again to resume from its last checkpoint, {ckpt_root}/step-" in message, message
    assert max(before) < cfg.num_train_steps, "the group was killed after it had finished"
    assert _placement_groups_alive() == 0 and not job._actors

    result = RLJob(cfg).run()
    train = result.train
    first = train["first_step"]
    assert first == max(s for s in before if s % cfg.checkpoint_every == 0) > 0  # the latest checkpoint
    assert train["final_step"] == cfg.num_train_steps
    assert [h["step"] for h in train["history"]] == list(range(first + 1, cfg.num_train_steps + 1))
    assert result.curriculum_step == cfg.num_train_steps
    lineage = [before[s] for s in range(1, first + 1)] + train["trained_groups"]
    assert len(lineage) == cfg.num_train_steps and all(len(step) == cfg.groups_per_step for step in lineage)
    flat = [g for step in lineage for g in step]
    assert len(flat) == len(set(flat)), "a rollout group was trained twice across the resume"


@pytest.mark.parametrize("overrides, field", [
    (dict(trainer_group=TrainerGroupConfig(strategy="SIDEWAYS")), "trainer_group.strategy"),
    (dict(groups_per_step=3, n_generations=2), "groups_per_step"),  # 6 rows over 2 hosts x 2 devices
])
def test_what_a_multi_host_trainer_cannot_do_is_refused_naming_the_field(tmp_path, overrides, field):
    cfg = two_host_config(tmp_path)
    cfg = dataclasses.replace(cfg, **overrides)
    with pytest.raises(ConfigError, match=rf"^RLJobConfig\.{field.replace('.', '[.]')}: "):
        RLJob(cfg)
