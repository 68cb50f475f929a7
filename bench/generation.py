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

The mode `scan_kernel` is the scan sampler with `inference.attention: gpu_kernel` (the Pallas decode kernel,
docs/inference.md, "The decode kernel"); its JSON line says which attention ran (`attention`: off a GPU the
server runs `xla`) and its tokens/s over `scan`'s in paired calls (`over_scan`):

    python bench/generation.py --shape recipe --modes scan,scan_kernel

`--baseline REV` adds the mode `baseline`: the scan sampler of git revision REV (its `sampler.py` and
`decoder.py`, loaded beside today's), called interleaved with today's, so a change to the sampler is an A/B in
one run: `python bench/generation.py --modes scan --baseline 9179f9f`.

Each mode's JSON line also says how the batch went to the device (`calls`, `rows_per_call`), the bytes a
decode step reads (`bytes_per_step`: weights and the KV of the slots it attends to, `scan_plan`) and the
memory roofline where the device's bandwidth is known (`roofline_tokens_per_s`, `roofline_fraction`;
`dry_run.flops.CHIP_MEMORY_BANDWIDTH`, or `--bandwidth` for a CPU measured with a large copy).

`--shape recipe` is the accelerator shape: Qwen3-0.6B (random weights, bfloat16), 16 prompts × 16 samples,
256-token prompts, up to 768 new tokens. `--plan DEVICE` (h100, h200, a100, v5p, v5e, v6e, v4) runs nothing: it
prints the plan for that device with no backend (calls, rows per call, bytes a step, predicted tokens/s at
the roofline) from shapes alone, as the JSON line's last line:

    python bench/generation.py --plan h100 --shape recipe
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
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
    parser.add_argument("--shape", default="reference", choices=["reference", "recipe"])
    parser.add_argument("--plan", default=None, help="a device (h100, h200, ...): print its plan, run nothing")
    parser.add_argument("--baseline", default=None, help="git revision whose scan sampler is the `baseline` mode")
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes/s for the roofline (default: the chip's)")
    args = parser.parse_args()
    if args.shape == "recipe":
        for name, value in RECIPE_SHAPE.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if args.calls < 3:
        parser.error("--calls must be >= 3 (medians are over calls 3..calls)")
    return args


RECIPE_SHAPE = dict(prompts=16, samples=16, prompt_tokens=256, new_tokens=768, modes="scan", calls=3)
"""`--shape recipe`: the Qwen3-0.6B recipe's rollout batch (a flag given explicitly wins)."""
ARGS = _parse_args()
if not ARGS.plan and ARGS.shape == "reference":
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
from marinrl.dry_run.flops import chip_memory_bandwidth  # noqa: E402
from marinrl.inference import sampler, scan_plan  # noqa: E402
from marinrl.inference.context import SamplingParams  # noqa: E402
from marinrl.inference.server import InferenceServer  # noqa: E402
from marinrl.models.policy_model import build_model, build_tokenizer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
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


def recipe_job():
    """The one-GPU-node recipe's job with random weights (its Qwen3-0.6B architecture, bfloat16 rollouts)."""
    import runpy

    from marinrl.recipe import parse_recipe

    recipe = runpy.run_path(str(REPO / "experiments" / "grpo_math_qwen3_0p6b_one_gpu_node.py"), run_name="recipe")
    return parse_recipe(recipe["RECIPE"], ["--model.hf_checkpoint=null", "--n_rollout_workers=1"])


def model_config(args) -> ModelConfig:
    if args.shape == "recipe":
        job = recipe_job()
        return dataclasses.replace(job.model, dtype=job.rollout_dtype())
    return reference_model_config(args.seed)


def roofline(model, plan, args, bandwidth) -> dict:
    """The bytes a decode step of one call reads and the tokens/s that `bandwidth` allows (`scan_plan`)."""
    cfg = model.config
    attn = cfg.attention_config()
    itemsize = np.dtype(model.embeddings.token_embeddings.weight.dtype).itemsize
    weights = float(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(model)
                        if hasattr(x, "dtype")))
    per_step = scan_plan.decode_bytes_per_step(
        weights_bytes=weights, kv_bytes_per_token=2 * cfg.num_layers * attn.num_kv_heads * attn.head_size * itemsize,
        prompts=plan.prompts_per_call, n=args.samples, p_len=scan_plan.bucket(args.prompt_tokens, 16),
        t_len=scan_plan.bucket(args.new_tokens, 16), steps=args.new_tokens)
    out = {"calls": plan.calls, "rows_per_call": plan.rows_per_call, "bytes_per_step": per_step}
    if bandwidth:
        out.update(bandwidth=bandwidth, roofline_tokens_per_s=plan.rows_per_call * bandwidth / per_step)
    return out


