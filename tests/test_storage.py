import dataclasses
import io
import json
import multiprocessing as mp
import os
import re
import signal
import threading

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import batches, encode_batch_v1, make_batch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marinrl.storage import fs as marinrl_fs
from marinrl.storage import rollouts as storage
from marinrl.storage.format import RolloutFormatError, UnsupportedFormatVersion, decode_batch, encode_batch
from marinrl.storage.fs import RolloutStorageError
from marinrl.storage.rollouts import RolloutReader, RolloutWriter
from marinrl.types import RolloutGroup

fixture_settings = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_encode_decode_round_trips_every_field(batch):
    back = decode_batch(encode_batch(batch))
    assert back.metadata == batch.metadata
    assert [g.group_id for g in back.groups] == [g.group_id for g in batch.groups]
    assert back.rollouts == batch.rollouts


@fixture_settings
@given(batch=batches())
def test_writer_reader_round_trip_on_every_filesystem(fsspec_root, batch):
    url, opts = fsspec_root
    writer, reader = RolloutWriter(url, storage_options=opts), RolloutReader(url, storage_options=opts)
    reader.load_state_dict(test_writer_reader_round_trip_on_every_filesystem.cursors.get(url, reader.state_dict()))
    path = writer.write(batch)
    assert re.search(rf"/step={batch.weight_step:08d}/[^/]+-\d{{6}}-[0-9a-f]{{12}}\.parquet$", path)
    (back,) = reader.read_new()
    assert back.rollouts == batch.rollouts and back.metadata == batch.metadata
    test_writer_reader_round_trip_on_every_filesystem.cursors[url] = reader.state_dict()


test_writer_reader_round_trip_on_every_filesystem.cursors = {}


def test_files_are_readable_by_plain_pyarrow_and_pandas(tmp_path):
    batch = make_batch(n_groups=2, group_size=3, weight_step=7)
    path = RolloutWriter(str(tmp_path)).write(batch)
    table = pq.read_table(path)
    assert table.schema.metadata[b"marinrl.format_version"] == b"2"
    df = table.to_pandas()
    assert len(df) == 6 and set(df.weight_step) == {7}
    assert list(df.response_tokens[0]) == batch.rollouts[0].response_tokens.tolist()


V1_FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "rollouts_format_v1.parquet")
"""Written by the version-1 writer (marinrl at f7134af): make_batch(n_groups=2, group_size=2, weight_step=3,
seed=11, response_len=5), before rollout files had `weight_steps`."""


def test_a_version_1_file_still_reads_with_every_token_at_its_weight_step():
    with open(V1_FIXTURE, "rb") as f:
        data = f.read()
    assert pq.read_schema(io.BytesIO(data)).metadata[b"marinrl.format_version"] == b"1"
    assert "weight_steps" not in pq.read_schema(io.BytesIO(data)).names
    back = decode_batch(data, "v1.parquet")
    assert back.rollouts == make_batch(n_groups=2, group_size=2, weight_step=3, seed=11, response_len=5).rollouts
    assert all(r.token_weight_steps.tolist() == [3] * 5 for r in back.rollouts)


def test_the_version_1_helper_writes_the_layout_of_the_genuine_version_1_file():
    with open(V1_FIXTURE, "rb") as f:
        genuine = pq.read_schema(io.BytesIO(f.read()))
    batch = make_batch(n_groups=2, group_size=2, weight_step=3, seed=11, response_len=5)
    helper = pq.read_schema(io.BytesIO(encode_batch_v1(batch)))
    assert helper.equals(genuine, check_metadata=False) and helper.metadata.keys() == genuine.metadata.keys()
    assert helper.metadata[b"marinrl.format_version"] == b"1"
    assert decode_batch(encode_batch_v1(batch)).rollouts == batch.rollouts


