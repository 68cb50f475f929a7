"""Many agents, one base: memory, update time and generation tokens/s of K LoRA adapters over ONE frozen base
(docs/policies.md, "Many agents, one base: the trainer"), at the same total rows per step for every K (each adapter
gets total_rows / K of them).

- layout `shared` (what a job runs for the `lora` policies of one base), for each K of `--agents`:
  - trainer: ONE jitted step over the base with K stacked adapters (`adapter_stack.stacked_adapters`, slot k
    `LoraRLConfig(rank=r, alpha=2r, seed=k)`) on a batch with an `adapter` axis [K, total_rows / K, 48]:
    gradients of `adapter_slots.per_adapter_loss` of the `grpo` loss (`losses.rl_loss`) with respect to the
    adapters alone (`lora.trainable_filter`), then `per_slot` AdamW (lr 1e-4, clip 1.0), parameters and moments
    donated, as the TrainWorker's step computes it without Levanter's Trainer around it.
  - rollout: one base and a K-slot `AdapterStack` (each slot a trained-looking adapter: Levanter's A, random B),
    ONE sampler call of total_rows rows, the prompts spread evenly over the slots (`adapter_index`).
- layout `per_adapter` (before: a trainer and a merged served model per adapter), at K = 4 when 4 is in
  `--agents`: K one-adapter trainers (`lora.add_adapters`, each on its own copy of the base) of total_rows / K
  rows; K merged models (`lora.merge_adapters`), K sampler calls of total_rows / K rows.

What is reported, per (K, layout):
- `trainer_peak_gib`: XLA's own buffer assignment of the compiled step (`compiled.memory_analysis()`:
  arguments + outputs − aliased (donated) + temporaries): the base, adapters, AdamW moments, the batch,
  gradients and activations. Exact for this program on this backend. `per_adapter`: K × one trainer's.
  `trainer_param_bytes` (base + adapters) and `trainer_temp_gib` (gradients, activations) beside it.
- `rollout_peak_gib`: the weights a rollout worker holds (base + stack, or a merged model: the bytes of the arrays)
  plus the compiled sampler program's temporaries (KV cache, logits; `rollout_memory: "held+temp"`, or `"held"`
  where the backend has no memory analysis). `per_adapter`: K × one worker's.
- `step_s`: median wall seconds of a step after the first (until ready; `per_adapter`: the K steps summed, they
  share this machine's cores). `gen_tokens_per_s`: generated tokens / wall seconds of a generation (`per_adapter`:
  its K calls), median over calls after the first. The cases run interleaved, step by step and call by call.

Model: the reference shape of docs/performance.md (Llama hidden 128, 4 layers, 4 heads, intermediate 512, vocab
512, fp32); `--tiny` (hidden 32, 2 layers) is for tests. Rank 8 on every linear module; trainer rows of 16 prompt +
32 response tokens; generation of 16-token prompts × `--samples`, 32 new tokens at temperature 1, no stop token.
Then the machine, one JSON line per (K, layout) and `{"ratios": ...}` with the targets: memory at K = 4 within
1.25× of K = 1 on each side, generation at K = 4 ≥ 0.8× K = 1, the K = 4 step no slower than `per_adapter`'s.

    python bench/lora_agents.py [--agents 1,2,4,8] [--total-rows 64] [--steps 8] [--calls 8] [--rank 8] [--tiny]

Measured (the default run, reference shape; docs/performance.md, "Many agents, one base") [Intel Xeon, 2 CPUs,
AVX-512 (F, BW, VL, VNNI, BF16, FP16) and AMX, JAX 0.10.2, load 1.0–1.5: seconds noisy, bytes exact]:

| K | layout | trainer peak GiB | rollout peak GiB | gen tokens/s | step s |
|---|---|---:|---:|---:|---:|
| 1 | shared | 0.336 | 0.0218 | 20,586 | 0.392 |
| 2 | shared | 0.332 | 0.0225 | 19,302 | 0.407 |
| 4 | shared | 0.333 | 0.0240 | 19,617 | 0.386 |
| 8 | shared | 0.339 | 0.0270 | 16,177 | 0.405 |
| 4 | per_adapter | 0.369 | 0.0571 | 16,595 | 0.424 |

Every target met: trainer memory K = 4 / K = 1 0.99, rollout memory 1.10, generation 0.95, the K = 4 step 0.94× the
per_adapter layout's (paired). At this shape the trainer's peak is its temporaries (0.32–0.33 GiB of activations for
64 rows × 48 tokens, the same for every K); the base is 4.7 MB, an adapter 0.40 MB (rank 8 on every linear module)
and its AdamW moments 0.79 MB, so K adds little. The rollout worker holds the base and the stack (5.1–7.9 MB) and
its program's temporaries (KV cache, logits: 18–21 MB); per_adapter holds 4 merged models and 4 programs. At K = 8
(K·r = 64, half the width) generation is 0.79× K = 1's: the adapter terms' K·r·(in + out) per row and projection.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from levanter.models.llama import LlamaConfig  # noqa: E402
from machine import machine  # noqa: E402

from marinrl.config.lora import LoraRLConfig  # noqa: E402
from marinrl.config.loss import LossConfig  # noqa: E402
from marinrl.config.model import ModelConfig  # noqa: E402
from marinrl.inference import sampler  # noqa: E402
from marinrl.models.adapter_stack import ADAPTER, AdapterStack, stacked_adapters  # noqa: E402
from marinrl.models.lora import adapter_only, add_adapters, merge_adapters, trainable_filter  # noqa: E402
from marinrl.models.policy_model import build_model  # noqa: E402
from marinrl.train.adapter_slots import per_adapter_loss, per_slot  # noqa: E402
from marinrl.train.batching import TrainingBatch  # noqa: E402
from marinrl.train.losses import rl_loss  # noqa: E402

GiB = 1024 ** 3
VOCAB = 512
PROMPT, RESPONSE = 16, 32
LOSS = LossConfig.preset("grpo")
PER_ADAPTER_K = 4
TARGETS = {"trainer_memory_k4_over_k1": ("<=", 1.25), "rollout_memory_k4_over_k1": ("<=", 1.25),
           "gen_k4_over_k1": (">=", 0.8), "step_k4_shared_over_per_adapter": ("<=", 1.0)}


def model_config(tiny: bool) -> ModelConfig:
    if tiny:
        llama = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2,
                            gradient_checkpointing=False)
    else:
        llama = LlamaConfig(seq_len=256, hidden_dim=128, intermediate_dim=512, num_layers=4, num_heads=4,
                            num_kv_heads=4, gradient_checkpointing=False)
    return ModelConfig(model=llama, vocab_size=VOCAB, seed=0, init_std=0.02, dtype="float32")


def lora_configs(rank: int, k: int) -> list[LoraRLConfig]:
    return [LoraRLConfig(rank=rank, alpha=2.0 * rank, seed=s) for s in range(k)]


def nbytes(tree) -> int:
    """Bytes of the arrays of a pytree (NamedArrays included)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x)))


