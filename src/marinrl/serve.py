"""`marinrl serve CHECKPOINT`: a saved policy behind the OpenAI-compatible endpoint and the token endpoint,
for any OpenAI client and for verifiers' own evaluation (docs/inference.md).

    marinrl serve runs/demo/checkpoints --host 0.0.0.0 --port 8000      # the key from $MARINRL_API_KEY

`main(config)` is `start`, then serving until SIGINT or SIGTERM, then `shutdown`. `start` checks what the
user gave first, cheapest first: the path exists and the address is free (before JAX is imported: about a
second), then the path is a checkpoint whose architecture is known (before any weights load); then it reads
the weights onto the rollout mesh (`eval.load_policy`, as `marinrl eval` does) and starts an
`InferenceServer` with its endpoint on `config.inference`'s address and key.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING

import fsspec

from marinrl.config.serve import ServeConfig
from marinrl.inference.generate_queue import THREAD_NAME

if TYPE_CHECKING:  # JAX and Levanter: imported by `start`, after the checks that need neither
    from marinrl.eval import Checkpoint
    from marinrl.inference.server import InferenceServer


@dataclasses.dataclass
class Served:
    """A started server and what it serves."""

    server: InferenceServer
    checkpoint: Checkpoint
    weight_step: int

    @property
    def token_url(self) -> str:
        """The token endpoint's URL (at the server's root, beside `/v1`)."""
        from marinrl.inference.token_endpoint import PATH

        return self.server.url.removesuffix("/v1") + PATH

    def shutdown(self) -> None:
        self.server.shutdown()


def start(config: ServeConfig) -> Served:
    """Check the checkpoint, load it, start serving it. FileNotFoundError or ValueError name the checkpoint
    (before any weights load); `eval.CheckpointLoadError` says why its weights do not load; OSError names an
    address the endpoint cannot listen on."""
    fs, plain = fsspec.core.url_to_fs(config.checkpoint)
    if not fs.exists(plain):
        raise FileNotFoundError(f"checkpoint not found: {config.checkpoint}")
    _check_address(config.inference.host, config.inference.port)
    from marinrl.eval import check_architecture, load_policy_or_explain, resolve_checkpoint
    from marinrl.inference.server import InferenceServer

    checkpoint = resolve_checkpoint(config.checkpoint)
    check_architecture(checkpoint, config.model)
    step = checkpoint.weight_step if config.weight_step is None else config.weight_step
    model, tokenizer = load_policy_or_explain(checkpoint, config)
    server = InferenceServer(config.inference, model, tokenizer, weight_step=step)
    try:
        server.start().wait_until_ready()
    except OSError as e:
        server.shutdown()
        raise OSError(f"cannot listen on {config.inference.host}:{config.inference.port}: {e.strerror or e}") from e
    except BaseException:
        server.shutdown()
        raise
    return Served(server, checkpoint, step)


def _check_address(host: str, port: int) -> None:
    """OSError naming `host:port` when the endpoint could not listen there (taken, or no such address),
    found before the weights load; the endpoint binds it again when it starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def describe(served: Served, config: ServeConfig) -> list[str]:
    """What `main` prints once the server listens: what it serves and where; the key only when it was made
    here (a configured key is never printed)."""
    lines = [f"marinrl serve: {served.checkpoint.path} (weight step {served.weight_step}) as "
             f"{config.inference.model_name!r}: OpenAI API {served.server.url}, tokens {served.token_url}"]
    if config.inference.api_key is None:
        lines.append(f"marinrl serve: API key (made for this start; send 'Authorization: Bearer <key>'): "
                     f"{served.server.api_key}")
    return lines


def main(config: ServeConfig) -> int:
    """Serve `config.checkpoint` until SIGINT or SIGTERM; returns 0 once the server has stopped. The requests in
    hand are answered 503 after the device call in progress; when that call (a compile, say) outlasts the
    endpoint's stop, the process ends at once, since no device call can be interrupted and Python's exit would
    abort beside it."""
    served = start(config)
    stop = threading.Event()
    handlers = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, lambda *_: stop.set())
        for line in describe(served, config):
            print(line, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        served.shutdown()
    if any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate()):
        print("marinrl serve: stopped (a device call still running ends with the process)", flush=True)
        sys.stderr.flush()
        os._exit(0)
    print("marinrl serve: stopped", flush=True)
    return 0