def test_per_token_weight_steps_round_trip_and_bad_ones_are_format_errors():
    batch = make_batch(n_groups=1, group_size=2, weight_step=3, response_len=4)
    mixed = dataclasses.replace(batch.rollouts[0], weight_steps=[3, 3, 4, 6])
    batch = dataclasses.replace(batch, groups=(RolloutGroup((mixed, batch.rollouts[1])),))
    back = decode_batch(encode_batch(batch))
    assert back.rollouts[0].token_weight_steps.tolist() == [3, 3, 4, 6]
    assert back.rollouts[1].weight_steps is None and back.rollouts == batch.rollouts
    table = pq.read_table(io.BytesIO(encode_batch(batch)))
    for bad, problem in (([[3, 3, 4, 2], [3] * 4], "below the batch's weight_step 3"),
                         ([[3, 5, 4, 6], [3] * 4], "decreases inside a row"),
                         ([[3, 3, 4], [3] * 4], "weight_steps has length 3")):
        column = pa.array(bad, type=table.schema.field("weight_steps").type)
        broken = table.set_column(table.schema.get_field_index("weight_steps"), table.schema.field("weight_steps"),
                                  column)
        sink = io.BytesIO()
        pq.write_table(broken, sink)
        with pytest.raises(RolloutFormatError, match=problem):
            decode_batch(sink.getvalue())


def test_reader_is_incremental_and_filters_by_step(fsspec_root):
    url, opts = fsspec_root
    writer, reader = RolloutWriter(url, storage_options=opts), RolloutReader(url, storage_options=opts)
    assert reader.read_new() == []  # the root does not exist yet
    for step in (0, 1, 2):
        writer.write(make_batch(weight_step=step, seed=step))
    assert [b.weight_step for b in reader.read_new(min_step=1)] == [1, 2]
    assert reader.read_new() == []
    writer.write(make_batch(weight_step=0, seed=9))  # below the floor: never returned
    writer.write(make_batch(weight_step=3, seed=3))
    assert [b.weight_step for b in reader.read_new()] == [3]
    assert reader.metrics["files_read"] == 3 and reader.metrics["rollouts_read"] == 24


def test_max_files_leaves_the_rest_for_the_next_call():
    url = "memory://max-files"
    writer, reader = RolloutWriter(url), RolloutReader(url)
    for i in range(5):
        writer.write(make_batch(weight_step=i % 2, seed=i))
    first = reader.read_new(max_files=3)
    rest = reader.read_new(max_files=3)
    assert len(first) == 3 and len(rest) == 2 and reader.read_new() == []


def test_cursor_restore_is_exactly_once(fsspec_root):
    url, opts = fsspec_root
    writer = RolloutWriter(url, storage_options=opts)
    for i in range(4):
        writer.write(make_batch(weight_step=i // 2, seed=i))
    reader = RolloutReader(url, storage_options=opts)
    seen = reader.read_new(max_files=3)
    saved = json.loads(json.dumps(reader.state_dict()))  # what a checkpoint holds
    after_save = reader.read_new()  # consumed after the checkpoint: lost with the crash
    for i in range(4, 6):
        writer.write(make_batch(weight_step=2, seed=i))
    resumed = RolloutReader(url, storage_options=opts)
    resumed.load_state_dict(saved)
    again = resumed.read_new()
    ids = lambda bs: [g.group_id for b in bs for g in b.groups]  # noqa: E731
    assert ids(again) == ids(after_save) + ids(again)[len(ids(after_save)):]
    assert len(again) == 3
    assert sorted(ids(seen) + ids(again)) == sorted(ids(seen) + ids(after_save) + ids(again[1:]))
    assert not set(ids(seen)) & set(ids(again))


def test_malformed_cursor_is_a_clear_error():
    with pytest.raises(ValueError, match="RolloutReader state is malformed"):
        RolloutReader("memory://x").load_state_dict({"floor": "a"})


def _write_many(url: str, worker_index: int, n: int):
    """Worker k writes batches with seeds k·n … k·n + n − 1: distinct across workers in every process
    (`hash()` of a string is salted per process, and its seeds collided)."""
    writer = RolloutWriter(url)
    for i in range(n):
        writer.write(make_batch(n_groups=1, group_size=2, weight_step=i % 3, worker_id=f"w{worker_index}",
                                seed=worker_index * n + i))


def test_concurrent_writers_and_a_restarting_reader(tmp_path):
    url = f"file://{tmp_path}/root"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(url, k, 15)) for k in range(3)]
    for p in procs:
        p.start()
    reader = RolloutReader(url)
    got: list[str] = []
    restarted = False
    while any(p.is_alive() for p in procs) or not restarted:
        got += [g.group_id for b in reader.read_new() for g in b.groups]
        if not restarted and len(got) >= 10:
            state = reader.state_dict()
            reader = RolloutReader(url)
            reader.load_state_dict(state)
            restarted = True
    for p in procs:
        p.join()
        assert p.exitcode == 0
    got += [g.group_id for b in reader.read_new() for g in b.groups]
    assert len(got) == 45 and len(set(got)) == 45
    assert reader.metrics["quarantined_files"] == 0
    assert not list((tmp_path / "root").rglob(".tmp-*"))