def adapter_bytes(base, lora: LoraRLConfig) -> int:
    """One adapter's bytes (its A and B arrays) on `base`, from the pytree."""
    return nbytes(adapter_only(add_adapters(base, lora)))


def peak(memory) -> int | None:
    """arguments + outputs − aliased + temporaries of a compiled program (None: no analysis on this backend)."""
    if memory is None:
        return None
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)


# ------------------------------------------------------------------------------------------------ trainer


def batch(rows: int, rng: np.random.Generator) -> TrainingBatch:
    """`rows` rollouts of 16 prompt + 32 response tokens, one per row, near-uniform sampler logprobs."""
    length = PROMPT + RESPONSE
    mask = np.zeros((rows, length))
    mask[:, PROMPT - 1:length - 1] = 1
    return TrainingBatch.one_sequence_per_row(
        input_ids=rng.integers(2, VOCAB, (rows, length)), target_ids=rng.integers(2, VOCAB, (rows, length)),
        loss_mask=mask, sampler_logprobs=np.log(1 / VOCAB) + 0.25 * rng.normal(size=(rows, length)),
        advantages=np.repeat(rng.normal(size=(rows, 1)), length, axis=1), temperature=np.ones(rows))


def stacked_batch(k: int, rows: int, rng) -> TrainingBatch:
    return jax.tree.map(lambda *xs: hax.stack(ADAPTER, xs), *[batch(rows, rng) for _ in range(k)],
                        is_leaf=hax.is_named_array)


