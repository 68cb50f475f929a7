"""The verifiers side of the `verifiers` environment (envs/verifiers_env.py): a script run by the Python
interpreter of a virtualenv that has verifiers 0.4 installed (never imported by marinrl, which cannot install
verifiers beside its own pins: docs/environments.md, "verifiers"). It imports only the standard library and
verifiers.

    python verifiers_bridge.py check  CONFIG_JSON   # one JSON line: verifiers' version, the task counts
    python verifiers_bridge.py serve  CONFIG_JSON   # an EnvServer on a free port; prints `address <tcp://...>`
    python verifiers_bridge.py client CONFIG_JSON   # JSON lines on stdin/stdout (below)

CONFIG_JSON: {"env": <verifiers EnvConfig data>, "eval_env": <the same for the eval split>, "max_tasks": n,
"address": <an EnvServer's address, for `client`>, "base_url": ..., "api_key_var": ..., "renderer_model": ...}.

`client` answers requests, one JSON object a line, each with an `id` echoed in its answer (answers come in the
order runs finish): `{"op": "hello"}` -> the protocol and verifiers' version and the task counts;
`{"op": "run", "split": "train"|"eval", "index": i, "model": m, "sampling": {...}, "timeout": s}` -> the episode
run on the EnvServer by verifiers' own `EnvClient` (task i of the split's taskset, a `TrainClientConfig` pointing
at marinrl's token endpoint), as token sequences: per trace its branches' prompt and completion tokens, the
sampled mask and logprobs, the reward, the per-function scores and metrics; `{"op": "health", "timeout": s}` -> whether
the EnvServer answers within s seconds (polled). Errors are answers (`{"id": .., "error": "..."}`), never a crash.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

PROTOCOL = 1
"""The version of this line protocol; envs/verifiers_env.py refuses a bridge that says another."""


def _env_config(data: dict):
    from verifiers.v1.utils.loaders import resolve_env_config

    return resolve_env_config(data)


def _tasks(env_data: dict, max_tasks: int) -> list[dict]:
    """The wire data of the first `max_tasks` tasks of the env's taskset (its `load()` order)."""
    from verifiers.v1.utils.loaders import load_taskset

    config = _env_config(env_data)
    taskset = load_taskset(config.taskset).take(max_tasks)
    return [task.data.model_dump(mode="json") for task in taskset]


def _version() -> str:
    from importlib.metadata import version

    return version("verifiers")


def check(config: dict) -> dict:
    from verifiers.v1.utils.loaders import load_environment

    load_environment(_env_config(config["env"]))  # the env, its taskset and harness classes resolve
    counts = {"train": len(_tasks(config["env"], config["max_tasks"])),
              "eval": len(_tasks(config["eval_env"], config["max_tasks"]))}
    answer = {"protocol": PROTOCOL, "verifiers": _version(), "tasks": counts}
    if config.get("address"):  # a running EnvServer: does it answer verifiers' health request?
        answer["healthy"] = asyncio.run(_healthy(config["address"], float(config.get("health_timeout", 10.0))))
    return answer


async def _healthy(address: str, timeout: float, client=None) -> bool:
    """Whether the EnvServer at `address` answers a health request within `timeout` seconds (polled)."""
    from verifiers.v1.serve import EnvClient

    own = client is None
    client = client or EnvClient(address)
    try:
        await client.wait_for_server_startup(timeout=timeout, interval=0.5)
        return True
    except TimeoutError:
        return False
    finally:
        if own:
            await client.close()


def serve(config: dict) -> None:
    import os
    import signal

    from verifiers.v1.serve import serve_env

    def watch_parent() -> None:  # stdin is a pipe from marinrl: its end (marinrl gone, even SIGKILLed) ends us
        sys.stdin.buffer.read()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_parent, daemon=True).start()

    class _Announce:  # EnvServer reports its bound address through `put`
        def put(self, address: str) -> None:
            print(f"address {address}", flush=True)

    serve_env(max_workers=1, address=config.get("bind", "tcp://127.0.0.1:0"), address_queue=_Announce(),
              config=_env_config(config["env"]))


# ------------------------------------------------------------------------------------------ the client


