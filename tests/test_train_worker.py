"""The TrainWorker against real parts: Levanter's Trainer on a tiny Llama, Parquet rollout files,
filesystem weight transfer. A producer thread plays the rollout side: for every weight step the
trainer publishes, it writes one batch of rollouts stamped with that step."""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import uuid

import numpy as np
from levanter.checkpoint import CheckpointerConfig
from levanter.models.llama import LlamaConfig

from marinrl.models import ModelConfig, build_model
from marinrl.storage import RolloutWriter
from marinrl.train.batching import BatchingConfig
from marinrl.train.losses import LossConfig
from marinrl.train.replay import OffPolicyConfig, OnPolicyConfig, ReplayConfig
from marinrl.train.worker import TrainWorker, TrainWorkerConfig, cpu_trainer_config
from marinrl.transfer.checkpoint import FilesystemTransferConfig
from marinrl.types import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata

VOCAB, GROUPS, G = 64, 2, 4
TINY = ModelConfig(
    model=LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2),
    vocab_size=VOCAB, seed=0)


def make_rollout_batch(weight_step: int, rng: np.random.Generator, worker: str = "producer") -> RolloutBatch:
    meta = RolloutMetadata(worker, weight_step)
    groups = []
    for _ in range(GROUPS):
        gid = uuid.uuid4().hex
        prompt = rng.integers(1, VOCAB, 6)
        rollouts = []
        for _ in range(G):
            n = int(rng.integers(2, 8))
            reward = float(rng.integers(0, 2))
            rollouts.append(Rollout(
                prompt_tokens=prompt, response_tokens=rng.integers(1, VOCAB, n),
                response_logprobs=np.full(n, -np.log(VOCAB), np.float32), temperature=1.0,
                loss_mask=np.ones(n, bool), token_rewards=np.r_[np.zeros(n - 1), reward], episode_reward=reward,
                finish_reason="stop", env_name="synthetic", lesson_id="synthetic", group_id=gid, metadata=meta))
        groups.append(RolloutGroup(tuple(rollouts)))
    return RolloutBatch(tuple(groups), meta)


class Producer(threading.Thread):
    """Writes `per_version` batches for every weight version the trainer publishes."""

    def __init__(self, weights: FilesystemTransferConfig, rollout_root: str, per_version: int = 1):
        super().__init__(daemon=True)
        self.client = weights.build_client(build_model(TINY))
        self.writer = RolloutWriter(rollout_root)
        self.per_version = per_version
        self.rng = np.random.default_rng(0)
        self.written: dict[str, int] = {}  # group_id -> weight step
        self.halt = threading.Event()

    def run(self):
        while not self.halt.is_set():
            try:
                update = self.client.wait_for(0, timeout_s=0.5) if self.client.weight_step is None else self.client.poll()
            except TimeoutError:
                continue
            if update is None:
                self.halt.wait(0.05)
                continue
            for _ in range(self.per_version):
                batch = make_rollout_batch(update.weight_step, self.rng)
                self.writer.write(batch)
                self.written.update({g.group_id: update.weight_step for g in batch.groups})


def worker_config(tmp: pathlib.Path, *, steps: int, sampling, run_id: str, checkpoint_every: int = 0,
                  loss: LossConfig | None = None, **trainer_overrides) -> TrainWorkerConfig:
    return TrainWorkerConfig(
        rollout_root=str(tmp / "rollouts"),
        weights=FilesystemTransferConfig(root=str(tmp / "weights")),
        model=TINY,
        trainer=cpu_trainer_config(num_train_steps=steps, train_batch_size=GROUPS * G, id=run_id, log_dir=tmp / "logs",
                                   checkpointer=CheckpointerConfig(base_path=str(tmp / "ckpt")), **trainer_overrides),
        loss=loss or LossConfig(),
        replay=ReplayConfig(sampling=sampling, timeout_s=120, poll_interval_s=0.05),
        batching=BatchingConfig(max_length=64, min_bucket=16),
        groups_per_step=GROUPS,
        checkpoint_every=checkpoint_every,
    )


