"""A trainer over 2 JAX processes × 2 CPU devices (gloo collectives, a 4-device global mesh) against the
same TrainWorker in one process with 4 devices, fed the same rollouts; and what happens when one of the
two processes is killed.

Each process is a real subprocess (`marinrl.multihost.initialize`, then the ordinary TrainWorker);
the rollout side is the test_train_worker Producer in this process: one batch per published weight
version, so on-policy training makes step s's batch a fixed function of s. The updates are plain SGD,
so the bounds of test_train_mesh apply: the two runs sum the same float32 terms in different orders
(gloo's all-reduce vs the in-process one), which moves the result by at most n·eps32·Σ|terms|."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import optax
import pytest
from conftest import free_port, xla_flags_without_device_count
from levanter.optim import OptimizerConfig
from test_train_worker import GROUPS, G, Producer, worker_config

from marinrl.config.loss import LossConfig
from marinrl.config.replay import OnPolicyConfig
from marinrl.job.plan import build_trainer
from marinrl.multihost import PEER_LOST_EXIT_CODE
from marinrl.train.worker import TrainWorker

EPS32 = float(np.finfo(np.float32).eps)
LR = 0.5  # plain SGD: the weight change is −lr·gradient, so a gradient's rounding maps to the weights linearly
N_TERMS = GROUPS * G * 16  # loss positions per step: rows × the 16-token bucket every batch here fits in
MAX_ADV = float(np.sqrt(G))  # |group-normalized advantage| of G rewards in {0, 1} is below sqrt(G)
KL_BETA = 0.04  # test_train_mesh's: β·k3 per token stays within the loss bound's "+1.0" while k3 < 25


@OptimizerConfig.register_subclass("test_sgd")
@dataclasses.dataclass(frozen=True)
class SgdConfig(OptimizerConfig):
    """Plain SGD at a constant `learning_rate`: updates linear in the gradient."""

    def build(self, num_train_steps):
        return optax.sgd(self.learning_rate)


def sgd_config(tmp: pathlib.Path, *, steps: int, run_id: str, checkpoint_every: int = 0, kl_beta: float = 0.0):
    cfg = worker_config(tmp, steps=steps, sampling=OnPolicyConfig(), run_id=run_id, checkpoint_every=checkpoint_every,
                        loss=LossConfig.preset("grpo", kl_beta=kl_beta))
    cfg.optimizer = SgdConfig(learning_rate=LR)
    return cfg


def child_main(process_id: int, port: int, tmp: str, log_path: str, steps: int, run_id: str,
               checkpoint_every: int, kl_beta: float = 0.0) -> None:
    """One of the 2 trainer processes: joins the group, trains, appends per-step lines (process 0, as they
    happen) and its whole history (every process, at the end) to `log_path`."""
    from marinrl import multihost

    # A long heartbeat: the peer watch notices a dead process (tested below); a short one only kills
    # healthy processes that a loaded machine starves of CPU.
    multihost.initialize(multihost.ProcessGroupConfig(num_processes=2, process_id=process_id, cpu_devices=2,
                                                      coordinator_address=f"127.0.0.1:{port}", heartbeat_timeout_s=300))
    import jax

    assert (jax.device_count(), jax.local_device_count()) == (4, 2)

    def on_step(step, metrics):
        with open(log_path, "a") as f:
            f.write(json.dumps({"step": step, "groups": metrics["groups"]}) + "\n")

    cfg = sgd_config(pathlib.Path(tmp), steps=steps, run_id=run_id, checkpoint_every=checkpoint_every, kl_beta=kl_beta)
    result = TrainWorker(cfg, build_trainer(cfg), on_step=on_step).run()
    with open(log_path, "a") as f:
        f.write(json.dumps({"first_step": result.first_step, "final_step": result.final_step,
                            "losses": [h["loss"] for h in result.history], "groups": result.trained_groups}) + "\n")
    multihost.finish()


def spawn_group(tmp: pathlib.Path, name: str, *, steps: int, run_id: str, checkpoint_every: int = 0,
                kl_beta: float = 0.0):
    """The 2 processes, each with its own environment: CPU JAX, no 4-device flag of this test session."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_without_device_count()}
    procs, logs = [], []
    for pid in range(2):
        log = tmp / f"{name}-{pid}.jsonl"
        code = (f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); import test_multihost as t; "
                f"t.child_main({pid}, {port}, {str(tmp)!r}, {str(log)!r}, {steps}, {run_id!r}, "
                f"{checkpoint_every}, {kl_beta})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE))
        logs.append(log)
    return procs, logs


