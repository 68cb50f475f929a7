"""RLJob under faults, on a real Ray: a rollout worker killed mid-run is restarted and training
finishes; a trainer killed mid-run ends the job with a message naming the checkpoint, and the same
config resumes from it consuming every rollout group at most once across the lineage; a two-node
cluster places the trainer and the rollout worker on different nodes by resource; an environment that
fails every call stops the job with its error, logged once in the run folder."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import threading
from typing import Callable

import faulty_envs
import pytest
import ray
from job_process import WAIT_S, TrainCommand, all_exit, endless_job, poll
from test_job import job_config
from test_policy_models import ROLES

from marinrl.config.curriculum import CurriculumConfig
from marinrl.config.env import EnvConfig
from marinrl.config.lora import LoraRLConfig
from marinrl.config.policies import PolicyConfig
from marinrl.job.rl_job import RLJob
from marinrl.job.run_lock import read_lease
from marinrl.train.worker import SIDECAR

pytestmark = pytest.mark.timeout(1200)  # whole jobs: twice the suite's default (pyproject.toml), for a loaded machine

DEADLINE_S = 150.0
"""A job's replay deadline in the broken-environment script: the failure budget must end the job before it."""


def _actors_of(job: RLJob, class_name: str) -> list:
    return [a for a in list(job._actors)
            if a._ray_actor_creation_function_descriptor.class_name == class_name]


def _poll(condition: Callable[[], object], what: str, deadline_s: float = WAIT_S):
    """`job_process.poll`; in a `_Saboteur` whose job has ended it stops at once, naming how the job ended: a
    job that fails on its own is reported as itself, not as a wait that ran out."""
    me = threading.current_thread()
    ended = (lambda: me.job_outcome if me.job_ended.is_set() else None) if isinstance(me, _Saboteur) else None
    return poll(condition, what, deadline_s, ended=ended)


def _committed_checkpoint_step(ckpt_root: str) -> int:
    """The step a resume would start from (0: no committed checkpoint yet). Levanter's metadata.json
    commits a checkpoint; our sidecar in the same folder holds the step it resumes at."""
    steps = []
    for d in pathlib.Path(ckpt_root).glob("step-*"):
        try:
            if (d / "metadata.json").exists():
                steps.append(json.loads((d / SIDECAR).read_text())["step"])
        except FileNotFoundError:  # retention deleted this folder between the listing and the read
            continue
    return max(steps, default=0)


def _trainer_step(job: RLJob) -> int:
    trainers = _actors_of(job, "TrainerActor")
    if not trainers:
        return -1
    try:
        return ray.get(trainers[0].progress.remote(), timeout=2.0)["step"]
    except Exception:  # still constructing
        return -1


class _Saboteur(threading.Thread):
    """Runs `act` beside the job's `run()`; any failure of its own is re-raised by `result()`."""

    def __init__(self, act: Callable[[], object]):
        super().__init__(daemon=True)
        self._act = act
        self.value = None
        self.error: BaseException | None = None
        self.job_ended = threading.Event()
        self.job_outcome = "it returned"

    def beside(self, run: Callable[[], object]):
        """Starts the saboteur, then `run()` (the job) here; its waits stop when the job ends."""
        self.start()
        try:
            return run()
        except BaseException as e:
            self.job_outcome = f"it raised {type(e).__name__}: {e}"
            raise
        finally:
            self.job_ended.set()

    def run(self):
        try:
            self.value = self._act()
        except BaseException as e:  # surfaced in the test thread
            self.error = e

    def result(self):
        self.join(timeout=WAIT_S)
        assert not self.is_alive(), "the saboteur never finished"
        if self.error is not None:
            raise self.error
        return self.value