def test_reader_ignores_temporary_files(tmp_path):
    """A temporary name is never read, even holding a whole valid file, nor quarantined; the finished
    file beside it is read (a reader that reads nothing fails here)."""
    batch = make_batch(weight_step=1, seed=3)
    path = RolloutWriter(str(tmp_path)).write(batch)
    folder = tmp_path / "step=00000001"
    (folder / ".tmp-w-000000-abc.parquet").write_bytes(b"half a file")
    (folder / ".tmp-w-000001-def.parquet").write_bytes(encode_batch(make_batch(weight_step=1, seed=4)))
    reader = RolloutReader(str(tmp_path))
    (back,) = reader.read_new()
    assert back.rollouts == batch.rollouts and back.metadata == batch.metadata
    assert reader.metrics["files_read"] == 1 and reader.metrics["quarantined_files"] == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted([os.path.basename(path), ".tmp-w-000000-abc.parquet",
                                                               ".tmp-w-000001-def.parquet"])


class HalfWriteFileSystem(LocalFileSystem):
    """A real local filesystem whose `pipe_file` writes the first half of the bytes to disk, sets
    `half_written`, and writes the rest only once `release` is set: a write stopped halfway, on demand."""

    cachable = False

    def __init__(self, half_written, release, **kwargs):
        super().__init__(**kwargs)
        self.half_written, self.release = half_written, release

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        with open(self._strip_protocol(path), "wb") as f:
            f.write(value[: len(value) // 2])
            f.flush()
            os.fsync(f.fileno())
            self.half_written.set()
            self.release.wait()
            f.write(value[len(value) // 2:])


def _assert_reader_sees_nothing_partial(root) -> RolloutReader:
    """A fresh reader lists and reads `root`: no batch, and nothing it had to quarantine as unreadable."""
    reader = RolloutReader(str(root))
    assert reader.read_new() == []
    assert reader.metrics["quarantined_files"] == 0 and not (root / "quarantine").exists()
    return reader


def test_a_write_stopped_halfway_is_invisible_to_readers(tmp_path):
    root = tmp_path / "root"
    half_written, release = threading.Event(), threading.Event()
    writer = RolloutWriter(str(root), fs=HalfWriteFileSystem(half_written, release))
    batch = make_batch(weight_step=3)
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("path", writer.write(batch)))
    thread.start()
    try:
        assert half_written.wait(60), "the writer never started writing"
        assert [p.stat().st_size > 0 for p in root.rglob("*.parquet")] == [True]  # half a file is on disk
        reader = _assert_reader_sees_nothing_partial(root)
    finally:
        release.set()
        thread.join(60)
    (back,) = reader.read_new()  # the same reader, after the write completed: the whole batch
    assert back.rollouts == batch.rollouts and done["path"].endswith(".parquet")


def _write_and_hang(root: str, half_written) -> None:
    """A writer process that stops halfway through its file and waits forever (until SIGKILLed)."""
    RolloutWriter(root, fs=HalfWriteFileSystem(half_written, threading.Event())).write(make_batch(weight_step=1))


def test_a_writer_killed_mid_write_leaves_no_partial_file_for_readers(tmp_path):
    root = tmp_path / "root"
    ctx = mp.get_context("spawn")
    half_written = ctx.Event()
    proc = ctx.Process(target=_write_and_hang, args=(str(root), half_written))
    proc.start()
    try:
        assert half_written.wait(120), "the writer process never started writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert len(list(root.rglob("*.parquet"))) == 1  # the half-written file it left behind
    reader = _assert_reader_sees_nothing_partial(root)
    path = RolloutWriter(str(root)).write(make_batch(weight_step=1, seed=5))  # later writers are unaffected
    assert [len(b) for b in reader.read_new()] == [8] and path.endswith(".parquet")


def _future_version_file(batch) -> bytes:
    table = pq.read_table(pa.BufferReader(encode_batch(batch)))
    meta = dict(table.schema.metadata)
    meta[b"marinrl.format_version"] = b"99"
    sink = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(meta), sink)
    return sink.getvalue()


def test_unparseable_files_are_quarantined_and_counted(fsspec_root):
    url, opts = fsspec_root
    writer, reader = RolloutWriter(url, storage_options=opts), RolloutReader(url, storage_options=opts)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    good = writer.write(make_batch(weight_step=1))
    fs.pipe_file(f"{root}/step=00000001/a-garbage.parquet", b"PAR1 this is not parquet")
    not_ours = io.BytesIO()
    pq.write_table(pa.table({"x": [1, 2]}), not_ours)
    fs.pipe_file(f"{root}/step=00000001/b-foreign.parquet", not_ours.getvalue())
    batches_read = reader.read_new()
    assert len(batches_read) == 1
    assert reader.metrics["quarantined_files"] == 2 and reader.metrics["files_read"] == 1
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/quarantine")) == ["a-garbage.parquet",
                                                                                    "b-foreign.parquet"]
    assert fs.exists(fs._strip_protocol(good))
    summary = storage.summarize(url, storage_options=opts)
    assert summary["totals"]["quarantined"] == 2 and summary["totals"]["files"] == 1


def test_a_future_format_version_is_refused_by_decode_and_quarantined_by_the_reader():
    url = "memory://future"
    fs, root = fsspec.core.url_to_fs(url)
    data = _future_version_file(make_batch())
    with pytest.raises(UnsupportedFormatVersion, match="format version 99 is newer"):
        decode_batch(data)
    fs.pipe_file(f"{root}/step=00000000/w-000000-future.parquet", data)
    reader = RolloutReader(url)
    assert reader.read_new() == [] and reader.metrics["quarantined_files"] == 1
    assert fs.exists(f"{root}/quarantine/step=00000000/w-000000-future.parquet")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_corrupted_bytes_raise_format_errors_only(data):
    original = make_batch(n_groups=1, group_size=2)
    raw = bytearray(encode_batch(original))
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        back = decode_batch(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw), "f")
    except RolloutFormatError as e:
        assert str(e).startswith("f:")
    else:  # decoded: the damage hit bytes nothing reads, never a value (no silent corruption)
        assert back.metadata == original.metadata and back.rollouts == original.rollouts