def read_log(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_all(procs, timeout_s: float = 600) -> None:
    for p in procs:
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert rc == 0, p.stderr.read().decode()[-4000:]


def weight_bounds(received: list[list[np.ndarray]]) -> list[float]:
    """test_train_mesh.weight_bounds on the published weights of every version: per array,
    4·eps32·(n·Σ_t max|Δ_t| + versions·max|w|)."""
    out = []
    for i in range(len(received[-1])):
        update = sum(float(np.max(np.abs(b[i].astype(np.float64) - a[i]))) for a, b in zip(received, received[1:]))
        scale = max(float(np.max(np.abs(m[i]))) for m in received)
        out.append(4 * EPS32 * (N_TERMS * update + len(received) * scale))
    return out


@pytest.mark.parametrize("kl_beta", [KL_BETA], ids=["kl_to_reference"])  # KL 0 is the same path minus the reference
def test_two_processes_train_like_one_with_four_devices(tmp_path, kl_beta):
    steps = 3
    # One process, 4 devices.
    one = sgd_config(tmp_path / "one", steps=steps, run_id="one", kl_beta=kl_beta)
    producer = Producer(one.weights, one.rollout_root)
    producer.start()
    single = TrainWorker(one, build_trainer(one)).run()
    producer.stop_after(steps)
    ref_weights = [arrays for _, arrays in sorted(producer.received, key=lambda r: r[0])]
    assert [s for s, _ in sorted(producer.received, key=lambda r: r[0])] == list(range(steps + 1))

    # Two processes, 2 devices each.
    two_dir = tmp_path / "two"
    two = sgd_config(two_dir, steps=steps, run_id="two", kl_beta=kl_beta)
    producer = Producer(two.weights, two.rollout_root)
    producer.start()
    procs, logs = spawn_group(two_dir, "run", steps=steps, run_id="two", kl_beta=kl_beta)
    wait_all(procs)
    producer.stop_after(steps)
    got = sorted(producer.received, key=lambda r: r[0])
    assert [s for s, _ in got] == list(range(steps + 1))  # one published version per step, one writer

    ends = [read_log(log)[-1] for log in logs]
    assert ends[0]["groups"] == ends[1]["groups"]  # both processes trained the batches process 0 read
    assert ends[0]["losses"] == ends[1]["losses"]  # one SPMD program: one loss
    assert [set(g) for g in ends[0]["groups"]] == [
        {gid for gid, w in producer.written.items() if w == s} for s in range(steps)]  # on-policy, each once

    loss_atol = 4 * EPS32 * N_TERMS * (1.2 * MAX_ADV + 1.0)  # test_train_mesh's rule on this loss's scale
    # With KL the reference logprobs must match too: β·KL adds 0.008 and 0.04 to steps 2 and 3 (measured), 40×
    # and 200× this bound, so a reference built or sharded wrongly on either process cannot pass.
    np.testing.assert_allclose(ends[0]["losses"], [h["loss"] for h in single.history], rtol=0, atol=loss_atol)
    assert ends[0]["losses"][1] != ends[0]["losses"][0]

    # Initial weights identical (same seed); final weights within the float32 bound of the reference run,
    # which is far below what the updates moved (an update lost or doubled on one process cannot hide).
    for a, b in zip(got[0][1], ref_weights[0]):
        np.testing.assert_array_equal(a, b)
    bounds = weight_bounds(ref_weights)
    diffs = [float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(got[-1][1], ref_weights[-1])]
    assert all(d <= b for d, b in zip(diffs, bounds)), list(zip(diffs, bounds))
    moved = [float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(ref_weights[-1], ref_weights[0])]
    assert sum(m > 20 * b for m, b in zip(moved, bounds)) >= len(bounds) // 2, list(zip(moved, bounds))


def test_killing_one_process_ends_the_other_naming_the_checkpoint_and_resume_trains_each_group_once(tmp_path):
    cfg = sgd_config(tmp_path, steps=8, run_id="kill", checkpoint_every=2)
    # Rollouts stop after weights 4: the group trains step 5 (checkpoint after step 4: folder step-3, weights 4),
    # publishes weights 5 and waits in process 0's replay buffer, where process 1 is SIGKILLed.
    producer = Producer(cfg.weights, cfg.rollout_root, hold_above=4)
    producer.start()
    procs, logs = spawn_group(tmp_path, "first", steps=8, run_id="kill", checkpoint_every=2)
    deadline = time.monotonic() + 600
    while not (any(e.get("step", 0) >= 5 for e in read_log(logs[0])) and any(s == 5 for s, _ in producer.received)):
        for p in procs:
            assert p.poll() is None, p.stderr.read().decode()[-4000:]
        assert time.monotonic() < deadline, "the group never reached step 5"
        time.sleep(0.1)  # polling a condition, not ordering: the deadline bounds it
    killed_at = time.monotonic()
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    rc = procs[0].wait(timeout=120)  # a hang guard, far above the detection time printed below
    noticed_s = time.monotonic() - killed_at
    stderr = procs[0].stderr.read().decode()
    print(f"survivor exited {noticed_s:.2f} s after the kill")
    assert rc == PEER_LOST_EXIT_CODE, stderr[-4000:]
    ckpt = tmp_path / "ckpt" / "kill" / "step-3"
    assert "trainer process 1 of 2 is gone" in stderr, stderr[-4000:]
    assert f"it resumes from {ckpt} (weight step 4)" in stderr, stderr[-4000:]

    producer.hold_above = float("inf")
    procs, logs2 = spawn_group(tmp_path, "second", steps=8, run_id="kill", checkpoint_every=2)
    wait_all(procs)
    producer.halt.set()
    producer.join(timeout=60)
    second = read_log(logs2[0])
    assert (second[-1]["first_step"], second[-1]["final_step"]) == (4, 8)
    assert read_log(logs2[1])[-1]["groups"] == second[-1]["groups"]
    killed = {e["step"]: e["groups"] for e in read_log(logs[0]) if "step" in e}
    resumed = {e["step"]: e["groups"] for e in second if "step" in e}
    lineage = {**{s: g for s, g in killed.items() if s <= 4}, **resumed}
    assert sorted(lineage) == list(range(1, 9))
    trained = [gid for groups in lineage.values() for gid, _ in groups]
    assert len(trained) == len(set(trained)) == 8 * GROUPS  # every step's groups once, none twice
    for step, groups in lineage.items():
        assert {w for _, w in groups} == {step - 1}
        assert all(producer.written[gid] == w for gid, w in groups)
    assert {g for g, _ in resumed[5]} == {g for g, _ in killed[5]}  # consumed after the checkpoint: read again


def reads_child_main(process_id: int, port: int, path: str, out_path: str) -> None:
    """One of 2 trainer processes loading an HF checkpoint as the trainer does (`CheckpointWeights`:
    `build_model` on the trainer config's mesh with its parameter axis mapping, FSDP over the 4 devices
    of the 2 processes), then Levanter's own loader for comparison; writes its bytes read and whether
    its shards of the two models are bitwise equal to `out_path`."""
    from marinrl import multihost

    multihost.initialize(multihost.ProcessGroupConfig(num_processes=2, process_id=process_id, cpu_devices=2,
                                                      coordinator_address=f"127.0.0.1:{port}", heartbeat_timeout_s=300))
    import equinox as eqx
    import jax
    from factories import levanter_load_pretrained

    from marinrl.config.model import ModelConfig
    from marinrl.levanter_configs import cpu_trainer_config
    from marinrl.models.hf_checkpoints import hf_read_bytes, hf_reads
    from marinrl.models.policy_model import build_model

    trainer = multihost.levanter_trainer_config(cpu_trainer_config())
    mesh, mapping = trainer.device_mesh, trainer.parameter_axis_mapping
    model = build_model(ModelConfig(hf_checkpoint=path), axis_mapping=mapping, mesh=mesh)
    read, reads = hf_read_bytes(), hf_reads()
    theirs = levanter_load_pretrained(path, "float32", mapping, mesh)
    same, held = True, 0
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)), jax.tree.leaves(eqx.filter(theirs, eqx.is_array)),
                    strict=True):
        same &= a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
            same &= sa.index == sb.index and np.array_equal(np.asarray(sa.data), np.asarray(sb.data))
        held += sum(np.asarray(s.data).nbytes for s in a.addressable_shards if s.replica_id == 0)
    with open(out_path, "w") as f:
        json.dump({"read_bytes": read, "reads": reads, "same_as_levanter": bool(same), "held_bytes": held,
                   "mesh": dict(mesh.shape), "mapping": {k: str(v) for k, v in mapping.items()}}, f)
    multihost.finish()