def print_plan(args) -> None:
    """`--plan DEVICE`: the split and the roofline from shapes alone (no backend is used)."""
    from marinrl.dry_run.engine_cache import DEVICE_MEMORY_GIB, GPU_MEMORY_FRACTION
    from marinrl.dry_run.flops import PLAN_DEVICES, chip_memory_bandwidth
    from marinrl.dry_run.shapes import GiB, abstract_model

    kind = PLAN_DEVICES.get(args.plan.lower())
    if kind is None:
        sys.exit(f"--plan: {args.plan!r} is not one of {', '.join(PLAN_DEVICES)}")
    cfg = model_config(args)
    model = abstract_model(cfg.model, cfg.vocab_size, cfg.dtype)
    name = kind.split()[-1] if kind.startswith("NVIDIA") else {"TPU v5": "v5p", "TPU v5 lite": "v5litepod",
                                                               "TPU v6 lite": "v6e", "TPU v4": "v4"}[kind]
    limit = DEVICE_MEMORY_GIB[name] * GiB * (GPU_MEMORY_FRACTION if kind.startswith("NVIDIA") else 1.0)
    weights = float(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(model)
                        if hasattr(x, "dtype")))
    plan = sampler.call_plan(model, args.prompts, n=args.samples, prompt_tokens=args.prompt_tokens,
                             max_tokens=args.new_tokens, max_cache_bytes=scan_plan.auto_cache_budget(limit, weights))
    figures = roofline(model, plan, args, chip_memory_bandwidth(kind))
    print(f"plan on one {kind} ({limit / GiB:.1f} GiB for JAX): {args.prompts} prompts x {args.samples} samples, "
          f"{args.prompt_tokens}-token prompts, up to {args.new_tokens} new tokens: {plan.calls} call(s) of "
          f"{plan.rows_per_call} rows, {plan.per_device_cache_bytes / GiB:.2f} GiB of KV cache a call, "
          f"{figures['bytes_per_step'] / 1e9:.2f} GB read a decode step, roofline "
          f"{figures['roofline_tokens_per_s']:,.0f} tokens/s")
    print(json.dumps({"mode": "plan", "device": kind, "shape": args.shape, "prompts": args.prompts,
                      "samples": args.samples, "cache_budget_bytes": scan_plan.auto_cache_budget(limit, weights),
                      **figures}))


def host_bandwidth() -> float:
    """This machine's memory bandwidth (bytes/s read + written) from a 256 MiB copy, the best of five."""
    a, b = np.ones(1 << 25), np.empty(1 << 25)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclasses.dataclass
class Generated:
    tokens: np.ndarray


class SamplerModule:
    """`generate` straight through a scan sampler module (today's, or `--baseline`'s), as the server calls it."""

    def __init__(self, module, model, eos: int, cache_bytes: int):
        self.module, self.model, self.eos, self.cache_bytes = module, model, eos, cache_bytes

    def generate(self, prompts, n, sampling, seed):
        out = self.module.sample(self.model, prompts, n=n, temperature=sampling.temperature,
                                 max_tokens=sampling.max_tokens, stop_sequences=[(self.eos,)], seed=seed,
                                 max_cache_bytes=self.cache_bytes)
        return [[Generated(out.tokens[r, :out.lengths[r]]) for r in range(i * n, (i + 1) * n)]
                for i in range(len(prompts))]

    def shutdown(self):
        pass


def load_baseline(rev: str):
    """The scan sampler of git revision `rev` (its sampler.py over its decoder.py) as a module of its own; `rev`
    may also be a folder holding those two files (`git show REV:PATH` copies, for a machine without the repo's
    history)."""
    import subprocess
    import types

    def load(name, path, replace=()):
        folder = pathlib.Path(rev)
        if folder.is_dir():
            text = (folder / pathlib.Path(path).name).read_text()
        else:
            text = subprocess.check_output(["git", "-C", str(REPO), "show", f"{rev}:{path}"], text=True)
        for old, new in replace:
            text = text.replace(old, new)
        module = types.ModuleType(name)
        module.__file__ = f"{rev}:{path}"
        sys.modules[name] = module
        exec(compile(text, module.__file__, "exec"), module.__dict__)
        return module

    load("_baseline_decoder", "src/marinrl/inference/decoder.py")
    return load("_baseline_sampler", "src/marinrl/inference/sampler.py",
                [("marinrl.inference.decoder", "_baseline_decoder")])