def test_every_single_flipped_byte_is_refused_or_changes_nothing():
    """Deterministic beside the property above: each byte of a file flipped in turn (all of them) either
    fails to decode with a RolloutFormatError or decodes to the very batch written, never to other values."""
    original = make_batch(n_groups=2, group_size=2)
    raw = encode_batch(original)
    silent = []
    for i in range(len(raw)):
        damaged = bytearray(raw)
        damaged[i] ^= 0xFF
        try:
            back = decode_batch(bytes(damaged), "f")
        except RolloutFormatError:
            continue
        if not (back.metadata == original.metadata and back.rollouts == original.rollouts):
            silent.append(i)
    assert not silent, f"{len(silent)} of {len(raw)} single-byte flips decoded to other values, first at {silent[:5]}"


_BASE64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def test_base64_character_changes_in_the_footer_metadata_are_refused_or_change_nothing():
    """The footer carries the Arrow schema and the batch metadata as base64 text; flipping a byte with ^0xFF
    never leaves base64, so the test above cannot see metadata outside the CRC. Here every character of the
    longest base64 run is replaced by the next of the alphabet, and each adjacent pair swapped: whatever
    still parses must decode to the very batch written (worker, weight step, group order included)."""
    original = make_batch(n_groups=2, group_size=2)
    raw = encode_batch(original)
    footer = len(raw) - 8 - int.from_bytes(raw[-8:-4], "little")
    run = max(re.finditer(rb"[A-Za-z0-9+/]{200,}", raw[footer:]), key=lambda m: len(m.group(0)))
    lo, hi = footer + run.start(), footer + run.end()
    changed = []
    for i in range(lo, hi):
        for k in (1,):
            damaged = bytearray(raw)
            damaged[i] = _BASE64[(_BASE64.index(raw[i]) + k) % 64]
            changed.append(bytes(damaged))
        if i + 1 < hi and raw[i] != raw[i + 1]:
            damaged = bytearray(raw)
            damaged[i], damaged[i + 1] = raw[i + 1], raw[i]
            changed.append(bytes(damaged))
    silent, decoded = 0, 0
    for damaged in changed:
        try:
            back = decode_batch(damaged, "f")
        except RolloutFormatError:
            continue
        decoded += 1
        if not (back.metadata == original.metadata and back.rollouts == original.rollouts
                and [g.group_id for g in back.groups] == [g.group_id for g in original.groups]):
            silent += 1
    assert silent == 0, f"{silent} of {len(changed)} base64 changes ({decoded} decoded) decoded to other values"


