"""The TrainWorker against real parts: Levanter's Trainer on a tiny Llama, Parquet rollout files,
filesystem weight transfer. A producer thread plays the rollout side: for every weight step the
trainer publishes, it writes one batch of rollouts stamped with that step."""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time
import uuid

import numpy as np
from levanter.checkpoint import CheckpointerConfig
from levanter.models.llama import LlamaConfig

from marinrl.config.batching import BatchingConfig
from marinrl.config.loss import LossConfig
from marinrl.config.model import ModelConfig
from marinrl.config.replay import OffPolicyConfig, OnPolicyConfig, ReplayConfig
from marinrl.config.train_worker import TrainWorkerConfig
from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.job.plan import build_trainer
from marinrl.levanter_configs import cpu_trainer_config
from marinrl.models.policy_model import build_model
from marinrl.storage.rollouts import RolloutWriter
from marinrl.train.checkpoints import DIGEST, newest_loadable
from marinrl.train.replay.buffer import ReplayBuffer
from marinrl.train.worker import TrainResult, TrainWorker
from marinrl.transfer.endpoints import build_client
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


class WeightFollower(threading.Thread):
    """A thread that calls `on_weights(update)` for every weight version the trainer publishes."""

    def __init__(self, weights: FilesystemTransferConfig):
        super().__init__(daemon=True)
        self.client = build_client(weights, build_model(TINY))
        self.halt = threading.Event()

    def run(self):
        while not self.halt.is_set():
            try:
                update = (self.client.wait_for(0, timeout_s=0.5) if self.client.weight_step is None
                          else self.client.poll())
            except TimeoutError:
                continue
            if update is None:
                self.halt.wait(0.05)
                continue
            self.on_weights(update)

    def on_weights(self, update) -> None:
        raise NotImplementedError

    def stop_after(self, weight_step: int, timeout_s: float = 120.0) -> None:
        """Stops once the version `weight_step` was handled: a trainer's run() returns right after
        publishing its last version, which this thread may not have read yet (polls, no fixed wait)."""
        deadline = time.monotonic() + timeout_s
        while (self.client.weight_step is None or self.client.weight_step < weight_step) and self.is_alive():
            if time.monotonic() > deadline:
                raise AssertionError(f"weight step {weight_step} not received within {timeout_s} s "
                                     f"(last: {self.client.weight_step})")
            time.sleep(0.05)
        self.halt.set()
        self.join(timeout=60)


class Producer(WeightFollower):
    """Writes `per_version` batches for every weight version the trainer publishes, up to weight step
    `hold_above` (the trainer then waits at the next step until the test raises it), and keeps a copy
    of every version's weights it received."""

    def __init__(self, weights: FilesystemTransferConfig, rollout_root: str, per_version: int = 1,
                 hold_above: float = float("inf")):
        super().__init__(weights)
        self.writer = RolloutWriter(rollout_root)
        self.per_version = per_version
        self.hold_above = hold_above
        self.rng = np.random.default_rng(0)
        self.written: dict[str, int] = {}  # group_id -> weight step
        self.received: list[tuple[int, list[np.ndarray]]] = []  # (weight step, the weights' arrays)

    def on_weights(self, update) -> None:
        self.received.append((update.weight_step, model_arrays(update.model)))
        if update.weight_step > self.hold_above:
            return
        for _ in range(self.per_version):
            batch = make_rollout_batch(update.weight_step, self.rng)
            self.writer.write(batch)
            self.written.update({g.group_id: update.weight_step for g in batch.groups})


def model_arrays(model) -> list[np.ndarray]:
    import equinox as eqx
    import jax

    return [np.array(x) for x in jax.tree_util.tree_leaves(eqx.filter(jax.device_get(model), eqx.is_inexact_array))]


EPS32 = float(np.finfo(np.float32).eps)


def checkpoint_arrays(folder: str) -> dict[str, np.ndarray]:
    """Every array of a Levanter checkpoint folder (model, optimizer state, step), by its path inside it,
    read with tensorstore as Levanter wrote them (local or gs://)."""
    import fsspec
    import tensorstore as ts

    fs, root = fsspec.core.url_to_fs(folder, **({"token": "anon"} if folder.startswith("gs://") else {}))
    out = {}
    for marker in sorted(fs.find(root)):
        if not marker.endswith("/.zarray"):
            continue
        array_dir = marker[: -len("/.zarray")]
        name = array_dir[len(root.rstrip("/")) + 1:]
        url = folder.rstrip("/") + "/" + name
        spec = {"driver": "zarr", "kvstore": url if url.startswith("gs://") else {"driver": "file", "path": url}}
        out[name] = ts.open(spec).result().read().result()
    return out


