"""Bad artifacts never block a run: a corrupt checkpoint, a rollout file the trainer cannot read, checkpoints
piling up, a worker id that makes an odd file name. Real parts throughout: Levanter checkpoints on disk
(corrupted by overwriting a tensorstore chunk), Parquet files through the real encoder, the TrainWorker."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import uuid

import numpy as np
import pytest
from factories import make_batch
from test_train_worker import GROUPS, Producer, make_rollout_batch, train, worker_config

from marinrl.config.replay import OnPolicyConfig
from marinrl.storage import format as rollout_format
from marinrl.storage.rollouts import RolloutReader, RolloutWriter


def corrupt_tensor_chunk(step_dir: pathlib.Path) -> pathlib.Path:
    """Overwrites one zstd chunk of the model's weights with bytes of the same length; metadata.json
    (Levanter's commit marker) stays valid, so the folder is still discovered as a checkpoint."""
    chunks = sorted(p for p in (step_dir / "model").rglob("*") if p.is_file() and not p.name.startswith("."))
    chunk = chunks[0]
    chunk.write_bytes(b"\xff" * chunk.stat().st_size)
    return chunk


def garble_tensor_chunk(step_dir: pathlib.Path) -> pathlib.Path:
    """XORs the middle half of the model's largest chunk, as issue 33 did: a float chunk zstd stored raw
    still decodes, so only the checkpoint's digest tells its weights from garbage."""
    chunk = max((p for p in (step_dir / "model").rglob("*") if p.is_file() and not p.name.startswith(".")),
                key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    lo, hi = len(data) // 4, 3 * len(data) // 4
    data[lo:hi] = bytes(b ^ 0x5A for b in data[lo:hi])
    chunk.write_bytes(bytes(data))
    return chunk


def folders(ckpts: pathlib.Path) -> list[str]:
    return sorted(p.name for p in ckpts.iterdir() if p.is_dir())


# ----------------------------------------------------------------------------- checkpoint fallback


def test_resume_skips_a_garbled_latest_checkpoint_and_trains_every_group_once(tmp_path):
    first_cfg = worker_config(tmp_path, steps=6, sampling=OnPolicyConfig(), run_id="fallback", checkpoint_every=2)
    producer = Producer(first_cfg.weights, first_cfg.rollout_root)
    producer.start()
    first = train(first_cfg)
    ckpts = tmp_path / "ckpt" / "fallback"
    assert first.checkpoint == str(ckpts / "step-5")  # Levanter's index of update 6: weights 6
    chunk = garble_tensor_chunk(ckpts / "step-5")
    (ckpts / "step-5" / "stale-marker").write_text("left by the corrupt checkpoint")

    steps: dict[int, dict] = {}
    second_cfg = worker_config(tmp_path, steps=8, sampling=OnPolicyConfig(), run_id="fallback", checkpoint_every=2)
    second = train(second_cfg, on_step=lambda s, m: steps.__setitem__(s, m))
    producer.halt.set()

    # Resumed from the previous checkpoint (weights 4), saying which one it skipped and why.
    assert (second.first_step, second.final_step) == (4, 8)
    assert sorted(p.name for p in (tmp_path / "logs").glob("fallback*.log*")) == ["fallback.log"]  # not .log.log
    assert second.resumed_from == str(ckpts / "step-3")
    (skipped,) = second.skipped_checkpoints
    assert skipped.startswith(f"{ckpts / 'step-5'}: CheckpointDigestError: ") and str(chunk) in skipped
    assert sorted(steps) == [5, 6, 7, 8]
    assert all(m["checkpoint/skipped_on_resume"] == 1 for m in steps.values())
    assert second.metrics["checkpoint/skipped_on_resume"] == 1

    # The replay cursor came from the same checkpoint as the model: every group trained exactly once,
    # each on its own weights, and the file the first run trained after step-3 is trained again.
    lineage = first.trained_groups[:4] + second.trained_groups
    trained = [gid for groups in lineage for gid in groups]
    assert len(trained) == len(set(trained)) == 8 * GROUPS
    for step, groups in enumerate(lineage, start=1):
        assert {producer.written[gid] for gid in groups} == {step - 1}
    assert set(second.trained_groups[0]) == set(first.trained_groups[4])

    # The corrupt folder was replaced, not written over; the checkpoint resumed from is kept for the run.
    assert not (ckpts / "step-5" / "stale-marker").exists()
    assert json.loads((ckpts / "step-5" / "marinrl.json").read_text())["step"] == 6
    assert folders(ckpts) == ["step-3", "step-5", "step-7"]


def test_resume_with_no_loadable_checkpoint_names_every_checkpoint_tried(tmp_path):
    cfg = worker_config(tmp_path, steps=2, sampling=OnPolicyConfig(), run_id="broken", checkpoint_every=1)
    producer = Producer(cfg.weights, cfg.rollout_root)
    producer.start()
    train(cfg)
    producer.halt.set()
    ckpts = tmp_path / "ckpt" / "broken"
    chunk = corrupt_tensor_chunk(ckpts / "step-1")
    (ckpts / "step-0" / "marinrl.json").unlink()

    with pytest.raises(ValueError) as caught:
        train(worker_config(tmp_path, steps=3, sampling=OnPolicyConfig(), run_id="broken"))
    message = str(caught.value)
    assert message.startswith(f"no checkpoint under {ckpts} loads (2 tried, newest first): ")
    assert "\n" not in message  # one line: a job's error report shows only the first
    assert f"{ckpts / 'step-1'}: " in message and f"{ckpts / 'step-0'}: " in message
    assert str(chunk) in message.split(f"{ckpts / 'step-1'}: ", 1)[1].split("; ")[0]  # the digest names the file
    assert "marinrl.json is missing" in message.split(f"{ckpts / 'step-0'}: ", 1)[1]
    from marinrl.train.checkpoints import NoLoadableCheckpointError

    assert isinstance(caught.value, NoLoadableCheckpointError)
    assert folders(ckpts) == ["step-0", "step-1"]  # nothing deleted: the user decides


# ----------------------------------------------------------------------------- retention


def test_checkpoint_retention_keeps_the_last_n_and_every_kth(tmp_path):
    cfg = worker_config(tmp_path, steps=6, sampling=OnPolicyConfig(), run_id="keep", checkpoint_every=1)
    cfg = dataclasses.replace(cfg, checkpoint_keep=2, checkpoint_keep_every=3)
    ckpts = tmp_path / "ckpt" / "keep"
    seen: dict[int, list[str]] = {}

    def on_step(step, metrics):
        seen[step] = folders(ckpts)
        assert all((ckpts / name / "metadata.json").exists() for name in seen[step])

    producer = Producer(cfg.weights, cfg.rollout_root)
    producer.start()
    result = train(cfg, on_step=on_step)
    producer.halt.set()
    # Folder step-N holds weights N + 1; weights 3 and 6 are multiples of checkpoint_keep_every.
    assert seen == {
        1: ["step-0"],
        2: ["step-0", "step-1"],
        3: ["step-1", "step-2"],
        4: ["step-2", "step-3"],
        5: ["step-2", "step-3", "step-4"],
        6: ["step-2", "step-4", "step-5"],
    }
    assert result.metrics["checkpoint/deleted"] == 3


def _fake_checkpoint(root: pathlib.Path, step: int, minute: int | None) -> None:
    """A step folder as Levanter leaves it: committed (metadata.json) or not (a save that never finished)."""
    (root / f"step-{step}").mkdir(parents=True)
    if minute is not None:
        (root / f"step-{step}" / "metadata.json").write_text(json.dumps(
            {"step": step, "timestamp": f"2030-01-01T00:{minute:02d}:00", "is_temporary": False}))


def test_retention_counts_only_committed_checkpoints_and_spares_the_protected_one(tmp_path):
    from marinrl.train.checkpoints import apply_retention

    for step, minute in [(0, 0), (1, 1), (2, None), (3, 3), (4, 4), (9, None)]:
        _fake_checkpoint(tmp_path, step, minute)
    (tmp_path / "other").mkdir()  # not a step folder: never touched
    deleted = apply_retention(str(tmp_path), keep=1, keep_every=0, protect={str(tmp_path / "step-1")})
    # step-4 is the newest commit; step-1 is protected; step-2 never finished and is older than step-4;
    # step-9 never finished either but may be a save in progress (newer than every commit): kept.
    assert folders(tmp_path) == ["other", "step-1", "step-4", "step-9"]
    assert sorted(pathlib.PurePath(p).name for p in deleted) == ["step-0", "step-2", "step-3"]


def test_retention_settings_are_checked():
    from marinrl.config.train_worker import TrainWorkerConfig

    with pytest.raises(ValueError, match="checkpoint_keep must be >= 1, got 0"):
        TrainWorkerConfig(checkpoint_keep=0)
    with pytest.raises(ValueError, match="checkpoint_keep_every must be >= 0, got -1"):
        TrainWorkerConfig(checkpoint_keep_every=-1)


# ----------------------------------------------------------------------------- unreadable rollout files


def _write_newer_format(writer: RolloutWriter, batch, monkeypatch) -> str:
    """A real file from the real encoder, as a marinrl one format version ahead writes it."""
    with monkeypatch.context() as m:
        m.setattr(rollout_format, "FORMAT_VERSION", rollout_format.FORMAT_VERSION + 1)
        return writer.write(batch)


def test_a_newer_format_version_is_quarantined_with_an_upgrade_hint(tmp_path, monkeypatch, caplog):
    url = str(tmp_path)
    writer = RolloutWriter(url)
    newer = _write_newer_format(writer, make_batch(seed=1, worker_id="newer"), monkeypatch)
    good = make_batch(seed=2, worker_id="w0")
    writer.write(good)
    reader = RolloutReader(url)
    with caplog.at_level(logging.WARNING, logger="marinrl.storage.rollouts"):
        (back,) = reader.read_new()
    assert back.rollouts == good.rollouts
    assert reader.metrics["quarantined_files"] == 1 and reader.metrics["files_read"] == 1
    name = pathlib.PurePath(newer).name
    assert (tmp_path / "quarantine" / "step=00000000" / name).exists()
    assert f"format version {rollout_format.FORMAT_VERSION + 1}" in caplog.text and "upgrade marinrl" in caplog.text
    assert name in caplog.text
    assert reader.read_new() == []  # counted once, never retried


def test_an_entry_that_cannot_be_read_at_all_is_quarantined(tmp_path):
    (tmp_path / "step=00000000" / "w-000000-aaaaaaaaaaaa.parquet").mkdir(parents=True)  # a folder, not a file
    good = make_batch(seed=3)
    RolloutWriter(str(tmp_path)).write(good)
    reader = RolloutReader(str(tmp_path))
    (back,) = reader.read_new()
    assert back.rollouts == good.rollouts and reader.metrics["quarantined_files"] == 1


def test_quarantined_files_reach_the_trainer_metrics_every_step_and_survive_a_resume(tmp_path, monkeypatch):
    cfg = worker_config(tmp_path, steps=2, sampling=OnPolicyConfig(), run_id="quarantine", checkpoint_every=1)
    writer = RolloutWriter(cfg.rollout_root)
    # Both sort before the producer's files ("producer-…"), so they are read before the first batch is whole.
    _write_newer_format(writer, make_rollout_batch(0, np.random.default_rng(1), worker="newer"), monkeypatch)
    (tmp_path / "rollouts" / "step=00000000" / "garbage.parquet").write_bytes(b"PAR1 this is not parquet")
    producer = Producer(cfg.weights, cfg.rollout_root)
    producer.start()
    steps: dict[int, dict] = {}
    first = train(cfg, on_step=lambda s, m: steps.__setitem__(s, m))
    second = train(worker_config(tmp_path, steps=3, sampling=OnPolicyConfig(), run_id="quarantine"),
                         on_step=lambda s, m: steps.__setitem__(s, m))
    producer.halt.set()
    assert (first.final_step, second.first_step, second.final_step) == (2, 2, 3)
    assert [steps[s]["replay/quarantined_files"] for s in (1, 2, 3)] == [2, 2, 2]  # a running total
    assert [steps[s]["replay/file_read_errors"] for s in (1, 2, 3)] == [0, 0, 0]
    assert first.metrics["replay/quarantined_files"] == second.metrics["replay/quarantined_files"] == 2


# ----------------------------------------------------------------------------- worker ids and file names

ODD_WORKER_IDS = [".", "..", ".hidden", ".tmp-w", "/", "a/b/c", " ", "\t\n", "ünïcødé", "工人", "😀", "-", "w" * 300,
                  "quarantine", "step=00000001"]


@pytest.mark.parametrize("kind", ["file", "memory"])
@pytest.mark.parametrize("worker_id", ODD_WORKER_IDS, ids=[f"id{i}" for i in range(len(ODD_WORKER_IDS))])
def test_every_worker_id_gives_a_file_the_reader_reads(tmp_path, kind, worker_id):
    url = str(tmp_path / "root") if kind == "file" else f"memory://ids-{uuid.uuid4().hex[:10]}"
    batch = make_batch(worker_id=worker_id, weight_step=1)
    path = RolloutWriter(url).write(batch)
    name = path.rsplit("/", 1)[-1]
    assert not name.startswith(".") and name.endswith(".parquet") and len(name.encode()) <= 255
    reader = RolloutReader(url)
    (back,) = reader.read_new()
    assert back.metadata.worker_id == worker_id and back.rollouts == batch.rollouts
    assert reader.metrics["quarantined_files"] == 0