class FlakyFileSystem(MemoryFileSystem):
    """A real in-memory fsspec filesystem whose reads fail while `failures_left` > 0."""

    protocol = "flakymem"
    failures_left = 0
    fail_paths: tuple[str, ...] = ()

    def cat_file(self, path, start=None, end=None, **kwargs):
        if FlakyFileSystem.failures_left > 0 and any(p in path for p in FlakyFileSystem.fail_paths):
            FlakyFileSystem.failures_left -= 1
            raise ConnectionError(f"injected fault reading {path}")
        return super().cat_file(path, start, end, **kwargs)


@pytest.fixture
def flaky(monkeypatch):
    fsspec.register_implementation("flakymem", FlakyFileSystem, clobber=True)
    monkeypatch.setattr(marinrl_fs.time, "sleep", lambda s: None)  # backoff without waiting
    FlakyFileSystem.failures_left = 0
    yield FlakyFileSystem
    FlakyFileSystem.failures_left = 0


def test_transient_faults_are_retried(flaky):
    url = "flakymem://retry"
    RolloutWriter(url).write(make_batch(weight_step=0))
    flaky.fail_paths, flaky.failures_left = ("step=",), 3
    reader = RolloutReader(url)
    assert len(reader.read_new()) == 1 and flaky.failures_left == 0


def test_persistent_faults_surface_with_the_path_and_lose_nothing(flaky):
    url = "flakymem://persistent"
    writer = RolloutWriter(url)
    first = writer.write(make_batch(weight_step=0, seed=1))
    second = writer.write(make_batch(weight_step=1, seed=2))
    reader = RolloutReader(url)
    flaky.fail_paths, flaky.failures_left = (second.rsplit("/", 1)[-1],), 10**6
    assert [b.weight_step for b in reader.read_new()] == [0]  # what was readable comes back
    with pytest.raises(RolloutStorageError, match=re.escape(second.split("://", 1)[-1])):
        reader.read_new()
    assert reader.metrics["read_errors"] == 2 and reader.metrics["quarantined_files"] == 0
    flaky.failures_left = 0
    assert [b.weight_step for b in reader.read_new()] == [1]
    assert first != second


def test_retention_deletes_old_steps_but_keeps_the_quarantine(tmp_path):
    url = str(tmp_path)
    writer = RolloutWriter(url, retain_steps=2)
    (tmp_path / "quarantine" / "step=00000000").mkdir(parents=True)
    (tmp_path / "quarantine" / "step=00000000" / "x.parquet").write_bytes(b"x")
    for step in range(6):
        writer.write(make_batch(weight_step=step, seed=step))
    assert sorted(p.name for p in tmp_path.glob("step=*")) == [f"step={s:08d}" for s in (3, 4, 5)]
    assert (tmp_path / "quarantine" / "step=00000000" / "x.parquet").exists()
    assert writer.metrics["steps_deleted"] == 3
    assert storage.delete_steps_before(url, 5) == [3, 4]


def test_writer_rejects_negative_retention():
    with pytest.raises(ValueError, match="retain_steps"):
        RolloutWriter("memory://r", retain_steps=-1)


