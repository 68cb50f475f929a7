"""The endpoint's one generate thread: the requests the HTTP routes queue are served in rounds, so that a long
generation never starves the requests that arrive behind it.

The generate function returns a generator (`InferenceServer.generate_request_steps`): it yields between
device calls, and the scan sampler's calls are at most `server.HTTP_CHUNK_TOKENS` decode steps. Each round,
everything queued since the last round becomes one more batch (one generator, its requests batched into
shared device calls), then every batch in hand advances by one device call, oldest first. A batch of short
requests that arrives while a long one decodes is therefore served within a few of the long one's chunks,
and the long one goes on after it; no request waits for another's whole generation.

A request the backend refuses (ValueError) must not fail the others queued beside it: the batch is then
split, one batch per request, so that only the refused one gets the error.

`stop` ends the thread within one device call: the requests still in hand get `EndpointStopping`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
from typing import Callable, Generator, Optional, Sequence

from marinrl.inference.context import Generation, SamplingParams

THREAD_NAME = "marinrl-openai-generate"
"""The generate thread's name (`marinrl serve` looks for it after a stop)."""


@dataclasses.dataclass(frozen=True)
class TokenRequest:
    """One prompt of one HTTP request, as the endpoint hands it to its generate function."""

    prompt: Sequence[int]
    n: int
    sampling: SamplingParams
    seed: int
    index: int = 0
    """The prompt's position in its HTTP request: sample j depends on (seed, index, j) only."""
    adapter: Optional[int] = None
    """The adapter slot that samples it on a server holding several adapters on one base
    (`rollout/shared_base.py`); None: the server's default (its first policy's slot), ignored elsewhere."""


Steps = Generator[None, None, list[list[Generation]]]
GenerateFn = Callable[[Sequence[TokenRequest]], Steps]
"""A generator that yields between device calls and returns the samples of each request, in order; raises
ValueError (naming the problem) for a request it cannot serve."""


class EndpointStopping(RuntimeError):
    """The endpoint stopped before the request was served."""


@dataclasses.dataclass
class _Batch:
    """Submissions served together: their requests in one generator."""

    jobs: list[tuple[list[TokenRequest], concurrent.futures.Future]]
    steps: Optional[Steps] = None
    rounds: int = 0


class GenerateQueue:
    """A worker thread that serves queued `submit`s in rounds through `generate` (module doc)."""

    def __init__(self, generate: GenerateFn):
        self.generate = generate
        self._jobs: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._active: list[_Batch] = []
        self.rounds = 0
        """Rounds served so far (each advanced every batch in hand by one device call)."""

    @property
    def in_hand(self) -> int:
        """Requests being generated now (started, not yet answered)."""
        return sum(len(rs) for b in list(self._active) for rs, _ in b.jobs)

    @property
    def running(self) -> bool:
        """Whether the thread serves submissions."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """End the thread after the device call in hand; requests not yet answered get `EndpointStopping`.
        False when that call outlasted `timeout` (the thread, a daemon, then ends with the process). Idempotent."""
        if self._thread is None:
            return True
        self._stopping.set()
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():  # its generators are its own: only their futures are failed from here
            self._fail_futures(EndpointStopping("the endpoint stopped before this request was served"))
            return False
        self._thread = None
        return True

    def submit(self, requests: list[TokenRequest]) -> concurrent.futures.Future:
        """A future of `requests`' samples, in order (or of the error that generating them raised)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping.is_set():
            fut.set_exception(EndpointStopping("the endpoint is stopping"))
        else:
            self._jobs.put((requests, fut))
            if self._stopping.is_set() and (self._thread is None or not self._thread.is_alive()):
                self._fail_futures(EndpointStopping("the endpoint is stopping"))  # queued after the thread ended
        return fut

    def _work(self) -> None:
        try:
            while not self._stopping.is_set():
                self._take_queued(block=not self._active)
                if self._stopping.is_set():
                    break
                for batch in list(self._active):
                    self._advance(batch)
                    if self._stopping.is_set():
                        break
                self.rounds += 1
        finally:
            self._fail_all(EndpointStopping("the endpoint stopped before this request was served"))

    def _take_queued(self, block: bool) -> None:
        """Everything queued now as one new batch (waits for a first submission when `block`)."""
        jobs = []
        try:
            item = self._jobs.get(block=block)
            while item is not None:
                jobs.append(item)
                item = self._jobs.get_nowait()
        except queue.Empty:
            pass
        if jobs:
            self._active.append(_Batch(jobs))

    def _advance(self, batch: _Batch) -> None:
        """One device call of `batch`; its futures get their results when its generator returns."""
        try:
            if batch.steps is None:
                batch.steps = self.generate([r for rs, _ in batch.jobs for r in rs])
            next(batch.steps)
            batch.rounds += 1
            return
        except StopIteration as done:
            self._active.remove(batch)
            start = 0
            for rs, fut in batch.jobs:
                _answer(fut, result=done.value[start:start + len(rs)])
                start += len(rs)
        except ValueError as e:
            self._active.remove(batch)
            if len(batch.jobs) == 1 or batch.rounds > 0:
                for _, fut in batch.jobs:
                    _answer(fut, error=e)
            else:  # a request the backend refuses: the others alone, so that only it gets the 400
                self._active.extend(_Batch([job]) for job in batch.jobs)
        except BaseException as e:  # noqa: BLE001 - delivered to every waiting request
            self._active.remove(batch)
            for _, fut in batch.jobs:
                _answer(fut, error=e)

    def _fail_all(self, error: BaseException) -> None:
        """The worker's last act: its generators closed, every request not yet answered given `error`."""
        for batch in self._active:
            if batch.steps is not None:
                batch.steps.close()
        self._fail_futures(error)
        self._active.clear()

    def _fail_futures(self, error: BaseException) -> None:
        """`error` to every request in hand or queued that has no answer yet (from any thread)."""
        futures = [fut for batch in list(self._active) for _, fut in batch.jobs]
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                futures.append(item[1])
        for fut in futures:
            _answer(fut, error=error)


def _answer(fut: concurrent.futures.Future, *, result=None, error: Optional[BaseException] = None) -> None:
    """Sets `fut` unless it was answered meanwhile (`stop` fails the requests in hand from another thread)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