def test_a_killed_rollout_worker_is_restarted_and_training_finishes(tmp_path, ray_session):
    cfg = job_config(tmp_path, run_id="rollout-fault", num_train_steps=8, checkpoint_every=2, max_staleness=1)
    job = RLJob(cfg)

    def kill_rollout_worker():
        _poll(lambda: _trainer_step(job) >= 2, "the trainer to reach step 2")
        (victim,) = _actors_of(job, "RolloutActor")
        ray.kill(victim, no_restart=True)
        return _trainer_step(job)

    saboteur = _Saboteur(kill_rollout_worker)
    result = saboteur.beside(job.run)
    killed_at = saboteur.result()

    assert killed_at < cfg.num_train_steps, "the worker was killed after training had already finished"
    assert result.rollout_restarts >= 1
    assert len(_actors_of(job, "RolloutActor")) == 0  # shutdown cleared the job's actors
    train = result.train
    assert train["first_step"] == 0 and train["final_step"] == 8
    assert [h["step"] for h in train["history"]] == list(range(1, 9))
    assert all(h["batch/staleness_max"] <= 1 for h in train["history"])
    (summary,) = result.rollouts  # the summary of the restarted worker, which saw the final weights
    assert summary["weight_step"] == 8 and summary["batches_written"] >= 1
    assert result.curriculum_step == 8
    groups = [g for step in train["trained_groups"] for g in step]
    assert len(groups) == len(set(groups)) == 8 * cfg.groups_per_step


THREE_ROLES = dataclasses.replace(ROLES, env=EnvConfig("roles", {
    "targets": {"first": "0", "second": "z", "third": "P"}, "policies": {"second": "other", "third": "third"}}))


@pytest.mark.parametrize("policy_models", [True], ids=["full_and_two_adapters_on_one_base"])
def test_a_killed_trainer_ends_the_job_and_the_same_config_resumes_exactly_once(tmp_path, ray_session, policy_models):
    """With a model per agent (docs/policies.md): a `full` policy's trainer, and one trainer of two `lora`
    adapters on one base (`other+third`), which is killed: the job names its checkpoint, and the rerun resumes
    every model from its own (both adapters and their replay cursors from the shared trainer's). (`policy_models`
    False is the one-trainer job: left out of the suite for time, as the in-flight SIGKILL job of
    tests/test_inflight_job.py and the two-host job of tests/test_multihost_job.py resume one trainer.)"""
    cfg = job_config(tmp_path, run_id="trainer-fault", num_train_steps=4, checkpoint_every=2, max_staleness=2)
    ckpt_root = f"{cfg.run_dir}/checkpoints"
    adapters = 1
    if policy_models:
        cfg = dataclasses.replace(cfg, curriculum=CurriculumConfig(lessons=(THREE_ROLES,)), policies={
            "policy": PolicyConfig(specialization="full"), "other": PolicyConfig(specialization="lora"),
            "third": PolicyConfig(specialization="lora", lora=LoraRLConfig(seed=1))})
        ckpt_root = f"{cfg.run_dir}/trainers/other+third/checkpoints"
        adapters = 2
    job = RLJob(cfg)

    def kill_trainer_after_first_checkpoint():
        ckpt_step = _poll(lambda: _committed_checkpoint_step(ckpt_root), "the trainer's first checkpoint")
        trainer = _actors_of(job, "TrainerActor")[-1]  # with policy models: the adapters' one
        # The checkpoint is written before the step's bookkeeping: wait until that step is reported.
        trained = _poll(lambda: (t := ray.get(trainer.trained_groups.remote(), timeout=10)) and t[-1][0] >= ckpt_step
                        and t, f"the trainer to report step {ckpt_step}")
        ray.kill(trainer, no_restart=True)
        return trained

    saboteur = _Saboteur(kill_trainer_after_first_checkpoint)
    with pytest.raises(RuntimeError) as died:
        saboteur.beside(job.run)
    before = dict(saboteur.result())  # step -> group ids, as trained by the killed trainer
    message = str(died.value)
    assert "the trainer died" in message and ckpt_root in message
    assert max(before) < cfg.num_train_steps, "the trainer was killed after it had finished"
    assert not _actors_of(job, "RolloutActor") and not _actors_of(job, "TrainerActor")
    assert read_lease(cfg.run_dir) is None  # released on the error: the rerun below is not refused

    survivor = _committed_checkpoint_step(f"{cfg.run_dir}/policies/policy/checkpoints") if policy_models else None
    result = RLJob(cfg).run()
    train = result.policies["other"] if policy_models else result.train
    if policy_models:  # the model that kept running was stopped with the job: it resumes from its own checkpoint
        assert result.policies["third"] == train  # one trainer of both adapters
        assert result.policies["policy"]["first_step"] == survivor
        assert result.policies["policy"]["final_step"] == cfg.num_train_steps
    first = train["first_step"]
    assert first > 0 and first % cfg.checkpoint_every == 0  # resumed from a checkpoint, not from scratch
    assert first in before, f"the killed trainer reported steps {sorted(before)} but resumed from {first}"
    assert first == max(s for s in before if s % cfg.checkpoint_every == 0)  # the latest checkpoint
    assert train["final_step"] == cfg.num_train_steps
    assert [h["step"] for h in train["history"]] == list(range(first + 1, cfg.num_train_steps + 1))
    assert result.curriculum_step == cfg.num_train_steps

    # Exactly once across the lineage: steps 1..first of the killed run, then the resumed run's steps.
    lineage = [before[s] for s in range(1, first + 1)] + train["trained_groups"]
    assert len(lineage) == cfg.num_train_steps
    assert all(len(step) == adapters * cfg.groups_per_step for step in lineage)  # each adapter's own groups
    if policy_models:
        for k, agent in ((0, "second"), (1, "third")):
            assert all(sum(f":{agent}:" in g for g in step) == cfg.groups_per_step for step in lineage), (k, agent)
    flat = [g for step in lineage for g in step]
    assert len(flat) == len(set(flat)), "a rollout group was trained twice across the resume"