def assert_same_state(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    """Equal to float32 rounding: a few eps32 of each array's own scale (Levanter's restore is exact,
    and the same program on the same data repeats bitwise; the slack only covers a different fusion)."""
    assert sorted(got) == sorted(want), what
    assert any(k.startswith("model/") for k in want) and any(k.startswith("opt_state/") for k in want), sorted(want)
    for name, w in want.items():
        w, g = np.asarray(w, np.float64), np.asarray(got[name], np.float64)
        atol = 4 * EPS32 * float(np.max(np.abs(w), initial=0.0))
        assert g.shape == w.shape and np.max(np.abs(g - w), initial=0.0) <= atol, \
            f"{what}: {name} differs by {np.max(np.abs(g - w)):.3g} (bound {atol:.3g})"


def worker_config(tmp: pathlib.Path, *, steps: int, sampling, run_id: str, checkpoint_every: int = 0,
                  loss: LossConfig | None = None, layout: str = "packed", **trainer_overrides) -> TrainWorkerConfig:
    return TrainWorkerConfig(
        rollout_root=str(tmp / "rollouts"),
        weights=FilesystemTransferConfig(root=str(tmp / "weights")),
        model=TINY,
        trainer=cpu_trainer_config(num_train_steps=steps, train_batch_size=GROUPS * G, id=run_id, log_dir=tmp / "logs",
                                   checkpointer=CheckpointerConfig(base_path=str(tmp / "ckpt")), **trainer_overrides),
        loss=loss or LossConfig(),
        replay=ReplayConfig(sampling=sampling, timeout_s=120, poll_interval_s=0.05),
        batching=BatchingConfig(max_length=64, min_bucket=16, layout=layout),
        groups_per_step=GROUPS,
        checkpoint_every=checkpoint_every,
    )


def train(cfg: TrainWorkerConfig, **kwargs) -> TrainResult:
    """`cfg`'s TrainWorker with the parts the plan builds for it (as the job's trainer actor gets them), run."""
    return TrainWorker(cfg, build_trainer(cfg), **kwargs).run()


def test_on_policy_trains_each_step_on_its_own_weights(tmp_path):
    cfg = worker_config(tmp_path, steps=4, sampling=OnPolicyConfig(), run_id="onpolicy",
                        loss=LossConfig.preset("grpo", kl_beta=0.04), layout="shared")
    producer = Producer(cfg.weights, cfg.rollout_root)
    producer.start()
    steps: dict[int, dict] = {}
    result = train(cfg, on_step=lambda s, m: steps.__setitem__(s, m))
    producer.halt.set()
    assert (result.first_step, result.final_step) == (0, 4)
    assert sorted(steps) == [1, 2, 3, 4]
    for s, m in steps.items():
        assert len(m["groups"]) == GROUPS
        assert {w for _, w in m["groups"]} == {s - 1}  # trained at step s on weights s-1: staleness 0
        assert np.isfinite(m["loss"])
        # one row per group (the prompt once, then its 4 responses), whole rows per device: not one per rollout
        assert m["batch/rows"] < GROUPS * G and m["batch/row_length"] <= 64
    trained = [gid for m in steps.values() for gid, _ in m["groups"]]
    assert len(trained) == len(set(trained))
    final = tmp_path / "ckpt" / "onpolicy" / "step-3"  # the final, forced checkpoint
    assert newest_loadable(str(final.parent)).path == str(final)
    (final / DIGEST).unlink()  # as a save killed between Levanter's commit and the digest leaves it
    assert newest_loadable(str(final.parent)) is None  # its sidecar promised a digest: not trusted
    assert result.metrics["replay/trained_staleness/0"] == 4 * GROUPS


def test_rollout_files_of_format_version_1_still_train(tmp_path):
    """Files written before per-token weight steps (format 1) are read, with every token at the file's
    weight step, and trained on."""
    from factories import encode_batch_v1

    from marinrl.config.replay import OffPolicyConfig

    cfg = worker_config(tmp_path, steps=2, sampling=OffPolicyConfig(staleness=1), run_id="v1files")
    rng = np.random.default_rng(5)
    written = set()
    folder = pathlib.Path(cfg.rollout_root) / "step=00000000"
    folder.mkdir(parents=True)
    for i in range(2):  # weights 0: usable at steps 0 and 1
        batch = make_rollout_batch(0, rng)
        (folder / f"v1-{i:06d}-old.parquet").write_bytes(encode_batch_v1(batch))
        written |= {g.group_id for g in batch.groups}
    steps: dict[int, dict] = {}
    result = train(cfg, on_step=lambda s, m: steps.__setitem__(s, m))
    assert (result.first_step, result.final_step) == (0, 2)
    assert {gid for m in steps.values() for gid, _ in m["groups"]} == written
    assert all(np.isfinite(m["loss"]) for m in steps.values())
    assert result.metrics.get("replay/quarantined_files", 0) == 0


def child_main(tmp: str, log_path: str) -> None:
    """A trainer in its own process, appending what each step trained to `log_path` (JSON lines)."""
    import json

    cfg = worker_config(pathlib.Path(tmp), steps=8, sampling=OnPolicyConfig(), run_id="killed", checkpoint_every=2)

    def on_step(step, metrics):
        with open(log_path, "a") as f:
            f.write(json.dumps({"step": step, "groups": metrics["groups"]}) + "\n")

    result = train(cfg, on_step=on_step)
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


class FileReplayer(WeightFollower):
    """Plays back recorded rollout files: those of weight step `w` appear under `dest` when the trainer
    publishes weights `w` (an on-policy buffer drops rollouts of weights it does not hold yet), stamped
    as made now, as a rollout worker of this run would write them.

    Why the stamp: the trainer publishes `w` before its next `sample()` moves the buffer to step `w`, so
    the ingestion thread may read a file of `w` while the buffer is still at `w - 1` (under load it
    often does). The buffer holds such a file for later if it was made during this run, and drops it
    as "future" if it was made before the run started: a previous run's weights `w`, not this run's
    (train/replay/staleness.py, `from_previous_run`). A recorded file keeps its recording time, so unstamped
    it was dropped and the run timed out (`ReplayTimeoutError ... future=2`)."""

    def __init__(self, weights: FilesystemTransferConfig, files: dict[int, list[pathlib.Path]], dest: pathlib.Path):
        super().__init__(weights)
        self.files, self.dest = files, dest

    def on_weights(self, update) -> None:
        for path in self.files.pop(update.weight_step, []):
            (self.dest / path.parent.name).mkdir(parents=True, exist_ok=True)
            # atomically, as RolloutWriter does: a reader listing the folder mid-write would see an empty
            # .parquet and quarantine it (seen: "Parquet file size is 0 bytes", then a replay timeout)
            tmp = self.dest / path.parent.name / f".{path.name}.tmp"
            tmp.write_bytes(restamped(path.read_bytes(), time.time()))
            tmp.rename(self.dest / path.parent.name / path.name)


def restamped(data: bytes, created_at: float) -> bytes:
    """A rollout file's bytes with every `created_at` set to `created_at` (the rest unchanged)."""
    from marinrl.storage.format import decode_batch, encode_batch

    batch = decode_batch(data)
    meta = dataclasses.replace(batch.metadata, created_at=created_at)
    groups = tuple(RolloutGroup(tuple(dataclasses.replace(r, metadata=dataclasses.replace(r.metadata,
                                                                                          created_at=created_at))
                                      for r in g.rollouts)) for g in batch.groups)
    return encode_batch(RolloutBatch(groups, meta))


def test_a_replayed_file_ingested_before_its_step_is_held_not_dropped_as_a_previous_runs():
    """The SIGKILL test's reference-run race, without the timing: a recorded file of weights 1 read
    while the buffer is still at step 0 is dropped as a previous run's future as recorded, and held
    for step 1 once the replayer stamps it as made now."""
    from test_replay import batch_of, drops

    from marinrl.config.replay import ReplayConfig
    from marinrl.storage.format import decode_batch, encode_batch

    recorded = encode_batch(batch_of(1, "g", created_at=time.time() - 3600))  # recorded an hour ago
    as_recorded = ReplayBuffer(ReplayConfig(), start_step=0)
    as_recorded.ingest([decode_batch(recorded)])
    assert drops(as_recorded) == {"future": 1}
    replayed = ReplayBuffer(ReplayConfig(), start_step=0)
    replayed.ingest([decode_batch(restamped(recorded, time.time()))])
    assert drops(replayed) == {} and [g.group.group_id for g in replayed.sample(1, 1, timeout_s=0).groups] == ["g"]


def lineage_files(rollout_root: pathlib.Path, groups: set[str]) -> dict[int, list[pathlib.Path]]:
    """The rollout files whose groups were all trained, by weight step."""
    from marinrl.storage.format import decode_batch

    out: dict[int, list[pathlib.Path]] = {}
    for path in sorted(rollout_root.glob("step=*/*.parquet")):
        batch = decode_batch(path.read_bytes())
        if {g.group_id for g in batch.groups} <= groups:
            out.setdefault(batch.weight_step, []).append(path)
    return out


def uninterrupted_run(tmp: pathlib.Path, files: dict[int, list[pathlib.Path]], steps: int, **kwargs):
    """A trainer that never stops, fed exactly the given rollout files."""
    cfg = worker_config(tmp, steps=steps, **kwargs)
    replayer = FileReplayer(cfg.weights, dict(files), pathlib.Path(cfg.rollout_root))
    replayer.start()
    try:
        return train(cfg)
    finally:
        replayer.halt.set()
        replayer.join(timeout=60)


def test_resume_after_sigkill_trains_every_rollout_exactly_once(tmp_path):
    import signal
    import time

    cfg = worker_config(tmp_path, steps=8, sampling=OnPolicyConfig(), run_id="killed", checkpoint_every=2)
    # Rollouts stop after weights 4: the first trainer takes step 5 (checkpoint after step 4), then waits for
    # rollouts of weights 5 and is SIGKILLed there, between checkpoints. Every assertion below holds wherever
    # the kill lands; the hold makes it land where the re-read of a consumed file matters.
    producer = Producer(cfg.weights, cfg.rollout_root, hold_above=4)
    producer.start()
    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    child = _spawn_child(tmp_path, first_log)
    deadline = time.monotonic() + 300
    while not (any(e.get("step", 0) >= 5 for e in _read_log(first_log)) and any(s == 5 for s, _ in producer.received)):
        assert child.poll() is None, child.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the first trainer never reached step 5"
        time.sleep(0.1)  # polling a condition, not ordering: the deadline bounds it
    child.send_signal(signal.SIGKILL)
    child.wait()
    producer.hold_above = float("inf")

    resumed = _spawn_child(tmp_path, second_log)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-3000:]
    producer.halt.set()
    producer.join(timeout=60)
    second = _read_log(second_log)
    start = second[-1]["first_step"]
    killed_steps = {e["step"]: e["groups"] for e in _read_log(first_log) if "step" in e}
    assert second[-1]["final_step"] == 8 and start % 2 == 0 and 0 < start <= max(killed_steps)

    resumed_steps = {e["step"]: e["groups"] for e in second if "step" in e}
    lineage = {**{s: g for s, g in killed_steps.items() if s <= start}, **resumed_steps}
    assert sorted(lineage) == list(range(1, 9)) and min(resumed_steps) == start + 1
    trained = [gid for groups in lineage.values() for gid, _ in groups]
    assert len(trained) == len(set(trained)) == 8 * GROUPS  # nothing trained twice
    for step, groups in lineage.items():  # on-policy, every step: its own weights' rollouts
        assert {w for _, w in groups} == {step - 1}
        assert all(producer.written[gid] == w for gid, w in groups)
    # A file the killed run consumed after its last checkpoint is read again, not skipped.
    if start + 1 in killed_steps:
        assert {g for g, _ in resumed_steps[start + 1]} == {g for g, _ in killed_steps[start + 1]}

    # The resumed trainer restored the checkpoint's weights: what it republished for weight step `start`
    # is what the killed trainer published (and checkpointed) there, not freshly initialized weights.
    published = [arrays for step, arrays in producer.received if step == start]
    assert len(published) == 2, [s for s, _ in producer.received]  # killed run, then the resumed one
    for killed, restored in zip(*published):
        np.testing.assert_array_equal(restored, killed)

    # Model and optimizer state: the interrupted + resumed run ends where an uninterrupted run on the same
    # rollout files ends, and trains the same groups at the same steps.
    files = lineage_files(tmp_path / "rollouts", set(trained))
    assert sorted(files) == list(range(8)) and all(len(f) == 1 for f in files.values())
    result = uninterrupted_run(tmp_path / "uninterrupted", files, 8, sampling=OnPolicyConfig(), run_id="whole")
    assert [set(g) for g in result.trained_groups] == [{g for g, _ in lineage[s]} for s in range(1, 9)]
    assert_same_state(checkpoint_arrays(str(tmp_path / "ckpt" / "killed" / "step-7")),
                      checkpoint_arrays(result.checkpoint), "resumed run vs uninterrupted run")


