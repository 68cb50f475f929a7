"""Load on the OpenAI endpoint: concurrent clients sending a mix of short, medium and long completions to one
`InferenceServer` (a random Llama, the scan sampler), through real HTTP. Reports, per size and overall, p50/p99
latency, tokens/s and whether anything was lost (a request not answered 200 with its tokens), and whether a
short request ever waited for a long one's whole generation (`starved`: a short request that took longer than
the fastest long one).

    python bench/endpoint_load.py                      # 8 clients, 96 requests, 32-step decode chunks
    python bench/endpoint_load.py --chunk 0            # the same without chunks: one device call a request batch

Prints a line per size for a person, then one JSON line with the machine (docs/inference.md, "Load").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time

import httpx
import numpy as np
from machine import machine  # bench/machine.py

SIZES = {"short": (8, 0.7), "medium": (64, 0.25), "long": (400, 0.05)}
"""max_tokens of each size and its share of the requests."""


def _server(chunk: int):
    from levanter.models.llama import LlamaConfig

    from marinrl.config.model import ModelConfig
    from marinrl.config.server import InferenceServerConfig
    from marinrl.inference import server as server_module
    from marinrl.inference.server import InferenceServer
    from marinrl.models.policy_model import build_model
    from marinrl.models.tokenizers import byte_tokenizer

    server_module.HTTP_CHUNK_TOKENS = chunk or None  # None: each batch's generation in one device call
    arch = LlamaConfig(seq_len=512, hidden_dim=128, intermediate_dim=256, num_layers=2, num_heads=4, num_kv_heads=2,
                       gradient_checkpointing=False)
    model = build_model(ModelConfig(model=arch, vocab_size=512, seed=0))
    return InferenceServer(InferenceServerConfig(serve_http=True), model, byte_tokenizer(512)).start()


def _ask(http: httpx.Client, url: str, key: str, size: str, seed: int) -> dict:
    max_tokens = SIZES[size][0]
    body = {"model": "marinrl-policy", "prompt": [256, 97 + seed % 26, 98], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed}
    start = time.perf_counter()
    try:
        r = http.post(f"{url}/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        tokens = len(r.json()["choices"][0]["token_ids"]) if r.status_code == 200 else -1
    except httpx.HTTPError:
        tokens = -1
    return {"size": size, "seconds": time.perf_counter() - start, "tokens": tokens, "end": time.perf_counter()}


def run(clients: int, requests: int, chunk: int, seed: int) -> dict:
    srv = _server(chunk)
    srv.wait_until_ready()
    rng = np.random.default_rng(seed)
    names = list(SIZES)
    sizes = rng.choice(names, size=requests, p=[SIZES[s][1] for s in names]).tolist()
    sizes[: len(names)] = names  # every size at least once
    rng.shuffle(sizes)
    try:
        with httpx.Client(timeout=900) as http:
            for size in names:  # compile every shape before the clock starts
                _ask(http, srv.url, srv.api_key, size, 10_000)
        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            https = [httpx.Client(timeout=900) for _ in range(clients)]
            futures = [pool.submit(_ask, https[i % clients], srv.url, srv.api_key, size, i)
                       for i, size in enumerate(sizes)]
            done = [f.result() for f in futures]
            for h in https:
                h.close()
        wall = time.perf_counter() - began
    finally:
        srv.shutdown()
    ok = [d for d in done if d["tokens"] >= 1]
    out = {"clients": clients, "requests": requests, "chunk_tokens": chunk, "seconds": round(wall, 2),
           "lost": requests - len(ok), "tokens_per_s": round(sum(d["tokens"] for d in ok) / wall, 1)}
    for size in names:
        secs = np.array([d["seconds"] for d in ok if d["size"] == size])
        out[size] = {"n": int(len(secs)), "p50_s": round(float(np.percentile(secs, 50)), 3),
                     "p99_s": round(float(np.percentile(secs, 99)), 3)} if len(secs) else {"n": 0}
    fastest_long = min((d["seconds"] for d in ok if d["size"] == "long"), default=float("inf"))
    out["starved"] = sum(1 for d in ok if d["size"] == "short" and d["seconds"] > fastest_long)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--chunk", type=int, default=32, help="decode steps per device call (0: no chunks)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < len(SIZES) or args.chunk < 0:
        p.error(f"--clients >= 1, --requests >= {len(SIZES)}, --chunk >= 0")
    result = run(args.clients, args.requests, args.chunk, args.seed)
    for size in SIZES:
        r = result[size]
        if r["n"]:
            print(f"{size:>6} ({SIZES[size][0]:>3} tokens): {r['n']:>3} requests, p50 {r['p50_s']:.3f} s, "
                  f"p99 {r['p99_s']:.3f} s")
    print(f"{result['tokens_per_s']:.0f} tokens/s over {result['seconds']} s, {result['lost']} lost, "
          f"{result['starved']} short requests slower than the fastest long one")
    result["machine"] = machine()
    print(json.dumps(result))
    return 0 if result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
