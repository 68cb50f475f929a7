"""The endpoint's one generate thread: requests queued by the HTTP routes are batched, whatever is waiting, into
one call of the generate function (`InferenceServer.generate_requests`), and each route gets its own samples back.

A request the backend refuses (ValueError) must not fail the others queued beside it: the batch is then served one
request at a time, so that only the refused one gets the error.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
from typing import Callable, Optional, Sequence

from marinrl.inference.context import Generation, SamplingParams


@dataclasses.dataclass(frozen=True)
class TokenRequest:
    """One prompt of one HTTP request, as the endpoint hands it to its generate function."""

    prompt: Sequence[int]
    n: int
    sampling: SamplingParams
    seed: int
    index: int = 0
    """The prompt's position in its HTTP request: sample j depends on (seed, index, j) only."""


GenerateFn = Callable[[Sequence[TokenRequest]], list[list[Generation]]]
"""Samples of each request, in order; raises ValueError (naming the problem) for a request it cannot serve."""


class GenerateQueue:
    """A worker thread that serves queued `submit`s in batches through `generate`."""

    def __init__(self, generate: GenerateFn):
        self.generate = generate
        self._jobs: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="marinrl-openai-generate", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Finish the batch in hand, then end the thread. Idempotent."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("OpenAI endpoint's generate thread did not stop")
        self._thread = None

    def submit(self, requests: list[TokenRequest]) -> concurrent.futures.Future:
        """A future of `requests`' samples, in order (or of the error that generating them raised)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((requests, fut))
        return fut

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            batch = [item]
            with contextlib.suppress(queue.Empty):
                while True:
                    nxt = self._jobs.get_nowait()
                    if nxt is None:
                        self._jobs.put(None)  # finish this batch, then stop
                        break
                    batch.append(nxt)
            self._serve_batch(batch)

    def _serve_batch(self, batch: list[tuple[list[TokenRequest], concurrent.futures.Future]]) -> None:
        try:
            results = self.generate([r for rs, _ in batch for r in rs])
        except ValueError:
            # a request the backend refuses: serve the others alone, so that only it gets the 400
            for rs, fut in batch:
                self._serve_alone(rs, fut)
            return
        except BaseException as e:  # noqa: BLE001 - delivered to every waiting request
            for _, fut in batch:
                fut.set_exception(e)
            return
        start = 0
        for rs, fut in batch:
            fut.set_result(results[start:start + len(rs)])
            start += len(rs)

    def _serve_alone(self, requests: list[TokenRequest], fut: concurrent.futures.Future) -> None:
        try:
            fut.set_result(self.generate(requests))
        except BaseException as e:  # noqa: BLE001 - delivered to the waiting request
            fut.set_exception(e)