def test_summarize_reports_steps_envs_and_finish_reasons():
    url = "memory://summary"
    writer = RolloutWriter(url)
    writer.write(make_batch(n_groups=2, group_size=4, weight_step=0, env_name="a"))
    writer.write(make_batch(n_groups=1, group_size=4, weight_step=1, env_name="b", seed=3))
    s = storage.summarize(url)
    assert s["steps"]["0"]["rollouts"] == 8 and s["steps"]["0"]["groups"] == 2 and s["steps"]["1"]["files"] == 1
    assert s["envs"]["a"]["finish_reasons"] == {"stop": 8} and s["envs"]["b"]["response_length"]["mean"] == 3
    assert s["totals"] == {"files": 2, "rollouts": 12, "groups": 3, "unreadable": 0, "quarantined": 0}
    rewards = [r.episode_reward for r in make_batch(n_groups=2, group_size=4, env_name="a").rollouts]
    assert s["envs"]["a"]["reward"]["mean"] == pytest.approx(np.mean(rewards))


# ----------------------------------------------------------------------------- requests per poll (issue 30)


def _counted_root(name: str, latency_s: float = 0.0):
    """A fresh memory root behind a SimulatedStore whose stats label a listing of the root itself."""
    from marinrl.storage.simulated import RequestStats, SimulatedStore

    root = f"/fleet-{name}-{os.getpid()}-{threading.get_ident()}"
    stats = RequestStats(labeler=lambda p: "root" if p.rstrip("/") == root else "step")
    return root, stats, SimulatedStore(latency_s=latency_s, stats=stats)


def test_reader_requests_per_poll_grow_with_the_files_written_not_the_runs_history():
    """A trainer's polls over a run of 60 steps, 4 hosts writing one file each per step: every poll
    lists the root never after the first, lists a bounded number of step folders and reads exactly
    the new files, so the last ten polls cost what the first ten did."""
    root, stats, fs = _counted_root("history")
    writer, reader = RolloutWriter(root, fs=fs), RolloutReader(root, fs=fs)
    per_poll, reads = [], []
    for step in range(60):
        for host in range(4):
            writer.write(make_batch(weight_step=step, seed=step * 4 + host))
        stats.reset()
        got = reader.read_new(min_step=max(0, step - 1), max_step=step)
        assert len(got) == 4
        per_poll.append(stats.total())
        reads.append(stats.total(kind="read"))
    assert stats.total(kind="list", label="root") == 0 and reader.root_listings == 1
    assert reads == [4] * 60
    assert sum(per_poll[-10:]) <= sum(per_poll[1:11])
    assert max(per_poll[1:]) <= 4 + storage.PROBE_STEPS + 2


def test_reader_finds_every_file_of_a_late_or_skipped_step_and_still_reads_each_once():
    """Files of a step below the trainer's (a slow host), a step nobody wrote before, and a step above
    `max_step` found by the periodic root listing: each returned exactly once."""
    root, stats, fs = _counted_root("late")
    writer = RolloutWriter(root, fs=fs)
    reader = RolloutReader(root, fs=fs, rescan_every=5)
    writer.write(make_batch(weight_step=30, seed=1))  # a previous run's future: seen by the first listing
    assert [b.weight_step for b in reader.read_new(min_step=0, max_step=3)] == [30]
    seen = []
    for step in range(4, 20):
        writer.write(make_batch(weight_step=step, seed=step))
        if step == 12:
            writer.write(make_batch(weight_step=9, seed=99))  # a late file in a step folder seen before
            writer.write(make_batch(weight_step=7, seed=98))  # a step no host had written
        seen += [b.weight_step for b in reader.read_new(min_step=0, max_step=step)]
    assert sorted(seen) == sorted([*range(4, 20), 9, 7])


def test_reader_reads_a_polls_files_concurrently_in_a_bounded_pool():
    root, stats, fs = _counted_root("pool", latency_s=0.01)
    writer = RolloutWriter(root, fs=fs)
    for i in range(40):
        writer.write(make_batch(weight_step=0, seed=i))
    reader = RolloutReader(root, fs=fs, max_concurrent_reads=8)
    stats.reset()
    assert len(reader.read_new(max_step=0)) == 40
    assert 1 < stats.max_in_flight <= 8
    reader.close()