class Trainer:
    """One trainer's jitted step (gradients of the adapters, AdamW) over `model`: K stacked adapters (`stacked`)
    or one adapter (`lora.add_adapters`). `compiled` may be another trainer's of the same shapes."""

    def __init__(self, model, k: int, rows: int, rng, stacked: bool, compiled=None):
        optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.0))
        if stacked:
            loss = per_adapter_loss(lambda m, b, key=None: rl_loss(m, b, config=LOSS), [str(s) for s in range(k)])
            optimizer = per_slot(optimizer, k)
            self.batches = [stacked_batch(k, rows, rng) for _ in range(2)]
        else:
            loss = lambda m, b: rl_loss(m, b, config=LOSS)  # noqa: E731
            self.batches = [batch(rows, rng) for _ in range(2)]
        trainable, frozen = eqx.partition(model, trainable_filter(model))
        self.params, rest = eqx.partition(trainable, eqx.is_inexact_array)
        self.frozen, static = eqx.partition(eqx.combine(rest, frozen), eqx.is_array)  # Python flags stay static
        self.opt_state = optimizer.init(self.params)
        self.param_bytes = nbytes(self.params) + nbytes(self.frozen)
        self.optimizer_bytes = nbytes(self.opt_state)

        def step(params, opt_state, frozen, b):
            grads = jax.grad(lambda p: loss(eqx.combine(p, frozen, static), b)[0])(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return eqx.apply_updates(params, updates), opt_state

        if compiled is None:
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
                self.params, self.opt_state, self.frozen, self.batches[0]).compile()
        self.compiled = compiled
        memory = compiled.memory_analysis()
        self.peak_bytes = peak(memory)
        self.temp_bytes = memory.temp_size_in_bytes if memory is not None else None
        self.steps = 0

    def run(self) -> float:
        b = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        start = time.perf_counter()
        self.params, self.opt_state = self.compiled(self.params, self.opt_state, self.frozen, b)
        jax.block_until_ready((self.params, self.opt_state))
        return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ rollout


def trained_adapter(base, lora: LoraRLConfig):
    """An adapter as training leaves it: Levanter's A of `lora.seed`, B random and nonzero."""
    key = jax.random.PRNGKey(1000 + lora.seed)

    def b_random(path, x):
        nonlocal key
        if not (eqx.is_inexact_array(x) and "lora_B" in jax.tree_util.keystr(path)):
            return x
        key, sub = jax.random.split(key)
        return 0.02 * jax.random.normal(sub, x.shape, x.dtype)

    return jax.tree_util.tree_map_with_path(b_random, adapter_only(add_adapters(base, lora)))


def sample_program_temp(call) -> int | None:
    """Temporaries (KV cache, logits, ...) of the compiled sampler program that `call()` runs: the program's
    arguments as `sampler._generate` received them, lowered and compiled once more for its memory analysis."""
    jitted, seen = sampler._generate, []

    def recording(*args, **kwargs):
        seen.append((args, kwargs))
        return jitted(*args, **kwargs)

    sampler._generate = recording
    try:
        call()
    finally:
        sampler._generate = jitted
    args, kwargs = seen[0]
    memory = jitted.lower(*args, **kwargs).compile().memory_analysis()
    return None if memory is None else memory.temp_size_in_bytes


