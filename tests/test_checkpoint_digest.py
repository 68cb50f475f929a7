"""Checkpoint digests (marinrl/train/checkpoints.py) on real files: a garbled, truncated or missing file is
named, a save that never wrote its digest is not trusted, a resume and a trainer's death message skip such a
checkpoint, and a NaN loss right after a resume is blamed on that checkpoint, not advised as a resume point."""

from __future__ import annotations

import datetime
import json
import pathlib

import pytest

from marinrl.train.checkpoints import (
    CheckpointDigestError,
    load_newest,
    newest_loadable,
    verify_digest,
    write_digest,
)


def _checkpoint(root: pathlib.Path, step: int, minute: int, *, digest: bool = True) -> pathlib.Path:
    """A committed step folder as the TrainWorker leaves one: chunks, sidecar (promising a digest), commit
    marker, digest."""
    folder = root / f"step-{step}"
    (folder / "model" / "w").mkdir(parents=True)
    (folder / "model" / "w" / "c.0").write_bytes(bytes(range(256)) * 64)
    (folder / "model" / "w" / "c.1").write_bytes(b"\x01" * 1000)
    (folder / "marinrl.json").write_text(json.dumps({"step": step + 1, "replay": {}, "digest": True}))
    stamp = datetime.datetime(2026, 1, 1, 0, minute).isoformat()
    (folder / "metadata.json").write_text(json.dumps({"step": step, "timestamp": stamp}))
    if digest:
        write_digest(str(folder))
    return folder


def test_an_intact_checkpoint_verifies_and_any_changed_byte_is_named(tmp_path):
    folder = _checkpoint(tmp_path, 1, 0)
    assert verify_digest(str(folder), required=True)
    chunk = folder / "model" / "w" / "c.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same length
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointDigestError, match=f"{folder} is damaged: {chunk} does not match its digest"):
        verify_digest(str(folder), required=True)


def test_a_truncated_or_missing_file_is_named(tmp_path):
    folder = _checkpoint(tmp_path, 1, 0)
    chunk = folder / "model" / "w" / "c.1"
    chunk.write_bytes(b"\x01" * 10)
    with pytest.raises(CheckpointDigestError, match=f"{chunk} has 10 bytes, its digest says 1000"):
        verify_digest(str(folder), required=True)
    chunk.unlink()
    with pytest.raises(CheckpointDigestError, match=f"{chunk} is missing"):
        verify_digest(str(folder), required=True)


def test_a_promised_digest_that_was_never_written_is_not_trusted(tmp_path):
    folder = _checkpoint(tmp_path, 1, 0, digest=False)
    assert verify_digest(str(folder), required=False) is False  # a checkpoint from before digests
    with pytest.raises(CheckpointDigestError, match="promises one: the save was interrupted"):
        verify_digest(str(folder), required=True)
    assert newest_loadable(str(tmp_path)) is None


def test_resume_skips_a_checkpoint_whose_files_changed_even_if_it_loads(tmp_path):
    _checkpoint(tmp_path, 1, 0)
    newest = _checkpoint(tmp_path, 3, 1)
    (newest / "model" / "w" / "c.0").write_bytes(b"\x00" * (256 * 64))  # decodes fine, as garbage
    resumed = load_newest(str(tmp_path), lambda folder: folder.step)  # a load that would succeed
    assert resumed.loaded == 1 and resumed.folder.name == "step-1"
    (skipped,) = resumed.skipped
    assert skipped.startswith(f"{newest}: CheckpointDigestError: {newest} is damaged")
    assert newest_loadable(str(tmp_path)).name == "step-1"


def test_the_death_message_never_advises_a_damaged_checkpoint(tmp_path):
    from marinrl.job.outcomes import trainer_death_message

    good = _checkpoint(tmp_path, 1, 0)
    bad = _checkpoint(tmp_path, 3, 1)
    (bad / "model" / "w" / "c.1").write_bytes(b"\x02" * 1000)
    message = trainer_death_message(RuntimeError("the trainer process was killed"), str(tmp_path))
    assert f"resume from its last checkpoint, {good}" in message and str(bad) not in message


def test_a_nan_loss_after_a_resume_blames_that_checkpoint(tmp_path):
    from marinrl.job.outcomes import trainer_death_message

    folder = _checkpoint(tmp_path, 3, 1)
    error = RuntimeError(f"Loss is NaN at the first step after resuming from {folder}: that checkpoint's state "
                         "is probably broken")
    message = trainer_death_message(error, str(tmp_path))
    assert message.splitlines()[1].startswith(f"move {folder} out of {tmp_path} and run the same config again")
    assert "resume from its last checkpoint" not in message
    plain_nan = trainer_death_message(RuntimeError("Loss is NaN"), str(tmp_path))
    assert "lower optimizer.learning_rate" in plain_nan and "run the same config again to resume" not in plain_nan