def test_on_policy_trains_each_step_on_its_own_weights(tmp_path):
    cfg = worker_config(tmp_path, steps=4, sampling=OnPolicyConfig(), run_id="onpolicy",
                        loss=LossConfig.preset("grpo", kl_beta=0.04))
    producer = Producer(cfg.weights, cfg.rollout_root)
    producer.start()
    steps: dict[int, dict] = {}
    result = TrainWorker(cfg, on_step=lambda s, m: steps.__setitem__(s, m)).run()
    producer.halt.set()
    assert (result.first_step, result.final_step) == (0, 4)
    assert sorted(steps) == [1, 2, 3, 4]
    for s, m in steps.items():
        assert len(m["groups"]) == GROUPS
        assert {w for _, w in m["groups"]} == {s - 1}  # trained at step s on weights s-1: staleness 0
        assert np.isfinite(m["loss"])
    trained = [gid for m in steps.values() for gid, _ in m["groups"]]
    assert len(trained) == len(set(trained))
    assert (tmp_path / "ckpt" / "onpolicy" / "step-3" / "marinrl.json").exists()  # the final, forced checkpoint
    assert result.metrics["replay/trained_staleness/0"] == 4 * GROUPS


def child_main(tmp: str, log_path: str) -> None:
    """A trainer in its own process, appending what each step trained to `log_path` (JSON lines)."""
    import json

    cfg = worker_config(pathlib.Path(tmp), steps=8, sampling=OnPolicyConfig(), run_id="killed", checkpoint_every=2)

    def on_step(step, metrics):
        with open(log_path, "a") as f:
            f.write(json.dumps({"step": step, "groups": metrics["groups"]}) + "\n")

    result = TrainWorker(cfg, on_step=on_step).run()
    with open(log_path, "a") as f:
        f.write(json.dumps({"first_step": result.first_step, "final_step": result.final_step}) + "\n")


def _spawn_child(tmp: pathlib.Path, log: pathlib.Path):
    import subprocess
    import sys

    code = (f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); "
            f"import test_train_worker as t; t.child_main({str(tmp)!r}, {str(log)!r})")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _read_log(path: pathlib.Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_resume_after_sigkill_trains_every_rollout_exactly_once(tmp_path):
    import signal
    import time

    cfg = worker_config(tmp_path, steps=8, sampling=OnPolicyConfig(), run_id="killed", checkpoint_every=2)
    producer = Producer(cfg.weights, cfg.rollout_root)
    producer.start()
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    child = _spawn_child(tmp_path, first_log)
    deadline = time.time() + 300
    while not any(e.get("step", 0) >= 5 for e in _read_log(first_log)):
        assert child.poll() is None, child.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "the first trainer never reached step 5"
        time.sleep(0.2)
    child.send_signal(signal.SIGKILL)  # mid-run: step 5 trained, its checkpoint (step 6) not yet taken
    child.wait()

    resumed = _spawn_child(tmp_path, second_log)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-3000:]
    producer.halt.set()
    second = _read_log(second_log)
    start = second[-1]["first_step"]
    assert second[-1]["final_step"] == 8 and start in (4, 6)

    killed_steps = {e["step"]: e["groups"] for e in _read_log(first_log)}
    resumed_steps = {e["step"]: e["groups"] for e in second if "step" in e}
    lineage = {**{s: g for s, g in killed_steps.items() if s <= start}, **resumed_steps}
    assert sorted(lineage) == list(range(1, 9)) and min(resumed_steps) == start + 1
    trained = [gid for groups in lineage.values() for gid, _ in groups]
    assert len(trained) == len(set(trained)) == 8 * GROUPS  # nothing trained twice
    for step, groups in lineage.items():  # on-policy, every step: its own weights' rollouts
        assert {w for _, w in groups} == {step - 1}
        assert all(producer.written[gid] == w for gid, w in groups)
    # The file the killed run consumed after its last checkpoint is read again, not skipped.
    assert {g for g, _ in resumed_steps[start + 1]} == {g for g, _ in killed_steps[start + 1]}


def test_checkpoint_and_resume_on_gcs(tmp_path, gcs_root):
    """Model, optimizer and sidecar to gs:// (tensorstore and gcsfs through the emulator), then resume."""
    from levanter.checkpoint import CheckpointerConfig as Ckpt

    def cfg_for(steps):
        cfg = worker_config(tmp_path, steps=steps, sampling=OffPolicyConfig(staleness=1), run_id="gcs",
                            checkpoint_every=1)
        cfg.trainer = dataclasses.replace(cfg.trainer, checkpointer=Ckpt(base_path=f"{gcs_root}/ckpt"))
        return cfg

    producer = Producer(cfg_for(2).weights, cfg_for(2).rollout_root)
    producer.start()
    first = TrainWorker(cfg_for(2)).run()
    second = TrainWorker(cfg_for(3)).run()
    producer.halt.set()
    assert (first.first_step, first.final_step) == (0, 2)
    assert (second.first_step, second.final_step) == (2, 3)
    assert second.checkpoint.startswith(f"{gcs_root}/ckpt/gcs/step-2")