_BROKEN_ENV_SCRIPT = textwrap.dedent("""
    import json, pathlib
    from marinrl.config.curriculum import CurriculumConfig, LessonConfig
    from marinrl.config.env import EnvConfig
    from marinrl.job.rl_job import RLJob
    from marinrl.config.replay import ReplayConfig
    from test_job import job_config

    broken = LessonConfig(lesson_id="broken", env=EnvConfig("faulty_envs:RaisesInSample"), max_tokens=1,
                          graduate_at=None)
    # The replay timeout is the deadline: without the failure budget the trainer would wait it out.
    cfg = job_config(pathlib.Path({root!r}), run_id="env-fails", curriculum=CurriculumConfig(lessons=(broken,)),
                     max_consecutive_env_failures=3, replay=ReplayConfig(timeout_s={deadline}))
    job = RLJob(cfg)
    try:
        job.run()
        print("RESULT " + json.dumps(dict(error=None)))
    except Exception as e:
        print("RESULT " + json.dumps(dict(error=type(e).__name__, message=str(e), actors_left=len(job._actors))))
""")


def test_an_env_failing_every_call_stops_the_job_naming_it_and_logs_to_the_run_folder(tmp_path):
    """Its own process and local Ray, with tests/ on PYTHONPATH: Ray's workers import the environment
    by its dotted path, as they would a user's package."""
    tests = os.path.dirname(os.path.abspath(__file__))
    script = _BROKEN_ENV_SCRIPT.format(root=str(tmp_path), deadline=DEADLINE_S)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S,
                          env=env, cwd=os.path.dirname(tests))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["error"] == "EnvironmentFailedError", out
    message = out["message"]
    assert "lesson 'broken'" in message and "RaisesInSample (env 'faulty_envs:RaisesInSample')" in message
    assert f"RuntimeError: {faulty_envs.ERROR_TEXT}" in message and "3 calls in a row" in message
    assert out["actors_left"] == 0  # stopped and cleaned up, not restarted

    logs = tmp_path / "env-fails" / "logs"
    rollout_log = (logs / "rollout-0.log").read_text()
    assert rollout_log.count("Traceback (most recent call last)") == 1, rollout_log[-3000:]
    assert "seen 2 times so far" in rollout_log  # a repeat is a count
    assert "failure summary: 4 x environment RaisesInSample of lesson 'broken' failed" in rollout_log  # eval + 3
    assert (logs / "trainer.log").exists() and (logs / "curriculum.log").exists()


_TWO_NODE_SCRIPT = textwrap.dedent("""
    import json, sys
    import ray
    from ray.cluster_utils import Cluster
    sys.path.insert(0, {tests!r})
    import pathlib
    from test_job import job_config
    from marinrl.job.rl_job import RLJob, RayJobConfig
    from marinrl.config.placement import PlacementConfig

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, resources={{"trainer": 1}}, include_dashboard=False, object_store_memory=128 * 1024 * 1024))
    try:
        rollout_node = cluster.add_node(num_cpus=1, resources={{"rollout": 1}}, object_store_memory=128 * 1024 * 1024)
        cluster.wait_for_nodes()
        cfg = job_config(pathlib.Path({root!r}), run_id="two-node", num_train_steps=3, eval_every=10,
                         ray=RayJobConfig(address=cluster.address,
                                          trainer=PlacementConfig(resources={{"trainer": 1}}),
                                          rollout=PlacementConfig(resources={{"rollout": 1}})))
        result = RLJob(cfg).run()
        print("RESULT " + json.dumps(dict(
            final_step=result.train["final_step"], trainer_node=result.train["node_id"],
            rollout_nodes=[r.get("node_id") for r in result.rollouts], ray_left=ray.is_initialized(),
            head=cluster.head_node.node_id, rollout_node=rollout_node.node_id)))
    finally:
        cluster.shutdown()
""")


