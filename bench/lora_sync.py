"""LoRA weight sync: adapter-only versions merged on the rollout side, against merging on the trainer and
sending the full merged weights (docs/policies.md).

Per model and rank, file:// packed transfer, `--reps` versions after one warm-up (every version's
adapters differ everywhere), medians in milliseconds:

- `adapter`: the trainer publishes `adapter_only(policy)`; the rollout side's `AdapterMergingClient`
  receives it and merges it into the base it holds (`receive` includes the merge, also shown alone).
- `full`: the trainer merges (`merge_adapters`) and publishes the whole merged model; the rollout side
  receives it into a plain client (`publish` includes the merge).

The scan sampler reads each Linear's weight directly, so serving the adapters unmerged (x·W + s·x·A·B
per layer) would need a sampler change; it is not measured.

    python bench/lora_sync.py [--models quickstart,large] [--ranks 8,64] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from levanter.lora import is_lora_param  # noqa: E402
from transfer import MODELS, build_model, machine, stats  # noqa: E402

from marinrl.config.lora import LoraRLConfig  # noqa: E402
from marinrl.config.transfer import FilesystemTransferConfig  # noqa: E402
from marinrl.models.lora import AdapterMergingClient, adapter_only, add_adapters, merge_adapters  # noqa: E402
from marinrl.transfer.endpoints import build_client, build_server  # noqa: E402


def shifted_adapters(policy, k: float):
    """The policy with every adapter array + k (the base untouched)."""
    def shift(node):
        if not is_lora_param(node):
            return node
        arrays, static = eqx.partition(node, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda x: x + jnp.asarray(k, x.dtype), arrays), static)

    return jax.tree.map(shift, policy, is_leaf=is_lora_param)


def run(kind: str, base, lora: LoraRLConfig, root: str, reps: int) -> dict:
    weights = FilesystemTransferConfig(root=root)
    policy = add_adapters(base, lora)
    server = build_server(weights)
    client = AdapterMergingClient(weights, lora, base) if kind == "adapter" else build_client(weights, base)
    publish_s, receive_s, merge_s = [], [], []
    for step in range(reps + 1):
        version = jax.block_until_ready(shifted_adapters(policy, 1e-3 * (step + 1)))
        start = time.perf_counter()
        if kind == "adapter":
            published = server.publish(adapter_only(version), step)
        else:
            published = server.publish(jax.block_until_ready(merge_adapters(version)), step)
        pub = time.perf_counter() - start
        start = time.perf_counter()
        update = client.poll()
        rec = time.perf_counter() - start
        assert update is not None and update.weight_step == step, client.metrics
        if step > 0:
            publish_s.append(pub * 1e3)
            receive_s.append(rec * 1e3)
            if kind == "adapter":
                merge_s.append(client.last_merge_s * 1e3)
    out = {"kind": kind, "bytes": published.bytes, "publish_ms": stats(publish_s), "receive_ms": stats(receive_s)}
    if merge_s:
        out["merge_ms"] = stats(merge_s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="quickstart,large")
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    results = []
    for name in args.models.split(","):
        base = build_model(name)
        n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(base, eqx.is_inexact_array)))
        for rank in map(int, args.ranks.split(",")):
            lora = LoraRLConfig(rank=rank, alpha=2.0 * rank)
            for kind in ("adapter", "full"):
                with tempfile.TemporaryDirectory() as tmp:
                    row = {"model": name, "params": n_params, "rank": rank, **run(kind, base, lora, tmp, args.reps)}
                results.append(row)
                merge = f" merge {row['merge_ms']['median']:.1f}" if "merge_ms" in row else ""
                print(f"{name:10s} r={rank:<3d} {kind:7s} {row['bytes'] / 1e6:8.3f} MB  publish "
                      f"{row['publish_ms']['median']:8.1f} ms  receive {row['receive_ms']['median']:8.1f} ms{merge}",
                      flush=True)
    print(json.dumps({"bench": "lora_sync", "machine": machine(), "models": {k: MODELS[k] for k in
                                                                             args.models.split(",")},
                      "results": results}))


if __name__ == "__main__":
    main()