def test_off_policy_resume_continues_the_buffer_exactly(tmp_path):
    """Off-policy (oldest first, each group once, 8 versions of staleness): every rollout file is there
    from the start, so only the checkpoint's replay state (the reader's cursor, what was used) keeps the
    resumed run from training the first run's groups again. 2 + 2 steps train what 4 uninterrupted steps
    train, step by step, and end in the same state."""
    import shutil

    sampling = OffPolicyConfig(staleness=8)
    rng = np.random.default_rng(5)
    writer = RolloutWriter(str(tmp_path / "rollouts"))
    for _ in range(5):  # one batch per step and one left over, all of the initial weights
        writer.write(make_rollout_batch(0, rng))
    shutil.copytree(tmp_path / "rollouts", tmp_path / "whole" / "rollouts")

    first = train(worker_config(tmp_path, steps=2, sampling=sampling, run_id="offp", checkpoint_every=2))
    resumed = train(worker_config(tmp_path, steps=4, sampling=sampling, run_id="offp", checkpoint_every=2))
    whole = train(worker_config(tmp_path / "whole", steps=4, sampling=sampling, run_id="whole"))
    assert (resumed.first_step, resumed.final_step) == (2, 4)
    lineage = first.trained_groups + resumed.trained_groups
    flat = [g for step in lineage for g in step]
    assert len(flat) == len(set(flat)) == 4 * GROUPS  # nothing trained twice across the resume
    assert [set(g) for g in lineage] == [set(g) for g in whole.trained_groups]
    assert_same_state(checkpoint_arrays(resumed.checkpoint), checkpoint_arrays(whole.checkpoint),
                      "off-policy resumed run vs uninterrupted run")