class Rollout:
    """A rollout worker's weights for K adapters in a layout, and one generation of `len(prompts) × samples` rows
    (`per_adapter`: one call per merged model, on its share of the prompts)."""

    def __init__(self, base, cfg: ModelConfig, configs: list[LoraRLConfig], layout: str, prompts, samples: int):
        self.k, self.layout, self.prompts, self.samples = len(configs), layout, prompts, samples
        if layout == "shared":
            stack = AdapterStack.empty(base, configs[0], self.k)
            for s, lora in enumerate(configs):
                stack = stack.with_adapter(s, trained_adapter(base, lora))
            self.stack = stack
            self.held = nbytes(base) + nbytes(stack.adapters)
            share = len(prompts) // self.k
            self.index = [i // share for i in range(len(prompts))]  # slot k: prompts k·share .. (k+1)·share − 1
        else:  # each merged model served on its own (its own copy of the base's other arrays too)
            self.merged = []
            for lora in configs:
                own = build_model(cfg)
                self.merged.append(merge_adapters(eqx.combine(trained_adapter(own, lora), add_adapters(own, lora))))
            self.held = nbytes(self.merged[0])  # per worker
        self.temp = sample_program_temp(lambda: self.run(seed=0))

    def run(self, seed: int) -> tuple[float, int]:
        kw = dict(n=self.samples, temperature=1.0, max_tokens=RESPONSE, stop_sequences=[], seed=seed)
        start = time.perf_counter()
        if self.layout == "shared":
            outs = [sampler.sample(self.stack.base, self.prompts, adapters=self.stack.adapters,
                                   adapter_index=self.index, min_prompts=len(self.prompts), **kw)]
        else:
            share = len(self.prompts) // self.k
            outs = [sampler.sample(m, self.prompts[i * share:(i + 1) * share], min_prompts=share, **kw)
                    for i, m in enumerate(self.merged)]
        tokens = int(sum(o.lengths.sum() for o in outs))
        return time.perf_counter() - start, tokens

    @property
    def peak_bytes(self) -> int:
        """One worker's weights (+ its program's temporaries where known), times K workers for `per_adapter`."""
        workers = self.k if self.layout == "per_adapter" else 1
        return workers * (self.held + (self.temp or 0))


# -------------------------------------------------------------------------------------------------- main


def measure(args) -> list[dict]:
    cfg = model_config(args.tiny)
    base = build_model(cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, PROMPT).tolist() for _ in range(args.total_rows // args.samples)]
    cases = [(k, "shared") for k in args.agents]
    if PER_ADAPTER_K in args.agents:
        cases.append((PER_ADAPTER_K, "per_adapter"))
    trainers, rollouts = {}, {}
    for k, layout in cases:
        configs, rows = lora_configs(args.rank, k), args.total_rows // k
        print(f"building K={k} {layout} ...", file=sys.stderr, flush=True)
        if layout == "shared":
            trainers[k, layout] = [Trainer(stacked_adapters(base, configs), k, rows, rng, stacked=True)]
        else:  # a trainer per adapter, each on a base of its own; one program for all (same shapes)
            first = Trainer(add_adapters(build_model(cfg), configs[0]), 1, rows, rng, stacked=False)
            trainers[k, layout] = [first] + [Trainer(add_adapters(build_model(cfg), c), 1, rows, rng, stacked=False,
                                                     compiled=first.compiled) for c in configs[1:]]
        rollouts[k, layout] = Rollout(base, cfg, configs, layout, prompts, args.samples)

    steps = {c: [] for c in cases}
    for i in range(args.steps + 1):  # interleaved; round 0 (first run of each program) is not counted
        for c in cases:
            t = sum(tr.run() for tr in trainers[c])
            if i:
                steps[c].append(t)
    calls = {c: [] for c in cases}
    for i in range(args.calls + 1):
        for c in cases:
            t, n = rollouts[c].run(seed=i + 1)
            if i:
                calls[c].append(n / t)

    kind = machine()
    lines = []
    for k, layout in cases:
        trs, ro = trainers[k, layout], rollouts[k, layout]
        known = all(tr.peak_bytes is not None for tr in trs)
        lines.append({
            "agents": k, "layout": layout,
            "trainer_peak_gib": (sum(tr.peak_bytes for tr in trs) if known
                                 else sum(tr.param_bytes + tr.optimizer_bytes for tr in trs)) / GiB,
            "rollout_peak_gib": ro.peak_bytes / GiB,
            "gen_tokens_per_s": statistics.median(calls[k, layout]),
            "step_s": statistics.median(steps[k, layout]),
            "total_rows": args.total_rows, "rank": args.rank, "machine": kind,
            "trainer_memory": "xla" if known else "params+optimizer (no memory analysis on this backend)",
            "trainer_param_bytes": sum(tr.param_bytes for tr in trs),
            "trainer_optimizer_bytes": sum(tr.optimizer_bytes for tr in trs),
            "trainer_temp_gib": sum(tr.temp_bytes or 0 for tr in trs) / GiB,
            "rollout_memory": "held+temp" if ro.temp is not None else "held",
            "rollout_held_bytes": ro.held * (k if layout == "per_adapter" else 1),
            "gen_tokens_per_s_all": calls[k, layout], "step_s_all": steps[k, layout],
            "rows_per_adapter": args.total_rows // k, "samples": args.samples, "tiny": args.tiny,
        })
    return lines


def ratios(lines: list[dict]) -> dict:
    by = {(x["agents"], x["layout"]): x for x in lines}
    out = {}
    if (1, "shared") in by and (4, "shared") in by:
        one, four = by[1, "shared"], by[4, "shared"]
        out = {"trainer_memory_k4_over_k1": four["trainer_peak_gib"] / one["trainer_peak_gib"],
               "rollout_memory_k4_over_k1": four["rollout_peak_gib"] / one["rollout_peak_gib"],
               "gen_k4_over_k1": four["gen_tokens_per_s"] / one["gen_tokens_per_s"]}
    if (4, "shared") in by and (4, "per_adapter") in by:  # paired: step by step, same run
        pairs = zip(by[4, "shared"]["step_s_all"], by[4, "per_adapter"]["step_s_all"])
        out["step_k4_shared_over_per_adapter"] = statistics.median(s / p for s, p in pairs)
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", default="1,2,4,8", help="comma-separated K")
    p.add_argument("--total-rows", type=int, default=64, help="rows per step and per generation, for every K")
    p.add_argument("--steps", type=int, default=8, help="measured steps per case (after one more)")
    p.add_argument("--calls", type=int, default=8, help="measured generations per case (after one more)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (fewer where the rows need it)")
    p.add_argument("--tiny", action="store_true", help="hidden 32, intermediate 64, 2 layers, 2 heads (tests)")
    args = p.parse_args(argv)
    args.agents = [int(a) for a in args.agents.split(",")]
    widest = max(args.agents + ([PER_ADAPTER_K] if PER_ADAPTER_K in args.agents else []))
    args.samples = max(1, min(args.samples, args.total_rows // widest))
    for k in args.agents:
        if args.total_rows % (k * args.samples):
            p.error(f"--total-rows {args.total_rows} must be a multiple of {k} agents × {args.samples} samples")
    if min(args.steps, args.calls) < 1:
        p.error("--steps and --calls must be >= 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    lines = measure(args)
    print(f"K LoRA adapters, one base: {args.total_rows} rows a step for every K (rank {args.rank}, "
          f"{'tiny' if args.tiny else 'reference'} model); medians of {args.steps} steps, {args.calls} generations")
    print(f"{'agents':>6} {'layout':>12} {'trainer GiB':>12} {'rollout GiB':>12} {'gen tok/s':>10} {'step s':>8}")
    for x in lines:
        print(f"{x['agents']:>6} {x['layout']:>12} {x['trainer_peak_gib']:>12.4f} {x['rollout_peak_gib']:>12.4f} "
              f"{x['gen_tokens_per_s']:>10,.0f} {x['step_s']:>8.3f}")
    print("machine:", json.dumps(lines[0]["machine"]))
    for x in lines:
        print(json.dumps(x))
    r = ratios(lines)
    for name, value in r.items():
        op, bound = TARGETS[name]
        ok = value <= bound if op == "<=" else value >= bound
        print(f"{name} = {value:.3f} (target {op} {bound}): {'PASS' if ok else 'MISS'}")
    print(json.dumps({"ratios": r}))
    return lines


if __name__ == "__main__":
    main()
