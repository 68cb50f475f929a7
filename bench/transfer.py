"""Weight transfer: seconds to publish a version and to receive it, per mode, side by side; and full
versus delta sync (docs/weight_transfer.md, docs/performance.md).

Part 1 (`--part modes`): the filesystem mode with the packed format on memory:// and file://, with the
tensorstore format (a Levanter checkpoint) on file://, and the Ray object-store mode on a local Ray;
every version differs everywhere (all weights + k).

Part 2 (`--part delta`): full versus delta sync of a run's consecutive versions. A fp32 master copy
of the model takes AdamW steps (optax.adamw, weight decay 0.01, a standard-normal gradient per step:
at AdamW's first steps every element moves by about the learning rate, whatever the gradient's
scale), and each version published is the master cast to the dtype measured, as a trainer with fp32
master weights publishes bf16 weights for inference. Per (model, dtype, learning rate) it runs two
servers side by side on the same versions, delta off and on (full_every above the number of
versions: every measured delta is a delta), first for file:// packed and then for Ray (one pair at a
time: the large model's copies add up), alternating which goes first per version, and reports the
median bytes per sync, publish and receive seconds, and the paired per-version ratio delta / full.
It also encodes each version with only the element, only the ulps and only the block encoding
(transfer/delta.py, each with dense as the fallback): bytes and host seconds to apply.

Models: `quickstart` (experiments/quickstart.yaml: hidden 64, 2 layers, vocab 512, fp32), `reference`
(docs/performance.md: hidden 128, 4 layers, vocab 512, 1.2 M parameters), `large` (hidden 512,
4 layers, vocab 32k, 46 M), `large8` (hidden 1024, 8 layers, 8 kv heads, vocab 32k, 160 M).

    python bench/transfer.py --part modes [--models reference,large] [--reps 7]
    python bench/transfer.py --part delta [--models quickstart,reference,large8] [--modes file,ray] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
import uuid

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import ray
from levanter.models.llama import LlamaConfig, LlamaLMHeadModel
from machine import machine  # bench/machine.py

from marinrl.config.transfer import FilesystemTransferConfig, RayTransferConfig
from marinrl.transfer.base import host_leaves
from marinrl.transfer.delta_encoding import BLOCK_ELEMENTS, _bits, apply_array, encode_array
from marinrl.transfer.endpoints import build_client, build_server

MODELS = {
    "quickstart": dict(hidden_dim=64, intermediate_dim=256, num_layers=2, num_heads=4, num_kv_heads=4, vocab=512),
    "reference": dict(hidden_dim=128, intermediate_dim=512, num_layers=4, num_heads=4, num_kv_heads=4, vocab=512),
    "large": dict(hidden_dim=512, intermediate_dim=1536, num_layers=4, num_heads=8, num_kv_heads=8, vocab=32_000),
    "large8": dict(hidden_dim=1024, intermediate_dim=2816, num_layers=8, num_heads=16, num_kv_heads=8,
                   vocab=32_000),
}


def build_model(name: str):
    spec = dict(MODELS[name])
    vocab = hax.Axis("vocab", spec.pop("vocab"))
    config = LlamaConfig(seq_len=64, tie_word_embeddings=False, **spec)
    return eqx.filter_jit(lambda key: LlamaLMHeadModel.init(vocab, config, key=key))(jax.random.PRNGKey(0))


def shifted(model, k: float):
    arrays, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda x: x + jnp.asarray(k, x.dtype), arrays), static)


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ----------------------------------------------------------------------------- part 1: modes


def run_mode(config, model, reps: int) -> dict:
    server = build_server(config)
    client = build_client(config, model)
    versions = [jax.block_until_ready(shifted(model, i)) for i in range(reps + 1)]
    publish_s, receive_s = [], []
    try:
        for step, version in enumerate(versions):
            published = server.publish(version, step)
            start = time.perf_counter()
            update = client.poll()
            elapsed = time.perf_counter() - start
            assert update is not None and update.weight_step == step, client.metrics
            if step > 0:  # the first round is the warm-up
                publish_s.append(published.seconds)
                receive_s.append(elapsed)
        return {"publish_s": stats(publish_s), "receive_s": stats(receive_s), "bytes": client.metrics["bytes"],
                "failures": client.metrics["failures"]}
    finally:
        server.close()


def part_modes(args, tmp: str) -> list[dict]:
    results = []
    for model_name in args.models.split(","):
        model = build_model(model_name)
        modes = {
            "memory-packed": FilesystemTransferConfig(root=f"memory://bench-{uuid.uuid4().hex[:8]}", format="packed"),
            "file-packed": FilesystemTransferConfig(root=f"file://{tmp}/{model_name}-packed", format="packed"),
            "file-tensorstore": FilesystemTransferConfig(root=f"file://{tmp}/{model_name}-ts", format="tensorstore"),
            "ray": RayTransferConfig(name=f"bench-{uuid.uuid4().hex[:8]}"),
        }
        for mode, config in modes.items():
            r = run_mode(config, model, args.reps)
            r.update(mode=mode, model=model_name)
            results.append(r)
            print(f"{model_name:9s} {mode:16s} {r['bytes'] / 1e6:8.1f} MB   "
                  f"publish {r['publish_s']['median'] * 1e3:8.1f} ms "
                  f"[{r['publish_s']['min'] * 1e3:.1f}, {r['publish_s']['max'] * 1e3:.1f}]   "
                  f"receive {r['receive_s']['median'] * 1e3:8.1f} ms "
                  f"[{r['receive_s']['min'] * 1e3:.1f}, {r['receive_s']['max'] * 1e3:.1f}]", flush=True)
    return results


# ----------------------------------------------------------------------------- part 2: full vs delta


class Trainer:
    """A fp32 master copy taking AdamW steps on random gradients; `version()` is it cast to `dtype`."""

    def __init__(self, model, lr: float, dtype):
        self.params, self.static = eqx.partition(model, eqx.is_inexact_array)
        self.dtype = dtype
        optimizer = optax.adamw(lr, weight_decay=0.01)
        self.opt_state = optimizer.init(self.params)

        @jax.jit
        def step(params, opt_state, key):
            leaves, treedef = jax.tree.flatten(params)
            keys = jax.random.split(key, len(leaves))
            grads = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._step = step
        self._key = jax.random.PRNGKey(1)

    def step(self):
        self._key, key = jax.random.split(self._key)
        self.params, self.opt_state = self._step(self.params, self.opt_state, key)

    def version(self):
        cast = jax.tree.map(lambda x: x.astype(self.dtype), self.params)
        return jax.block_until_ready(eqx.combine(cast, self.static))


ENCODINGS_COMPARED = ("elements", "ulps", "blocks")


def encodings_compared(prev, cur) -> dict:
    """Bytes and apply seconds of `cur` over `prev` with only elements, ulps or blocks (plus dense)."""
    names, old = host_leaves(prev)
    _, new = host_leaves(cur)
    out = {}
    for only in ENCODINGS_COMPARED:
        nbytes, apply_s = 0, 0.0
        for name, o, n in zip(names, old, new):
            encoding, _, data = encode_array(name, o, n, (only, "dense"))
            nbytes += sum(a.nbytes for a in data)
            if encoding != "same":
                start = time.perf_counter()
                apply_array(name, encoding, o, data, BLOCK_ELEMENTS, "bench")
                apply_s += time.perf_counter() - start
        out[only] = {"bytes": nbytes, "apply_s": apply_s}
    changed = sum(int(np.count_nonzero(_bits(o) != _bits(n))) for o, n in zip(old, new))
    out["changed_fraction"] = changed / sum(a.size for a in new)
    return out


def run_pair(mode: str, tag: str, tmp: str, base, lr: float, dtype, reps: int, compare_encodings: bool):
    """Full and delta servers of one mode side by side on the same versions: per-version samples."""
    if mode == "file":
        configs = {False: FilesystemTransferConfig(root=f"file://{tmp}/{tag}-full", format="packed"),
                   True: FilesystemTransferConfig(root=f"file://{tmp}/{tag}-delta", format="packed", delta=True,
                                                  full_every=1000)}
    else:
        configs = {False: RayTransferConfig(name=f"{tag}-full"),
                   True: RayTransferConfig(name=f"{tag}-delta", delta=True, full_every=1000)}
    trainer = Trainer(base, lr, dtype)  # the same seed in every pair: the same versions
    first = trainer.version()
    servers = {k: build_server(c) for k, c in configs.items()}
    clients = {k: build_client(c, first) for k, c in configs.items()}
    samples = {k: {"publish_s": [], "receive_s": [], "bytes": []} for k in configs}
    enc, prev = [], first
    try:
        for step in range(reps + 2):  # 0: the snapshot; 1: warm-up of the delta path
            version = first if step == 0 else trainer.version()
            for key in ([False, True] if step % 2 else [True, False]):
                published = servers[key].publish(version, step)
                start = time.perf_counter()
                update = clients[key].poll()
                elapsed = time.perf_counter() - start
                assert update is not None and update.weight_step == step, (key, clients[key].metrics)
                if step >= 2:
                    samples[key]["publish_s"].append(published.seconds)
                    samples[key]["receive_s"].append(elapsed)
                    samples[key]["bytes"].append(clients[key].metrics["bytes"])
            if step >= 2 and compare_encodings:
                enc.append(encodings_compared(prev, version))
            prev = version if compare_encodings else None
            del version, update
            trainer.step()
        for key, client in clients.items():
            assert client.metrics["failures"] == 0 and client.metrics["delta_fallbacks"] == 0, key
    finally:
        for server in servers.values():
            server.close()
    return samples, enc


def part_delta(args, tmp: str) -> list[dict]:
    results = []
    for model_name in args.models.split(","):
        base = build_model(model_name)
        for dtype_name in args.dtypes.split(","):
            for lr in [float(x) for x in args.lrs.split(",")]:
                enc = []
                for mode in args.modes.split(","):  # one pair at a time: the large model's copies add up
                    tag = f"{model_name}-{dtype_name}-{lr:g}-{mode}-{uuid.uuid4().hex[:6]}"
                    samples, e = run_pair(mode, tag, tmp, base, lr, jnp.dtype(dtype_name), args.reps, not enc)
                    enc = enc or e
                    full, delta = samples[False], samples[True]
                    r = {"part": "delta", "model": model_name, "dtype": dtype_name, "lr": lr, "mode": mode,
                         "full_bytes": statistics.median(full["bytes"]),
                         "delta_bytes": statistics.median(delta["bytes"]),
                         "full_publish_s": stats(full["publish_s"]), "delta_publish_s": stats(delta["publish_s"]),
                         "full_receive_s": stats(full["receive_s"]), "delta_receive_s": stats(delta["receive_s"]),
                         "publish_ratio": statistics.median(d / f for d, f in zip(delta["publish_s"],
                                                                                    full["publish_s"])),
                         "receive_ratio": statistics.median(d / f for d, f in zip(delta["receive_s"],
                                                                                    full["receive_s"])),
                         "changed_fraction": statistics.median(x["changed_fraction"] for x in enc),
                         **{f"{k}_{m}": statistics.median(x[k][m] for x in enc)
                            for k in ENCODINGS_COMPARED for m in ("bytes", "apply_s")},
                         "load_avg": os.getloadavg()[0]}
                    r["bytes_ratio"] = r["delta_bytes"] / r["full_bytes"]
                    results.append(r)
                    enc_mb = "/".join(f"{r[k + '_bytes'] / 1e6:.3g}" for k in ENCODINGS_COMPARED)
                    enc_ms = "/".join(f"{r[k + '_apply_s'] * 1e3:.1f}" for k in ENCODINGS_COMPARED)
                    print(f"{model_name:10s} {dtype_name:8s} lr {lr:7.0e} {mode:4s} "
                          f"MB full {r['full_bytes'] / 1e6:8.2f} delta {r['delta_bytes'] / 1e6:8.2f} "
                          f"(x{r['bytes_ratio']:.3f})  publish ms {r['full_publish_s']['median'] * 1e3:7.1f} -> "
                          f"{r['delta_publish_s']['median'] * 1e3:7.1f} (x{r['publish_ratio']:.2f})  receive ms "
                          f"{r['full_receive_s']['median'] * 1e3:7.1f} -> {r['delta_receive_s']['median'] * 1e3:7.1f} "
                          f"(x{r['receive_ratio']:.2f})  changed {r['changed_fraction']:.4f}  "
                          f"{'/'.join(ENCODINGS_COMPARED)} MB {enc_mb}  apply ms {enc_ms}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("modes", "delta"), default="modes")
    parser.add_argument("--models", default=None, help="default: reference,large (modes); "
                                                       "quickstart,reference,large8 (delta)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="delta part: dtypes of the published weights")
    parser.add_argument("--lrs", default="1e-6,1e-4", help="delta part: AdamW learning rates")
    parser.add_argument("--modes", default="file,ray", help="delta part: file and/or ray (the first "
                                                            "one also measures the encodings)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    args.models = args.models or ("reference,large" if args.part == "modes" else "quickstart,reference,large8")
    logging.basicConfig(level=logging.WARNING)

    print(json.dumps({"machine": machine()}), flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=2 << 30, log_to_driver=False,
             namespace="bench-transfer")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = part_modes(args, tmp) if args.part == "modes" else part_delta(args, tmp)
    finally:
        ray.shutdown()
    for r in results:
        print(json.dumps(r))
    print(json.dumps({"machine_after": machine()}))


if __name__ == "__main__":
    main()