def test_checkpoint_and_resume_on_gcs(tmp_path, gcs_root):
    """Model, optimizer and sidecar to gs:// (tensorstore and gcsfs through the emulator), then resume:
    the restored weights are the checkpoint's, and 2 + 1 steps end where 3 uninterrupted steps end.
    (On-policy, so which rollout file each step trains is fixed and the runs are comparable.)"""
    from levanter.checkpoint import CheckpointerConfig as Ckpt

    def cfg_for(steps):
        cfg = worker_config(tmp_path, steps=steps, sampling=OnPolicyConfig(), run_id="gcs", checkpoint_every=1)
        cfg.trainer = dataclasses.replace(cfg.trainer, checkpointer=Ckpt(base_path=f"{gcs_root}/ckpt"))
        return cfg

    producer = Producer(cfg_for(2).weights, cfg_for(2).rollout_root)
    producer.start()
    first = train(cfg_for(2))
    second = train(cfg_for(3))
    producer.halt.set()
    producer.join(timeout=60)
    assert (first.first_step, first.final_step) == (0, 2)
    assert (second.first_step, second.final_step) == (2, 3)
    assert second.checkpoint.startswith(f"{gcs_root}/ckpt/gcs/step-2")

    # What the resumed trainer republished for weight step 2 is what the first one published there.
    published = [arrays for step, arrays in producer.received if step == 2]
    assert len(published) == 2, [s for s, _ in producer.received]
    for before, restored in zip(*published):
        np.testing.assert_array_equal(restored, before)

    trained = first.trained_groups + second.trained_groups
    files = lineage_files(tmp_path / "rollouts", {g for groups in trained for g in groups})
    assert sorted(files) == [0, 1, 2] and all(len(f) == 1 for f in files.values())
    whole = uninterrupted_run(tmp_path / "uninterrupted", files, 3, sampling=OnPolicyConfig(), run_id="whole")
    assert [set(g) for g in whole.trained_groups] == [set(g) for g in trained]
    assert_same_state(checkpoint_arrays(second.checkpoint), checkpoint_arrays(whole.checkpoint),
                      "resumed run on gs:// vs uninterrupted run")
