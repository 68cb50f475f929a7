"""Generation: tokens/s of `InferenceServer.generate` at the reference shape, for our scan sampler (the
default backend, mode `scan`) and Levanter's InferenceEngine (mode `engine`).

The reference shape of docs/performance.md: Llama hidden 128, 4 layers, 4 heads (4 KV), intermediate
512, vocab 512, untied head, fp32, init N(0, 0.02); one call = 8 prompts × 8 samples, 16-token prompts
(uniform random bytes), up to 32 new tokens at temperature 1.0, no top-k/top-p, EOS stops a sample
(a random-init model samples EOS with probability about 1/512 per token, so a few samples end early).

- `gen_tokens_per_s`: generated tokens (EOS included) / wall time of one `generate` call, host
  packing and the device-to-host copy included. Median, min and max over calls 3..--calls.
- `compile_s`: wall time of the first call minus the median call (tracing + compilation).
- `gen_tokens_per_cpu_s`: generated tokens / CPU time of this process during the call. On a shared
  machine wall time depends on the neighbours; CPU time much less, so this says which mode does less
  work even when the wall-clock figures are noisy.

The modes run interleaved, call by call (the machine is shared: compare modes within one run). The
JAX persistent compilation cache is not used, so compile_s is a real compile. One JSON line per mode
at the end, the default backend (`scan`) last.

    python bench/generation.py [--calls 30] [--modes scan,engine] [--engine-page-size 64]
        [--engine-max-rounds 32]

A mode may name the rollout mesh's model axis: `scan@4` is the scan sampler tensor-parallel over 4
devices (`InferenceServerConfig.model_axis_size`); `--cpu-devices 4` gives the CPU 4 fake devices:

    python bench/generation.py --cpu-devices 4 --modes scan,scan@4,scan@2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30, help="calls per mode; medians over calls 3..calls")
    parser.add_argument("--modes", default="engine,scan", help="comma-separated: scan, engine")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--engine-page-size", type=int, default=None, help="EngineConfig.page_size (default 64)")
    parser.add_argument("--engine-max-rounds", type=int, default=32, help="EngineConfig.max_rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="fake CPU devices (XLA --xla_force_host_platform_device_count)")
    args = parser.parse_args()
    if args.calls < 3:
        parser.error("--calls must be >= 3 (medians are over calls 3..calls)")
    return args


ARGS = _parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if ARGS.cpu_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}").strip()
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import json  # noqa: E402
import logging  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from levanter.models.llama import LlamaConfig  # noqa: E402

from marinrl.config.model import ModelConfig  # noqa: E402
from marinrl.config.server import EngineConfig, InferenceServerConfig  # noqa: E402
from marinrl.inference.context import SamplingParams  # noqa: E402
from marinrl.inference.server import InferenceServer  # noqa: E402
from marinrl.models.policy_model import build_model, build_tokenizer  # noqa: E402

VOCAB = 512
FIRST_MEASURED = 3  # 1-based: calls 1 and 2 are warm-up


def reference_model_config(seed: int) -> ModelConfig:
    llama = LlamaConfig(
        seq_len=256, hidden_dim=128, intermediate_dim=512, num_layers=4, num_heads=4, num_kv_heads=4,
        gradient_checkpointing=False,
    )
    return ModelConfig(model=llama, vocab_size=VOCAB, seed=seed, init_std=0.02, dtype="float32")


def stats(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(args) -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("levanter").setLevel(logging.WARNING)
    model_cfg = reference_model_config(args.seed)
    model, tokenizer = build_model(model_cfg), build_tokenizer(model_cfg)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(model) if hasattr(x, "size"))
    engine_cfg = EngineConfig(
        max_seqs=args.prompts * args.samples,
        max_seq_len=args.prompt_tokens + args.new_tokens,
        max_prefill_tokens=args.prompts * args.prompt_tokens,
        max_rounds=args.engine_max_rounds,
        page_size=args.engine_page_size,
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    servers = {}
    for mode in modes:
        backend, _, axis = mode.partition("@")
        cfg = InferenceServerConfig(backend=backend, serve_http=False, engine=engine_cfg,
                                    model_axis_size=int(axis) if axis else None)
        servers[mode] = InferenceServer(cfg, model, tokenizer).start()
    rng = np.random.default_rng(args.seed)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens)
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    tokens = {m: [] for m in modes}
    for call in range(args.calls):
        prompts = rng.integers(0, 256, (args.prompts, args.prompt_tokens)).tolist()
        for mode in modes:
            c0, t0 = time.process_time(), time.perf_counter()
            gens = servers[mode].generate(prompts, args.samples, sampling, seed=call)
            times[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
            tokens[mode].append(sum(len(g.tokens) for row in gens for g in row))
    for s in servers.values():
        s.shutdown()

    print(f"generation at the reference shape: {n_params / 1e6:.2f}M params, {args.prompts} prompts x "
          f"{args.samples} samples, {args.prompt_tokens}-token prompts, up to {args.new_tokens} new tokens, "
          f"T={args.temperature}, backend {jax.default_backend()} ({jax.device_count()} device)")
    print(f"{'mode':8s} {'tokens/s median':>16s} {'min':>9s} {'max':>9s} {'call s':>8s} {'tokens/call':>12s} "
          f"{'compile s':>10s} {'tokens/cpu-s':>13s}")
    results = {}
    for mode in modes:
        measured = slice(FIRST_MEASURED - 1, None)
        tps = [n / t for n, t in zip(tokens[mode][measured], times[mode][measured])]
        call_s = statistics.median(times[mode][measured])
        compile_s = times[mode][0] - call_s
        per_cpu = [n / c for n, c in zip(tokens[mode][measured], cpu[mode][measured])]
        results[mode] = {"mode": mode, "gen_tokens_per_s": stats(tps), "compile_s": compile_s,
                         "call_s": stats(times[mode][measured]), "gen_tokens_per_cpu_s": stats(per_cpu),
                         "tokens_per_call": statistics.median(tokens[mode][measured])}
        print(f"{mode:8s} {stats(tps)['median']:16,.0f} {min(tps):9,.0f} {max(tps):9,.0f} {call_s:8.3f} "
              f"{statistics.median(tokens[mode]):12.0f} {compile_s:10.2f} {statistics.median(per_cpu):13,.0f}")
    if "scan" in results and "engine" in results:
        ratio = results["scan"]["gen_tokens_per_s"]["median"] / results["engine"]["gen_tokens_per_s"]["median"]
        print(f"scan / engine median tokens/s: {ratio:.2f}x")
    for mode in sorted(results, key=lambda m: m == "scan"):  # the default backend last
        print(json.dumps(results[mode]))


if __name__ == "__main__":
    main(ARGS)
    sys.stdout.flush()