def _trace_samples(trace) -> list[dict]:
    """A trace's trainable branches as token sequences: the prompt is everything before the first sampled
    token; the completion the rest, with the sampled mask (False on tool and user tokens between turns)."""
    out = []
    finish = next((c.finish_reason for c in reversed(trace.calls) if c.finish_reason), None)
    for branch in trace.branches:
        if not branch.trainable:
            continue
        tokens, mask, logprobs = branch.token_ids, branch.sampled_mask, branch.logprobs
        start = next((i for i, m in enumerate(mask) if m), None)
        if start is None:
            continue
        end = max(i for i, m in enumerate(mask) if m) + 1  # nothing after the last sampled token is trained
        out.append({"prompt": tokens[:start], "completion": tokens[start:end], "mask": mask[start:end],
                    "logprobs": logprobs[start:end], "finish_reason": finish})
    return out


def _episode_answer(episode) -> dict:
    traces = []
    for trace in episode.traces:
        traces.append({
            "agent": getattr(trace.agent, "name", None) or "agent",
            "ok": bool(trace.ok),
            "is_timeout": bool(trace.is_timeout),
            "errors": [f"{e.type}: {e.message}" for e in trace.errors][-3:],
            "reward": float(trace.reward),
            "rewards": {k: (None if r is None else float(r.score)) for k, r in trace.rewards.items()},
            "metrics": {k: (None if v is None else float(v)) for k, v in trace.metrics.items()},
            "stop_condition": trace.stop_condition,
            "samples": _trace_samples(trace),
        })
    errors = [f"{e.type}: {e.message}" for e in episode.errors][-3:]
    return {"traces": traces, "errors": errors}


class _Client:
    def __init__(self, config: dict):
        from verifiers.v1.configs.client import TrainClientConfig
        from verifiers.v1.serve import EnvClient

        self.config = config
        self.tasks = {"train": _tasks(config["env"], config["max_tasks"]),
                      "eval": _tasks(config["eval_env"], config["max_tasks"])}
        self.env_client = EnvClient(config["address"])
        self.client_config = TrainClientConfig(base_url=config["base_url"], api_key_var=config["api_key_var"],
                                               renderer_model_name=config.get("renderer_model"),
                                               renderer=config.get("renderer"))
        self.write_lock = threading.Lock()

    def answer(self, message: dict) -> None:
        line = json.dumps(message)
        with self.write_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    async def handle(self, request: dict) -> None:
        from verifiers.v1.types import SamplingConfig

        rid = request.get("id")
        try:
            op = request.get("op")
            if op == "hello":
                result = {"protocol": PROTOCOL, "verifiers": _version(),
                          "tasks": {k: len(v) for k, v in self.tasks.items()}}
            elif op == "health":
                result = {"healthy": await _healthy(self.config["address"], float(request.get("timeout", 10.0)),
                                                    self.env_client)}
            elif op == "run":
                task_data = self.tasks[request["split"]][int(request["index"])]
                run = self.env_client.run(client=self.client_config, model=request["model"],
                                          sampling=SamplingConfig(**request["sampling"]), task_data=task_data)
                episode = await asyncio.wait_for(run, timeout=float(request["timeout"]))
                result = _episode_answer(episode)
            else:
                raise ValueError(f"unknown op {op!r}")
            self.answer({"id": rid, **result})
        except TimeoutError:
            self.answer({"id": rid, "error": "timeout", "timeout": True})
        except Exception as e:  # an answer, never a crash: the caller counts it
            self.answer({"id": rid, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}"})

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 26)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks: set[asyncio.Task] = set()
        self.answer({"id": None, "ready": True, "protocol": PROTOCOL, "verifiers": _version()})
        while line := await reader.readline():
            try:
                request = json.loads(line)
            except json.JSONDecodeError as e:
                self.answer({"id": None, "error": f"not JSON: {e}"})
                continue
            task = asyncio.create_task(self.handle(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in tasks:
            task.cancel()
        await self.env_client.close()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("check", "serve", "client"):
        print("usage: verifiers_bridge.py check|serve|client CONFIG_JSON", file=sys.stderr)
        return 2
    config = json.loads(argv[2])
    if argv[1] == "check":
        try:
            print(json.dumps(check(config)), flush=True)
        except Exception as e:
            print(json.dumps({"error": f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}"}), flush=True)
            return 1
        return 0
    if argv[1] == "serve":
        serve(config)
        return 0
    client = _Client(config)
    asyncio.run(client.main())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
