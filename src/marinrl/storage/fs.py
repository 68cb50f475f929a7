"""Filesystem helpers shared by rollout files, trainer checkpoints, weight transfer and the curriculum
state: any fsspec URL (gs://, file://, memory://, a bare path), transient errors retried."""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Callable, TypeVar

import fsspec

logger = logging.getLogger(__name__)

ATOMIC_PUT_PROTOCOLS = {"gs", "gcs", "s3", "s3a", "memory", "az", "abfs", "abfss"}
"""Object stores whose single-object writes are atomic; everything else writes a temp name and renames
(weight transfer and the curriculum state follow the same rule)."""


# `simstore://` (storage/simulated.py) is known in every process that opens storage, imported on first use:
# a Ray actor given a simstore URL in its config (a weight relay) never imports the module itself.
fsspec.register_implementation("simstore", "marinrl.storage.simulated.SimulatedStore")


class RolloutStorageError(OSError):
    """A filesystem operation that kept failing after retries; the message names the path."""


T = TypeVar("T")


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(e, (OSError, ConnectionError, TimeoutError)):
        return True
    try:
        from gcsfs.retry import HttpError
    except ImportError:  # pragma: no cover - gcsfs is a dependency
        return False
    return isinstance(e, HttpError) and (getattr(e, "code", None) in (None, 408, 429) or e.code >= 500)


def with_retries(fn: Callable[[], T], what: str, path: str, attempts: int = 4, backoff_s: float = 0.05) -> T:
    """Runs `fn`, retrying transient filesystem errors with exponential backoff and jitter."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if not _is_transient(e):
                raise
            if attempt == attempts - 1:
                raise RolloutStorageError(f"{what} {path} failed after {attempts} attempts: {e!r}") from e
            delay = backoff_s * (2**attempt) * (0.5 + random.random())
            logger.warning("%s %s failed (%r); retrying in %.2fs", what, path, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def open_root(root: str, storage_options: dict | None, fs: fsspec.AbstractFileSystem | None):
    """(filesystem, path without a trailing slash) of an fsspec URL, or of `root` on a given `fs`."""
    if fs is not None:
        return fs, fs._strip_protocol(root).rstrip("/")
    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    return fs, path.rstrip("/")


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def list_names(fs, path: str) -> list[str]:
    """Base names under `path` (none if it does not exist), the listing retried on transient errors."""
    try:
        return [_basename(p) for p in with_retries(lambda: fs.ls(path, detail=False), "listing", path)]
    except FileNotFoundError:
        return []



def gcs_credentials_problem(url: str) -> str | None:
    """Why a gs:// URL cannot be used here (no Google Cloud credentials), or None. Without credentials gcsfs
    spends most of a minute on retries before a 50-line traceback; google.auth answers in about a second.
    None for other URLs and under the GCS emulator (`STORAGE_EMULATOR_HOST`), which needs none."""
    if fsspec.utils.get_protocol(url) not in ("gs", "gcs") or os.environ.get("STORAGE_EMULATOR_HOST"):
        return None
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        google.auth.default()
    except DefaultCredentialsError as e:
        reason = " ".join(str(e).split())[:160]
        return (f"{url}: no Google Cloud credentials ({reason}): run `gcloud auth application-default login`, set "
                "GOOGLE_APPLICATION_CREDENTIALS to a service account key, run on a GCE/TPU VM, or use a local path")
    return None