def test_each_trainer_process_reads_only_its_rows_of_an_hf_checkpoint(tmp_path):
    """A Qwen3 checkpoint written by transformers in 3 safetensors files, loaded by 2 trainer processes
    (FSDP over their 4 devices): each reads its half of every tensor's rows plus the headers, at most
    0.6 × the checkpoint's tensor bytes, and holds exactly Levanter's model (which reads every byte on
    every process). One process holding all 4 devices, as a rollout host does, reads every byte once."""
    import jax

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from marinrl.models.hf_checkpoints import _read_header, _safetensors_files, hf_read_bytes, load_hf_checkpoint

    path = str(tmp_path / "hf")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="100KB")
    import fsspec

    fs = fsspec.filesystem("file")
    files = _safetensors_files(fs, path)
    assert len(files) >= 2  # the index path
    file_bytes = sum(os.path.getsize(f) for f in files)
    tensor_bytes = sum(t.end - t.start for f in files for t in _read_header(fs, f, "<count-nothing>"))

    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_without_device_count()}
    procs, outs = [], []
    for pid in range(2):
        out = tmp_path / f"reads-{pid}.json"
        code = (f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); import test_multihost as t; "
                f"t.reads_child_main({pid}, {port}, {path!r}, {str(out)!r})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE))
        outs.append(out)
    wait_all(procs)
    results = [json.loads(o.read_text()) for o in outs]
    print(f"checkpoint: {len(files)} files, {file_bytes} bytes, {tensor_bytes} of tensors; per process: "
          + ", ".join(f"read {r['read_bytes']} ({r['read_bytes'] / tensor_bytes:.3f}×), holds {r['held_bytes']}"
                      for r in results) + f"; mesh {results[0]['mesh']}")
    for r in results:
        assert r["mesh"]["data"] == 4 and r["mapping"].get("embed") == "data", r  # FSDP over both processes
        assert r["same_as_levanter"], r
        assert r["reads"] == 1
        assert r["read_bytes"] <= 0.6 * tensor_bytes, (r, tensor_bytes)
    # between them the two processes read every tensor byte once, and each every header
    assert sum(r["read_bytes"] for r in results) == tensor_bytes + 2 * (file_bytes - tensor_bytes)

    before = hf_read_bytes()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    load_hf_checkpoint(path, mesh=mesh, axis_mapping={"embed": "data"})
    assert hf_read_bytes() - before == file_bytes


def test_process_group_config_names_the_bad_field():
    from marinrl.multihost import ProcessGroupConfig

    with pytest.raises(ValueError, match="process_id must be in"):
        ProcessGroupConfig(num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="coordinator_address must be host:port"):
        ProcessGroupConfig(num_processes=2, process_id=0, coordinator_address="localhost")
