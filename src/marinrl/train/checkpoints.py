"""The trainer's checkpoint folders: which exist, resuming from the newest one that loads, retention.

Levanter writes `ROOT/step-N/` (N is its 0-based index of the last update, so the folder holds
weights N + 1) and commits it by writing `metadata.json` last; the TrainWorker adds `marinrl.json`
(the replay cursor and the curriculum state) before that commit. Levanter itself loads only the
latest checkpoint and fails if it does not load, and its `CheckpointerConfig.keep` is a save cadence,
not a retention policy (it never deletes a step checkpoint), so both live here. A checkpoint carries
`marinrl.digest.json`, the CRC32 and size of every file in it, written once the save commits and checked
before a resume or `marinrl eval` trusts it: a chunk garbled so that it still decodes would otherwise load
as weights (docs/training.md, "Digest").
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import re
import zlib
from typing import Callable, Collection, Generic, TypeVar

import fsspec

from marinrl.storage.fs import RolloutStorageError, list_names, with_retries

logger = logging.getLogger(__name__)

SIDECAR = "marinrl.json"
"""Our part of a trainer checkpoint, written into Levanter's `step-N/` folder before its
`metadata.json` (Levanter's commit marker), so an interrupted save is never discovered."""
COMMIT_MARKER = "metadata.json"
DIGEST = "marinrl.digest.json"
"""The CRC32 and size of every other file of a checkpoint folder, written after Levanter's commit; the
sidecar's `"digest": true` promises it, so a save killed between the commit and the digest is not trusted."""
_DIGEST_BLOCK = 16 << 20
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
_UNKNOWN_TIME = datetime.datetime.min

T = TypeVar("T")


class NoLoadableCheckpointError(ValueError):
    """Every committed checkpoint of the run failed to load; the message (one line, as a job reports only
    the first) names each one and why. A ValueError: a rerun repeats it until the folders or config change."""


@dataclasses.dataclass(frozen=True)
class StepFolder:
    path: str
    """The folder's URL, in the form the checkpoint root was given."""
    step: int
    """Levanter's index of the last update saved: the folder holds weights `step + 1`."""
    committed_at: datetime.datetime | None
    """`metadata.json`'s timestamp (`datetime.min` if unreadable); None: the save never finished."""

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def _newest_first_key(folder: StepFolder):
    return folder.committed_at or _UNKNOWN_TIME, folder.step  # Levanter's discovery order


def step_folders(root: str) -> list[StepFolder]:
    """The `step-N` folders directly under `root`, committed or not (none if `root` does not exist).
    `root` may itself be one committed checkpoint folder (a `load_checkpoint_path` naming one)."""
    fs, plain = fsspec.core.url_to_fs(root)
    plain, root = plain.rstrip("/"), root.rstrip("/")
    fs.invalidate_cache(plain)
    own = _commit_time(fs, plain)
    if own is not None:
        m = _STEP_FOLDER.match(root.rsplit("/", 1)[-1])
        return [StepFolder(root, int(m.group(1)) if m else 0, own)]
    out = []
    for name in list_names(fs, plain):
        m = _STEP_FOLDER.match(name)
        if m and fs.isdir(f"{plain}/{name}"):
            out.append(StepFolder(f"{root}/{name}", int(m.group(1)), _commit_time(fs, f"{plain}/{name}")))
    return out


def _commit_time(fs, plain: str) -> datetime.datetime | None:
    try:
        raw = with_retries(lambda: fs.cat_file(f"{plain}/{COMMIT_MARKER}"), "reading", f"{plain}/{COMMIT_MARKER}")
    except FileNotFoundError:
        return None
    try:
        return datetime.datetime.fromisoformat(json.loads(raw)["timestamp"])
    except (ValueError, KeyError, TypeError):
        return _UNKNOWN_TIME  # committed, but when is unknown: tried last


def read_sidecar(folder: str) -> dict:
    """The folder's `marinrl.json`; raises ValueError saying what is wrong with it."""
    fs, plain = fsspec.core.url_to_fs(f"{folder.rstrip('/')}/{SIDECAR}")
    try:
        raw = with_retries(lambda: fs.cat_file(plain), "reading", plain)
    except FileNotFoundError:
        raise ValueError(f"no {SIDECAR}: not written by marinrl's TrainWorker, so the rollout stream "
                         "cannot resume exactly") from None
    try:
        sidecar = json.loads(raw)
        int(sidecar["step"])
        if not isinstance(sidecar["replay"], dict):
            raise TypeError("replay is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{SIDECAR} is not a valid trainer sidecar ({type(e).__name__}: {e})") from None
    return sidecar


class CheckpointDigestError(ValueError):
    """A checkpoint's files do not match its digest (garbled, truncated, missing), or the digest it
    promised was never written; the message names the folder and the first file that differs."""


def _files(fs, plain: str) -> dict[str, int]:
    """Relative path -> size of every file under `plain` but the commit marker and the digest itself."""
    found = fs.find(plain, detail=True)
    out = {}
    for path, info in found.items():
        rel = path[len(plain):].lstrip("/")
        if info.get("type") == "file" and rel not in (COMMIT_MARKER, DIGEST):
            out[rel] = int(info["size"])
    return out


def _crc32(fs, path: str) -> int:
    crc = 0
    with fs.open(path, "rb") as f:
        while block := f.read(_DIGEST_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def write_digest(folder: str) -> dict:
    """Writes `folder/marinrl.digest.json`: {relative path: {"bytes", "crc32"}} of every file in it."""
    fs, plain = fsspec.core.url_to_fs(folder)
    plain = plain.rstrip("/")
    fs.invalidate_cache(plain)
    files = {rel: {"bytes": size, "crc32": _crc32(fs, f"{plain}/{rel}")}
             for rel, size in sorted(_files(fs, plain).items())}
    with_retries(lambda: fs.pipe_file(f"{plain}/{DIGEST}", json.dumps({"files": files}).encode()),
                 "writing", f"{plain}/{DIGEST}")
    return files


def verify_digest(folder: str, *, required: bool) -> bool:
    """Checks every file of `folder` against its digest; raises CheckpointDigestError naming the first
    that differs. A folder with no digest: an error if `required` (its sidecar promised one), else False
    (a checkpoint written before digests, or by Levanter alone: nothing to check)."""
    fs, plain = fsspec.core.url_to_fs(folder)
    plain = plain.rstrip("/")
    try:
        raw = with_retries(lambda: fs.cat_file(f"{plain}/{DIGEST}"), "reading", f"{plain}/{DIGEST}")
    except FileNotFoundError:
        if required:
            raise CheckpointDigestError(f"{folder} has no {DIGEST} though its {SIDECAR} promises one: the save was "
                                        "interrupted before its files were summed, so they cannot be trusted") from None
        return False
    try:
        expected = {str(k): (int(v["bytes"]), int(v["crc32"])) for k, v in json.loads(raw)["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointDigestError(f"{folder}/{DIGEST} is not a valid digest ({type(e).__name__}: {e})") from None
    fs.invalidate_cache(plain)
    present = _files(fs, plain)
    for rel, (size, crc) in expected.items():
        where = f"{plain}/{rel}"
        if rel not in present:
            raise CheckpointDigestError(f"{folder} is damaged: {where} is missing")
        if present[rel] != size:
            raise CheckpointDigestError(f"{folder} is damaged: {where} has {present[rel]} bytes, its digest says "
                                        f"{size}")
        if _crc32(fs, where) != crc:
            raise CheckpointDigestError(f"{folder} is damaged: {where} does not match its digest (CRC32): the file "
                                        "was changed after the checkpoint was written")
    return True


def promises_digest(folder: str) -> bool:
    """Whether the folder's sidecar says a digest was to be written after the commit."""
    try:
        return bool(read_sidecar(folder).get("digest"))
    except ValueError:
        return False


def verified(folder: str) -> None:
    """Checks `folder` against its digest (required if its sidecar promises one); CheckpointDigestError if not."""
    verify_digest(folder, required=promises_digest(folder))


def newest_loadable(root: str) -> StepFolder | None:
    """The newest committed checkpoint under `root` whose files match their digest: what a rerun resumes
    from, as far as its files tell (a state that no longer fits the config is found only by loading it)."""
    for folder in sorted((f for f in step_folders(root) if f.committed_at is not None), key=_newest_first_key,
                         reverse=True):
        try:
            verified(folder.path)
        except (CheckpointDigestError, OSError):
            continue
        return folder
    return None


@dataclasses.dataclass
class Resumed(Generic[T]):
    loaded: T
    """What `load` returned for the checkpoint resumed from."""
    folder: StepFolder
    skipped: list[str]
    """`<path>: <why>` of each newer checkpoint that did not load."""


def load_newest(root: str, load: Callable[[StepFolder], T]) -> Resumed[T] | None:
    """Calls `load` on the committed checkpoints under `root`, newest first, until one succeeds.

    None if there is no committed checkpoint. A checkpoint that fails (files that do not match its
    digest, a corrupt tensor chunk, a missing or bad sidecar, a state that does not fit the config) is
    logged and skipped; it stays on disk (retention removes it once newer checkpoints are committed). Raises
    NoLoadableCheckpointError naming every checkpoint tried if none loads.
    """
    candidates = sorted((f for f in step_folders(root) if f.committed_at is not None), key=_newest_first_key,
                        reverse=True)
    skipped: list[str] = []
    for folder in candidates:
        try:
            verified(folder.path)  # a garbled chunk may still decode: its bytes would load as weights
            loaded = load(folder)
        except Exception as e:  # whatever the reason, an older checkpoint may still load
            reason = _describe(e)
            logger.warning("checkpoint %s does not load, trying the one before it: %s", folder.path, reason)
            skipped.append(f"{folder.path}: {reason}")
            continue
        if skipped:
            logger.warning("resumed from %s (weights %d), skipping %d newer checkpoint(s) that did not load",
                           folder.path, folder.step + 1, len(skipped))
        return Resumed(loaded, folder, skipped)
    if not candidates:
        return None
    raise NoLoadableCheckpointError(
        f"no checkpoint under {root} loads ({len(candidates)} tried, newest first): " + "; ".join(skipped)
        + ". If they all fail the same way, the config probably no longer matches them (model shape, optimizer); "
          f"to start this run from step 0 instead, move the step-* folders out of {root}")


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}{'…' if len(text) > 400 else ''}"


def apply_retention(root: str, *, keep: int, keep_every: int, protect: Collection[str] = ()) -> list[str]:
    """Deletes checkpoint folders a resume no longer needs; returns the paths deleted.

    Kept: the `keep` newest committed checkpoints (in Levanter's discovery order), those whose weight
    step (`step + 1`) is a multiple of `keep_every` (0: none), and the folders in `protect`. Deleted:
    the other committed ones, and unfinished saves (no `metadata.json`) older than the newest commit.
    Call it only after a commit and with no save in flight: only then is an unfinished folder older
    than the newest commit surely dead. Deletion is housekeeping: a failure is logged, never raised.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    folders = step_folders(root)
    committed = sorted((f for f in folders if f.committed_at is not None), key=_newest_first_key, reverse=True)
    if not committed:
        return []
    protected = {_plain(p) for p in protect}
    doomed = [f for f in committed[keep:] if not (keep_every and (f.step + 1) % keep_every == 0)]
    doomed += [f for f in folders if f.committed_at is None and f.step < committed[0].step]
    deleted = []
    for folder in doomed:
        if _plain(folder.path) in protected:
            continue
        if remove_folder(folder.path, "retention"):
            deleted.append(folder.path)
    return deleted


def remove_folder(path: str, why: str) -> bool:
    """Deletes a checkpoint folder, its commit marker first (so no one discovers a half-deleted
    checkpoint); False (and a log line) if that fails."""
    fs, plain = fsspec.core.url_to_fs(path)
    plain = plain.rstrip("/")
    logger.info("deleting checkpoint folder %s (%s)", path, why)
    try:
        try:
            with_retries(lambda: fs.rm_file(f"{plain}/{COMMIT_MARKER}"), "deleting", f"{plain}/{COMMIT_MARKER}")
        except FileNotFoundError:
            pass
        with_retries(lambda: fs.rm(plain, recursive=True), "deleting", plain)
    except FileNotFoundError:
        return False
    except (OSError, RolloutStorageError) as e:
        logger.warning("could not delete checkpoint folder %s (%s): %r", path, why, e)
        return False
    return True


def _plain(path: str) -> str:
    return fsspec.core.url_to_fs(path)[1].rstrip("/")


RESTORE_CONCURRENT_GB = 1
"""Bytes of a checkpoint read at once when a trainer restores (JAX's default is 32 GB): every array read
is a host buffer and then a device array, so on a CPU, where both are host memory, everything in flight
is held twice (docs/training.md, "Checkpoints and resume")."""


def bound_restore_memory(gigabytes: int = RESTORE_CONCURRENT_GB) -> None:
    """Make tensorstore restores in this process hold what they restore and little else. JAX reads
    checkpoints through one process-wide tensorstore context whose chunk cache may keep 10 GB, so a
    restored state stayed resident twice (measured: a 7.2 GB trainer state rested at 15.6 GB after a
    resume, 8.7 GB after a fresh start; docs/training.md, "Checkpoints and resume"); its reads run with 32 GB in flight.
    Here: no chunk cache (a restore reads each chunk once) and `gigabytes` in flight. Idempotent."""
    import tensorstore as ts
    from jax.experimental.array_serialization import serialization, tensorstore_impl

    fn = tensorstore_impl.async_deserialize  # `_run_deserialization` passes no context: it takes the default
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    defaults = list(fn.__defaults__)
    at = names.index("context") - (len(names) - len(defaults))
    defaults[at] = ts.Context({"file_io_concurrency": {"limit": 128}, "data_copy_concurrency": {"limit": 128},
                               "cache_pool": {"total_bytes_limit": 0}, "cache_pool#remote": {"total_bytes_limit": 0}})
    fn.__defaults__ = tuple(defaults)

    manager = serialization.GlobalAsyncCheckpointManager
    original = getattr(manager.deserialize_with_paths, "__wrapped__", manager.deserialize_with_paths)

    def deserialize_with_paths(self, shardings, paths, global_shapes=None, dtypes=None, concurrent_gb=gigabytes):
        return original(self, shardings, paths, global_shapes, dtypes, min(concurrent_gb, gigabytes))

    deserialize_with_paths.__wrapped__ = original
    manager.deserialize_with_paths = deserialize_with_paths


def release_host_memory() -> None:
    """Return the C heap's free memory to the OS (glibc's `malloc_trim`). A restore reads the state through
    tensorstore's threads in many small buffers; once they are freed, their arenas keep the pages, which
    measured as a whole second state resident after a resume (docs/training.md, "Checkpoints and resume"). A no-op where
    the C library has no `malloc_trim`."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