def test_two_node_cluster_places_trainer_and_rollout_worker_by_resource(tmp_path):
    script = _TWO_NODE_SCRIPT.format(tests=os.path.dirname(__file__), root=str(tmp_path))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["final_step"] == 3
    assert not out["ray_left"]  # the job connected to the cluster itself and disconnected after
    (rollout_node,) = out["rollout_nodes"]
    assert out["trainer_node"] and rollout_node and out["trainer_node"] != rollout_node
    assert out["trainer_node"] == out["head"]  # the only node with the "trainer" resource
    assert rollout_node == out["rollout_node"]  # the only node with the "rollout" resource


_ECHO_LESSON = "    - {lesson_id: echo, env: {name: echo, args: {alphabet_size: 10}}, max_tokens: 1, graduate_at: null}"


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _priority(pid: int):
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


def test_ctrl_c_checkpoints_and_leaves_no_ray_process_behind(tmp_path):
    """`marinrl train` in its own session, SIGINT to the whole process group as a terminal's Ctrl-C
    sends it: the trainer saves a resumable checkpoint, the command exits 130, and every process it
    started (Ray's GCS, raylet, workers, actors) is gone."""
    config = tmp_path / "job.yaml"
    config.write_text(endless_job(tmp_path, _ECHO_LESSON))
    rollouts = tmp_path / "job" / "rollouts"
    with TrainCommand(config, tmp_path / "train.log") as job:
        started = job.running_once(lambda: len(list(rollouts.glob("step=*"))) >= 3, "three trainer steps' rollouts")
        assert len(started) >= 3  # at least Ray's GCS, the raylet and the actors' workers
        actors = [p for p in started if _cmdline(p).startswith(("ray::TrainerActor", "ray::RolloutActor"))]
        assert len(actors) == 2  # the job's own actors run at the driver's priority, not Ray's default nice 15
        assert {_priority(p) for p in actors} == {_priority(job.proc.pid)}, [(_cmdline(p), _priority(p))
                                                                             for p in actors]
        job.interrupt(timeout_s=180)
    out = job.output()
    assert job.proc.returncode == 130, out[-3000:]
    assert "stopped at step" in out and "run the same config again to resume" in out, out[-3000:]
    assert not (tmp_path / "job" / "run.lock").exists()  # Ctrl-C released the run's lease
    (ckpt,) = (tmp_path / "job" / "checkpoints").glob("step-*")
    sidecar = json.loads((ckpt / SIDECAR).read_text())
    assert sidecar["step"] >= 1 and (ckpt / "metadata.json").exists()
    all_exit(started)


def test_the_drivers_death_takes_its_local_ray_with_it(tmp_path):
    """`kill -9` of `marinrl train`'s driver alone, mid-training: its watchdog (marinrl/job/reaper.py) kills
    every process of the job's local Ray it finds (the actors' workers, Ray's agents) and they are all gone
    well within the 30 s polled here. Without it Ray's two agents lived 60 s (reporting the raylet's death
    to the dead GCS) and the trainer trained on for about 2 s; with it, 0.2 s on a 2-core machine."""
    config = tmp_path / "job.yaml"
    config.write_text(endless_job(tmp_path, _ECHO_LESSON))
    rollouts = tmp_path / "job" / "rollouts"
    job = TrainCommand(config, tmp_path / "train.log")
    try:
        started = job.running_once(lambda: len(list(rollouts.glob("step=*"))) >= 3, "three trainer steps' rollouts")
        assert len(started) >= 4  # Ray's GCS, the raylet, its agents, the actors' workers, the watchdog
    finally:
        job.proc.kill()  # the driver only: its process group and session are left alone
        job.proc.wait(timeout=30)
    all_exit(started, "every process of the job to exit")
    out = job.output()
    assert re.search(r"\[marinrl\] the job's driver ended: killed [1-9]\d* processes of its local Ray", out), \
        out[-3000:]
