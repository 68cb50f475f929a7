"""Weight transfer: seconds to publish a version and to receive it, per mode, side by side.

Modes: the filesystem mode with the packed format on memory:// and file://, with the tensorstore
format (a Levanter checkpoint) on file://, and the Ray object-store mode on a local Ray. Models:
the reference shape of ../shared/BENCHMARK.md (Llama hidden 128, 4 layers, vocab 512, fp32, about
1.2 M parameters) and a larger one (hidden 512, 4 layers, vocab 32k, about 46 M parameters, 186 MB).

`publish_s` is the trainer's `server.publish` (device-to-host copy, write, pointer, clean-up);
`receive_s` is one rollout-side `client.poll()` that finds a new version (pointer or actor call,
fetch, checks, placement on the device). Medians with min and max over the repetitions after one
warm-up; then one JSON line per mode and model (see ../shared/BENCHMARK.md).

    python bench/transfer.py [--models reference,large] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import uuid

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import ray
from levanter.models.llama import LlamaConfig, LlamaLMHeadModel

from marinrl.transfer import FilesystemTransferConfig, RayTransferConfig

MODELS = {
    "reference": dict(hidden_dim=128, intermediate_dim=512, num_layers=4, num_heads=4, num_kv_heads=4, vocab=512),
    "large": dict(hidden_dim=512, intermediate_dim=1536, num_layers=4, num_heads=8, num_kv_heads=8, vocab=32_000),
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


def run_mode(config, model, reps: int) -> dict:
    server = config.build_server()
    client = config.build_client(model)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="reference,large")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1 << 30, log_to_driver=False,
             namespace="bench-transfer")
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for model_name in args.models.split(","):
                model = build_model(model_name)
                modes = {
                    "memory-packed": FilesystemTransferConfig(root=f"memory://bench-{uuid.uuid4().hex[:8]}",
                                                              format="packed"),
                    "file-packed": FilesystemTransferConfig(root=f"file://{tmp}/{model_name}-packed", format="packed"),
                    "file-tensorstore": FilesystemTransferConfig(root=f"file://{tmp}/{model_name}-ts",
                                                                 format="tensorstore"),
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
    finally:
        ray.shutdown()
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