def main(args) -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("levanter").setLevel(logging.WARNING)
    model_cfg = model_config(args)
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
    if args.baseline:
        modes.append("baseline")
    servers = {}
    for mode in modes:
        if mode == "baseline":
            continue
        backend, _, axis = mode.partition("@")
        attention = "gpu_kernel" if backend == "scan_kernel" else "xla"
        cfg = InferenceServerConfig(backend="scan" if backend == "scan_kernel" else backend, serve_http=False,
                                    engine=engine_cfg, model_axis_size=int(axis) if axis else None,
                                    attention=attention)
        servers[mode] = InferenceServer(cfg, model, tokenizer).start()
    scan_server = next((s for m, s in servers.items() if m.startswith("scan")), None)
    budget = scan_server.scan_cache_bytes if scan_server else scan_plan.CPU_CACHE_BYTES
    if args.baseline:  # both samplers called the same way, with the same budget
        servers["baseline"] = SamplerModule(load_baseline(args.baseline), model, tokenizer.eos_token_id, budget)
        servers["scan"] = SamplerModule(sampler, scan_server.model if scan_server else model, tokenizer.eos_token_id,
                                        budget)
    plan = sampler.call_plan(model, args.prompts, n=args.samples, prompt_tokens=args.prompt_tokens,
                             max_tokens=args.new_tokens, max_cache_bytes=budget)
    device_kind = jax.local_devices()[0].device_kind
    bandwidth = args.bandwidth or chip_memory_bandwidth(device_kind) or (
        host_bandwidth() if jax.default_backend() == "cpu" else None)
    figures = roofline(model, plan, args, bandwidth)
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

    print(f"generation at the {args.shape} shape: {n_params / 1e6:.2f}M params, {args.prompts} prompts x "
          f"{args.samples} samples, {args.prompt_tokens}-token prompts, up to {args.new_tokens} new tokens, "
          f"T={args.temperature}, backend {jax.default_backend()} ({jax.device_count()} device)")
    print(f"{'mode':11s} {'tokens/s median':>16s} {'min':>9s} {'max':>9s} {'call s':>8s} {'tokens/call':>12s} "
          f"{'compile s':>10s} {'tokens/cpu-s':>13s}")
    results = {}
    for mode in modes:
        measured = slice(FIRST_MEASURED - 1, None)
        tps = [n / t for n, t in zip(tokens[mode][measured], times[mode][measured])]
        call_s = statistics.median(times[mode][measured])
        compile_s = times[mode][0] - call_s
        per_cpu = [n / c for n, c in zip(tokens[mode][measured], cpu[mode][measured])]
        results[mode] = {"mode": mode, "shape": args.shape, "device": device_kind,
                         "gen_tokens_per_s": stats(tps), "tokens_per_s": stats(tps)["median"],
                         "compile_s": compile_s, "call_s": stats(times[mode][measured]),
                         "step_ms": 1e3 * statistics.median(times[mode][measured]) / args.new_tokens,
                         "gen_tokens_per_cpu_s": stats(per_cpu),
                         "tokens_per_call": statistics.median(tokens[mode][measured])}
        if mode in servers and hasattr(servers[mode], "attention"):
            results[mode]["attention"] = servers[mode].attention
        if mode.startswith("scan") and "@" not in mode:
            results[mode].update(figures)
            if figures.get("roofline_tokens_per_s"):
                results[mode]["roofline_fraction"] = stats(tps)["median"] / figures["roofline_tokens_per_s"]
        print(f"{mode:11s} {stats(tps)['median']:16,.0f} {min(tps):9,.0f} {max(tps):9,.0f} {call_s:8.3f} "
              f"{statistics.median(tokens[mode]):12.0f} {compile_s:10.2f} {statistics.median(per_cpu):13,.0f}")
    for mode, other in (("scan", "engine"), ("scan", "baseline"), ("scan_kernel", "scan")):
        if mode in results and other in results:
            paired = [(ts / ns) / (to / no) for ns, ts, no, to in zip(
                tokens[mode][FIRST_MEASURED - 1:], times[mode][FIRST_MEASURED - 1:],
                tokens[other][FIRST_MEASURED - 1:], times[other][FIRST_MEASURED - 1:])]
            ratio = statistics.median(1 / r for r in paired)
            results[mode][f"over_{other}"] = ratio
            print(f"{mode} / {other} tokens/s, median of the paired calls: {ratio:.2f}x "
                  f"(min {min(1 / r for r in paired):.2f}, max {max(1 / r for r in paired):.2f})")
    if "scan" in results and "calls" in results["scan"]:
        r = results["scan"]
        print(f"scan: {r['calls']} call(s) of {r['rows_per_call']} rows, {r['bytes_per_step'] / 1e6:,.1f} MB read a "
              f"decode step" + (f", roofline {r['roofline_tokens_per_s']:,.0f} tokens/s "
                                f"({r['roofline_fraction']:.0%} reached)" if "roofline_fraction" in r else ""))
    for mode in sorted(results, key=lambda m: m == "scan"):  # the default backend last
        print(json.dumps(results[mode]))


if __name__ == "__main__":
    print_plan(ARGS) if ARGS.plan else main(ARGS)
    sys.stdout.flush()
