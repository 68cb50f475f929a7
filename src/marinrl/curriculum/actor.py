"""The curriculum as a restartable Ray named actor (`CurriculumActor`, created with `curriculum_actor`),
its JSON state on any fsspec path, and `CurriculumClient`, the synchronous handle the rollout manager,
the rollout worker and the trainer use (docs/curriculum.md, "The actor")."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from typing import Any, Optional, Sequence

import fsspec
import numpy as np

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.curriculum.lessons import Curriculum, sample_from_weights
from marinrl.storage.fs import ATOMIC_PUT_PROTOCOLS

logger = logging.getLogger(__name__)


def save_state(state: dict[str, Any], path: str, storage_options: Optional[dict] = None) -> None:
    """Write `state` as JSON at `path` (any fsspec URL) atomically: object stores put one object,
    local disks write a temporary file and rename it, so a reader sees the old file or the new one."""
    data = json.dumps(state, allow_nan=False, sort_keys=True).encode()
    fs, plain = fsspec.core.url_to_fs(path, **(storage_options or {}))
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    parent = plain.rsplit("/", 1)[0] if "/" in plain else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if protocols & ATOMIC_PUT_PROTOCOLS:
        fs.pipe_file(plain, data)
        return
    tmp = f"{plain}.tmp-{uuid.uuid4().hex}"
    fs.pipe_file(tmp, data)
    if "file" in protocols or "local" in protocols:
        os.replace(tmp, plain)
    else:
        fs.mv(tmp, plain)


def load_state(path: str, storage_options: Optional[dict] = None) -> Optional[dict[str, Any]]:
    """The JSON state at `path`, or None if there is none. A file that is not JSON is a ValueError."""
    fs, plain = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if not fs.exists(plain):
        return None
    raw = fs.cat_file(plain)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"curriculum state {path} is not JSON: {e}") from e


# ---------------------------------------------------------------------------------- Ray actor


class CurriculumActor:
    """A `Curriculum` in a Ray named actor (create it with `curriculum_actor`).

    On (re)start it loads `state_path` if the file exists, so an actor Ray restarts after a crash
    resumes from the last saved state. It saves to `state_path` on `save()` and, if `save_every` > 0,
    whenever the clock has moved `save_every` steps from the last save (backwards too: a resumed
    trainer's clock) and right after a `load` (a trainer's checkpoint restored: its lineage now)."""

    def __init__(self, config: CurriculumConfig, state_path: Optional[str] = None, save_every: int = 0,
                 storage_options: Optional[dict] = None):
        self._curriculum = Curriculum(config)
        self._state_path = state_path
        self._save_every = save_every
        self._storage_options = storage_options
        self._saved_step = 0
        self._incarnation = uuid.uuid4().hex
        if state_path:
            state = load_state(state_path, storage_options)
            if state is not None:
                self._curriculum.load_state_dict(state)
                self._saved_step = self._curriculum.step
                logger.info("curriculum actor resumed from %s at step %d", state_path, self._curriculum.step)

    def config_fingerprint(self) -> str:
        return self._curriculum.config.fingerprint()

    def incarnation(self) -> str:
        """A new id every time the actor (re)starts: tells a caller that Ray restarted it."""
        return self._incarnation

    def lesson_ids(self) -> list[str]:
        return self._curriculum.lesson_ids

    def lesson(self, lesson_id: str) -> LessonConfig:
        return self._curriculum.lesson(lesson_id)

    def status(self, lesson_id: str) -> str:
        return self._curriculum.status(lesson_id)

    def sample_lesson(self, seed: int) -> str:
        return self._curriculum.sample_lesson(np.random.default_rng(seed))

    def weights(self) -> dict[str, float]:
        return self._curriculum.weights()

    def metrics(self) -> dict[str, float]:
        return self._curriculum.metrics()

    def step(self) -> int:
        return self._curriculum.step

    def update_from_training(self, lesson_id: str, rewards: list[float], step: int) -> None:
        self._curriculum.update_from_training(lesson_id, rewards, step)
        self._maybe_save()

    def update_from_eval(self, lesson_id: str, rewards: list[float], step: int) -> None:
        self._curriculum.update_from_eval(lesson_id, rewards, step)
        self._maybe_save()

    def set_step(self, step: int) -> None:
        self._curriculum.set_step(step)
        self._maybe_save()

    def state_dict(self) -> dict[str, Any]:
        return self._curriculum.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._curriculum.load_state_dict(state)
        self._save_if_automatic()

    def save(self, path: Optional[str] = None) -> str:
        """Write the state to `path` (default: `state_path`); returns where it went."""
        target = path or self._state_path
        if not target:
            raise ValueError("CurriculumActor.save: no path given and the actor has no state_path")
        save_state(self._curriculum.state_dict(), target, self._storage_options)
        if target == self._state_path:
            self._saved_step = self._curriculum.step
        return target

    def load(self, path: str) -> None:
        """Restore the state saved at `path` (FileNotFoundError if there is none)."""
        state = load_state(path, self._storage_options)
        if state is None:
            raise FileNotFoundError(f"no curriculum state at {path}")
        self._curriculum.load_state_dict(state)
        self._save_if_automatic()

    def _maybe_save(self) -> None:
        if (self._state_path and self._save_every > 0
                and abs(self._curriculum.step - self._saved_step) >= self._save_every):
            self.save()

    def _save_if_automatic(self) -> None:
        if self._state_path and self._save_every > 0:
            self.save()


def curriculum_actor(
    config: CurriculumConfig,
    *,
    name: str = "curriculum",
    namespace: str = "marinrl",
    state_path: Optional[str] = None,
    save_every: int = 0,
    storage_options: Optional[dict] = None,
    max_restarts: int = 10,
    detached: bool = False,
):
    """Get the curriculum actor `name` in `namespace`, creating it if it does not exist (Ray must be
    initialized). Ray restarts it up to `max_restarts` times after a crash, and retries calls that
    were in flight. An existing actor running another configuration is a ValueError."""
    import ray

    actor_cls = ray.remote(CurriculumActor)
    handle = actor_cls.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        max_restarts=max_restarts,
        max_task_retries=3,
        lifetime="detached" if detached else None,
        num_cpus=0,
    ).remote(config, state_path, save_every, storage_options)
    theirs = ray.get(handle.config_fingerprint.remote())
    if theirs != config.fingerprint():
        raise ValueError(f"curriculum actor {namespace}/{name} already exists with another configuration "
                         f"(fingerprint {theirs}, this one {config.fingerprint()}); kill it or choose another name")
    return handle


MAX_PENDING_UPDATES = 16
"""Statistics updates a client lets be in flight before it waits for the oldest (a bound on its memory)."""


class CurriculumClient:
    """Calls on a curriculum actor: what the RolloutManager (`update_from_training`, `update_from_eval`),
    the RolloutWorker (`sample_lesson(seed)`) and the TrainWorker (`set_step`, `save`, `load`) need.

    No call of a rollout host's batch waits for the actor, so a fleet's hosts never queue behind one
    another at it (docs/scaling.md, "A fleet of rollout hosts"): the statistics updates are sent without
    waiting (at most `MAX_PENDING_UPDATES` in flight), and `sample_lesson` draws from a copy of the
    sampling weights (`Curriculum.weights()`, the draw `lessons.sample_from_weights`), refreshed by a
    call sent at each draw and taken at the next one, so the copy is at most one batch old and holds
    this client's own earlier updates. Ray runs one process's calls on the actor in the order they were
    sent, so a later call of this process sees them applied; an update that failed raises from the next
    call (or `flush()`). Every other call waits for its answer."""

    def __init__(self, handle):
        self.handle = handle
        self._pending: list = []
        self._lock = threading.Lock()
        self._weights: dict[str, float] | None = None
        self._weights_ref = None
        self.weight_refreshes = 0
        self.waited_calls = 0
        """Calls that waited for the actor's answer (a rollout host's first lesson, the trainer's calls)."""

    def _reap(self, keep: int | None = None) -> None:
        """Collects finished updates (raising the first failure); with `keep`, first waits until at most
        `keep` are in flight."""
        import ray

        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        need = 0 if keep is None else max(0, len(pending) - keep)
        done, rest = ray.wait(pending, num_returns=need or len(pending), timeout=None if need else 0)
        with self._lock:
            self._pending = rest + self._pending
        ray.get(done)

    def _send(self, method: str, *args) -> None:
        self._reap()
        ref = getattr(self.handle, method).remote(*args)
        with self._lock:
            self._pending.append(ref)
            over = len(self._pending) > MAX_PENDING_UPDATES
        if over:
            self._reap(keep=MAX_PENDING_UPDATES)

    def flush(self) -> None:
        """Waits for every update this client sent; raises the first that failed."""
        self._reap(keep=0)

    @property
    def pending(self) -> int:
        """Updates sent and not yet known to be applied."""
        return len(self._pending)

    def _call(self, method: str, *args):
        import ray

        self.waited_calls += 1
        out = ray.get(getattr(self.handle, method).remote(*args))
        self._reap()  # the actor ran this process's earlier updates first: their failures are known now
        return out

    def sample_lesson(self, seed: int) -> str:
        """A lesson drawn with the weights as of this client's previous draw (the first draw waits for them)."""
        import ray

        ref = self._weights_ref
        if ref is not None and ray.wait([ref], timeout=0)[0]:
            self._weights, self._weights_ref = ray.get(ref), None
            self.weight_refreshes += 1
        if self._weights is None:
            self._weights = self._call("weights")
        if self._weights_ref is None:
            self._weights_ref = self.handle.weights.remote()
        return sample_from_weights(self._weights, np.random.default_rng(seed))

    def update_from_training(self, lesson_id: str, rewards: Sequence[float], step: int) -> None:
        self._send("update_from_training", lesson_id, [float(r) for r in rewards], int(step))

    def update_from_eval(self, lesson_id: str, rewards: Sequence[float], step: int) -> None:
        self._send("update_from_eval", lesson_id, [float(r) for r in rewards], int(step))

    def set_step(self, step: int) -> None:
        self._call("set_step", int(step))

    def save(self, path: Optional[str] = None) -> str:
        return self._call("save", path)

    def load(self, path: str) -> None:
        self._call("load", path)

    def weights(self) -> dict[str, float]:
        return self._call("weights")

    def metrics(self) -> dict[str, float]:
        return self._call("metrics")

    def status(self, lesson_id: str) -> str:
        return self._call("status", lesson_id)

    def lesson(self, lesson_id: str) -> LessonConfig:
        return self._call("lesson", lesson_id)

    def lesson_ids(self) -> list[str]:
        return self._call("lesson_ids")

    def step(self) -> int:
        return self._call("step")

    def incarnation(self) -> str:
        return self._call("incarnation")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)
