"""Conditional writes of one small object, the primitive the run lock (marinrl/job/run_lock.py) stands on.

`open_store(path)` gives a store for an fsspec URL whose `create` fails if the object exists and whose
`replace` / `delete` act only on the version read (its `token`), atomic against another process:
- local disk: `create` links a written temporary file into place (`os.link`: EEXIST if the object
  exists, never seen half-written); `replace` re-reads and compares under an O_EXCL guard file, then
  `os.replace`s a written temporary file;
- gs://: GCS generation preconditions through gcsfs's JSON-API calls (`ifGenerationMatch=0` to
  create, `=<generation read>` to overwrite or delete; 412 is gcsfs's FileExistsError);
- any other fsspec filesystem (memory://): compare, then write: not atomic against another process.

`check_preconditions(url)` tries them on a scratch object: real GCS honours all three, the in-process
test emulator none (docs/storage.md, "One job per run").
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Optional

import fsspec


class Store:
    """Reads and conditionally writes one small object; `token` identifies the version read."""

    def read(self) -> Optional[tuple[bytes, object]]:
        raise NotImplementedError

    def create(self, data: bytes) -> Optional[object]:
        """Writes `data` if no lease exists: its token, or None if one does."""
        raise NotImplementedError

    def replace(self, data: bytes, token: object) -> Optional[object]:
        """Overwrites the version `token` names: the new token, or None if it changed meanwhile."""
        raise NotImplementedError

    def delete(self, token: object) -> None:
        raise NotImplementedError


class LocalStore(Store):
    def __init__(self, path: str):
        self.path = path
        self._guard = path + ".takeover"

    def read(self):
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, data

    def create(self, data):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self._write_temporary(data)
        try:  # link: an exclusive create (EEXIST if a lease exists) that no reader sees half-written
            os.link(tmp, self.path)
        except FileExistsError:
            return None
        finally:
            _remove(tmp)
        return data

    def _write_temporary(self, data: bytes) -> str:
        tmp = f"{self.path}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def replace(self, data, token):
        # The guard serializes replacements (renewal, takeover): the compare below and the rename are
        # one step for every process that follows this protocol.
        try:
            guard = os.open(self._guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if time.time() - _mtime(self._guard) > 60:  # left by a process killed between the two calls
                _remove(self._guard)
            return None
        try:
            os.close(guard)
            current = self.read()
            if current is None or current[1] != token:
                return None
            os.replace(self._write_temporary(data), self.path)
            return data
        finally:
            _remove(self._guard)

    def delete(self, token):
        current = self.read()
        if current is not None and current[1] == token:
            _remove(self.path)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:
        return time.time()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class GCSStore(Store):
    """Generation preconditions through gcsfs's JSON API calls (`pipe_file(mode="create")` exposes only
    `ifGenerationMatch=0`; a conditional overwrite and delete need the generation read)."""

    def __init__(self, fs, path: str):
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)

    def read(self):
        try:
            meta = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)
            _, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media",
                                   generation=meta["generation"])
        except FileNotFoundError:  # absent, or replaced between the two calls: the caller reads again
            return None
        return data, meta["generation"]

    def _upload(self, data: bytes, generation: str):
        body = (b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n" + json.dumps({"name": self.key}).encode()
                + b"\n--==0==\nContent-Type: application/json\n\n" + data + b"\n--==0==--")
        try:
            out = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{self.bucket}/o",
                               uploadType="multipart", ifGenerationMatch=generation, data=body, json_out=True,
                               headers={"Content-Type": 'multipart/related; boundary="==0=="'})
        except FileExistsError:  # gcsfs's name for 412 Precondition Failed
            return None
        finally:
            self.fs.invalidate_cache()
        return out["generation"]

    def create(self, data):
        return self._upload(data, "0")

    def replace(self, data, token):
        return self._upload(data, str(token))

    def delete(self, token):
        try:
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=str(token))
        except (FileNotFoundError, FileExistsError):  # gone, or another job's now
            pass
        self.fs.invalidate_cache()


class FsspecStore(Store):
    """Any other fsspec filesystem: compare, then write (not atomic against another process)."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def read(self):
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        return data, data

    def create(self, data):
        if self.fs.exists(self.path):
            return None
        self.fs.pipe_file(self.path, data)
        return data

    def replace(self, data, token):
        current = self.read()
        if current is None or current[1] != token:
            return None
        self.fs.pipe_file(self.path, data)
        return data

    def delete(self, token):
        current = self.read()
        if current is not None and current[1] == token:
            self.fs.rm_file(self.path)


def open_store(url: str, storage_options: Optional[dict] = None) -> tuple[Store, str]:
    """(the store of the object at `url`, its location as a URL to print)."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return LocalStore(path), path
    if "gs" in protocols or "gcs" in protocols:
        return GCSStore(fs, path), f"gs://{path}"
    return FsspecStore(fs, path), fs.unstrip_protocol(path)


def check_preconditions(url: str, storage_options: Optional[dict] = None) -> list[str]:
    """What a store does NOT honour of the conditional writes the lock relies on (empty: all), tried
    on a scratch object under `url`. Real GCS honours all; the test emulator none."""
    store, _ = open_store(f"{url.rstrip('/')}/precondition-check-{uuid.uuid4().hex[:8]}", storage_options)
    ignored = []
    store.create(b'{"n": 1}')
    if store.create(b'{"n": 2}') is not None:
        ignored.append("create over an existing object")
    if store.replace(b'{"n": 3}', _stale_token(store, store.read()[1])) is not None:
        ignored.append("overwrite of a changed version")
    store.delete(_stale_token(store, store.read()[1]))
    if store.read() is None:
        ignored.append("delete of a changed version")
    final = store.read()
    if final is not None:
        store.delete(final[1])
    return ignored


def _stale_token(store: Store, token: object) -> object:
    """A token that does not name the current version."""
    return str(int(token) + 1) if isinstance(store, GCSStore) else b"not the current content"
