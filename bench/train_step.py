"""Train step: seconds for the policy update and for the reference logprobs, through Levanter's Trainer.

The reference shape of docs/performance.md: Llama hidden 128, 4 layers, 4 heads (4 KV), intermediate
512, vocab 512, untied head, fp32, init N(0, 0.02); 64 sequences = 8 prompts × 8 samples of 16 prompt
tokens + up to 32 response tokens; AdamW lr 1e-4 constant, betas (0.9, 0.999), no weight decay, clip 1.0;
the `grpo` loss (PPO clip 0.2) with a k3 KL to a frozen reference at β = 0.04 (mode `kl_0.04`) and
without one (mode `kl_0`: no reference model exists, so its logprobs cost nothing).

Every step goes through the same calls as `TrainWorker.run` (marinrl/train/worker.py):
`cpu_trainer_config`, `Trainer(config, optimizer, partial(_step_loss, config=loss), add_default_hooks=False)`,
`trainer.initial_state(key, model_init=...)`, a batch from `make_training_batch` sharded with the compute
axis mapping, the reference's `token_logprobs` under `hax.named_jit`, then
`trainer.train_step(state, StepInput(batch, reference_logprobs))`.

- `update_s`: `trainer.train_step` (forward, backward, AdamW, the loss metrics going to the tracker).
- `ref_logprobs_s`: the frozen reference's `token_logprobs` on the batch, until ready.
- `first_step_s`: from building the mode's Trainer (model init, initial state, reference model) to the
  end of its first train step, both compiles included.
- `update_cpu_s`, `ref_logprobs_cpu_s`: process CPU seconds (all threads) of the same calls. The machine
  is shared: wall time depends on what else runs, CPU time much less.

Synthetic rollouts, fixed seed, one fresh batch per step: uniform random tokens (a random-init model
samples almost uniformly), responses of 32 tokens unless a stop token (id 1, probability 1/512 per
token) ends them early, sampler logprobs near log(1/512) with the spread of the random model's own
(std 0.25), 0/1 rewards with group mean/std advantages. All modes run interleaved, step by step, so
that they can be compared pairwise; medians with min and max over steps 3..--steps (1-based). Then one
JSON line per mode (docs/performance.md).

A mode is `kl_<beta>` plus optional variants joined by `+`, so layouts can be compared in one run. The
defaults are what marinrl ships: the `shared` row layout (batching.py), the geometric bucket ladder and
unrolled layers (`scan_layers=False`, as `model_config.reference_llama`). Variants: `padded`, `packed`, `shared`
(BatchingConfig.layout: one rollout per row as before packing, rollouts packed into rows, and each group's
prompt computed once), `bucket<N>` (BatchingConfig(min_bucket=N)), `bf16` (`trainer.mp: p=f32,c=bfloat16`: float32
master weights and AdamW state, bfloat16 matmuls; XLA:CPU uses AVX-512 BF16 where the CPU has it) and `scanned`
(LlamaConfig scan_layers=True, Levanter's default) and `levanter_dots` (the projections' dots as Levanter writes
them, 3-D: what ran before marinrl/train/flat_dots.py merged the token axes on the CPU). The first mode is the
reference of the paired ratios. For example:

    python bench/train_step.py                                   # kl_0.04,kl_0 as the TrainWorker runs them
    python bench/train_step.py --modes kl_0.04+levanter_dots,kl_0.04,kl_0.04+bf16   # the update's levers
    python bench/train_step.py --modes kl_0.04+padded,kl_0.04+packed,kl_0.04+shared
    python bench/train_step.py --shape realistic --steps 6 --modes kl_0.04+padded,kl_0.04+packed,kl_0.04+shared

`--shape realistic` is issue 11's: 16 prompts × 8 samples, prompts uniform in 32–256 tokens, responses
log-normal around a median of 64 tokens, clipped to 8–512 (rows up to 768 tokens). Per mode the run
also reports trained (non-pad, loss-mask) tokens per second of update, the padding fraction (positions
holding no token) and the row shape.

`--shape vocab150k` is issue 31's large vocabulary: Qwen3's 151,936 columns on the reference model's small body, 1
prompt × 8 samples of 128 prompt + 384 response tokens, one rollout per row (`padded`), 8 rows × 512 positions
without microbatches: the LM head's logits (4,096 tokens × 151,936 × 4 bytes = 2.3 GiB per float32 array) dominate
the step (16 rows would take the `full` mode past what a 24 GiB machine can spare). Its modes are `kl_0+blockwise`
(the default: logprobs and entropy over 32k-column blocks, `policy_forward.lm_head_block`) and `kl_0+full`
(`cross_entropy_block_size` = the vocabulary: one block); the `bf16` variant applies as elsewhere. Each mode runs
in a process of its own (`--processes`, the default at this shape) so that its peak is its own: `peak_gib` is the
process's peak RSS (`ru_maxrss`; on an accelerator `memory_stats()['peak_bytes_in_use']`) less its RSS before the
mode's model was built, as bench/rehearsal.py measures, and `predicted_peak_gib` is the dry run's
(`predicted_memory(job, "trainer", 1, cpu=True)`) for the same model, rows, row length and precision; the line also
carries the prediction's components. `runtime_gib` is what the process keeps after its first step beyond the
trainer state (parameters and AdamW moments), to compare with the dry run's `cpu_runtime`.
Timings across processes are not paired: the summary gives the ratio of the modes' medians.

    python bench/train_step.py --shape vocab150k --steps 4           # kl_0+blockwise, kl_0+full

`--devices N` runs on N fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, as the test
harness does with 4); the default is one device, what a TrainWorker on this machine has. Other XLA flags
pass through the XLA_FLAGS environment variable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per mode; medians over steps 3..steps")
    parser.add_argument("--modes", default=None,
                        help="comma-separated kl_<beta>[+bucket<N>][+scanned][+bf16][+full], e.g. kl_0.04,kl_0.04+bf16 "
                             "(default: kl_0.04,kl_0; kl_0+blockwise,kl_0+full at --shape vocab150k)")
    parser.add_argument("--devices", type=int, default=1, help="fake CPU devices (data-parallel mesh)")
    parser.add_argument("--attn-backend", default="default", choices=["default", "vanilla", "jax_flash"],
                        help="LlamaConfig.attn_backend (default: Levanter's choice for the platform, jax_flash on CPU)")
    parser.add_argument("--shape", default="reference", choices=["reference", "realistic", "quickstart", "vocab150k"])
    parser.add_argument("--processes", action=argparse.BooleanOptionalAction, default=None,
                        help="each mode in a process of its own, its peak its own (default: only at --shape vocab150k)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.modes is None:
        args.modes = "kl_0+blockwise,kl_0+full" if args.shape == "vocab150k" else "kl_0.04,kl_0"
    if args.processes is None:
        args.processes = args.shape == "vocab150k"
    if args.steps < 3:
        parser.error("--steps must be >= 3 (medians are over steps 3..steps)")
    return args


ARGS = _parse_args() if __name__ == "__main__" else None
# Must happen before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if ARGS is not None and ARGS.devices > 1:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
    ).strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import resource  # noqa: E402
import uuid  # noqa: E402

import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jmp  # noqa: E402
import levanter  # noqa: E402
import numpy as np  # noqa: E402
from levanter.checkpoint import CheckpointerConfig  # noqa: E402
from levanter.layers.attention import AttentionBackend  # noqa: E402
from levanter.models.llama import LlamaConfig  # noqa: E402
from levanter.tracker.json_logger import JsonLoggerConfig  # noqa: E402
from levanter.trainer import Trainer  # noqa: E402
from machine import machine  # noqa: E402

from marinrl.config.batching import BatchingConfig  # noqa: E402
from marinrl.config.loss import LossConfig  # noqa: E402
from marinrl.config.model import ModelConfig  # noqa: E402
from marinrl.config.trainer import RLAdamConfig  # noqa: E402
from marinrl.levanter_configs import cpu_trainer_config, to_levanter  # noqa: E402
from marinrl.models.policy_model import build_model  # noqa: E402
from marinrl.train.advantages import group_advantages  # noqa: E402
from marinrl.train.batching import (  # noqa: E402
    TrainingBatch,
    make_training_batch,
    row_alignment,  # noqa: E402
)
from marinrl.train.flat_dots import levanter_dots  # noqa: E402
from marinrl.train.losses import describe, token_logprobs  # noqa: E402
from marinrl.train.worker import StepInput, _step_loss  # noqa: E402
from marinrl.types import Rollout, RolloutMetadata  # noqa: E402

PROMPTS, SAMPLES, PROMPT_TOKENS, RESPONSE_TOKENS, VOCAB = 8, 8, 16, 32, 512
STOP_TOKEN = 1
FIRST_MEASURED = 3  # 1-based: steps 1 and 2 are warm-up


def reference_model_config(*, seed: int = 0, attn_backend: str = "default", scan_layers: bool = False,
                           seq_len: int = 256, vocab: int = VOCAB) -> ModelConfig:
    """The reference model of docs/performance.md as a `ModelConfig` (what a TrainWorker builds); `seq_len` 768 for the
    realistic shape's longest rollouts."""
    backend = None if attn_backend == "default" else AttentionBackend(attn_backend)
    llama = LlamaConfig(seq_len=seq_len, hidden_dim=128, intermediate_dim=512, num_layers=4, num_heads=4,
                        num_kv_heads=4, tie_word_embeddings=False, gradient_checkpointing=False, attn_backend=backend,
                        scan_layers=scan_layers)
    return ModelConfig(model=llama, vocab_size=vocab, seed=seed, init_std=0.02, dtype="float32")


SHAPES = {  # prompts, samples, rows' max_length, min_bucket
    "reference": (PROMPTS, SAMPLES, 256, 16),
    "realistic": (16, 8, 768, 32),
    "quickstart": (32, 16, 64, 8),  # the quickstart's batches: 5-token prompts, one-token responses
    "vocab150k": (1, 8, 512, 512),  # 128-token prompts, 384-token responses: one 512-token row per rollout
}
SHAPE_VOCAB = {"vocab150k": 151_936}
"""The vocabulary of a shape where it is not the reference's 512 (Qwen3's at vocab150k)."""
FIXED_LENGTHS = {"reference": (PROMPT_TOKENS, RESPONSE_TOKENS), "quickstart": (5, 1), "vocab150k": (128, 384)}
"""(prompt, response budget) tokens of the shapes whose lengths are fixed; realistic's are drawn."""


def synthetic_rollouts(rng: np.random.Generator, step: int,
                       shape: str = "reference") -> tuple[list[Rollout], np.ndarray]:
    """One step's groups (8 × 8 at the reference shape, 16 × 8 at the realistic one) and their group
    mean/std advantages."""
    prompts, samples = SHAPES[shape][:2]
    vocab = SHAPE_VOCAB.get(shape, VOCAB)
    fixed = FIXED_LENGTHS.get(shape)
    rollouts, advantages = [], []
    for _ in range(prompts):
        prompt_tokens = fixed[0] if fixed else int(rng.integers(32, 257))
        prompt = rng.integers(2, vocab, prompt_tokens)
        rewards = rng.integers(0, 2, samples).astype(np.float64)
        group_id = uuid.UUID(int=int(rng.integers(0, 2**62))).hex
        for reward in rewards:
            budget = fixed[1] if fixed else int(np.clip(round(math.exp(rng.normal(math.log(64), 0.9))), 8, 512))
            tokens = rng.integers(2, vocab, budget)
            stops = np.flatnonzero(rng.random(budget) < 1.0 / VOCAB) if shape == "reference" else np.array([])
            n = budget if stops.size == 0 else int(stops[0]) + 1
            tokens = tokens[:n]
            if n < RESPONSE_TOKENS and shape == "reference":
                tokens[-1] = STOP_TOKEN
            logprobs = np.minimum(-math.log(vocab) + 0.25 * rng.standard_normal(n), 0.0).astype(np.float32)
            rollouts.append(Rollout(
                prompt_tokens=prompt, response_tokens=tokens, response_logprobs=logprobs,
                temperature=1.0, loss_mask=np.ones(n, dtype=bool),
                token_rewards=np.where(np.arange(n) == n - 1, reward, 0.0).astype(np.float32),
                episode_reward=float(reward), finish_reason="stop" if n < budget else "length",
                env_name="bench", lesson_id="bench", group_id=group_id,
                metadata=RolloutMetadata("bench", step, 1_700_000_000.0)))
        advantages.extend(group_advantages(rewards, "group_std"))
    return rollouts, np.asarray(advantages)


def current_rss_bytes() -> float:
    """This process's resident set now (Linux /proc; elsewhere the peak so far, an upper bound)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:
        return peak_bytes()


def peak_bytes() -> float:
    """The process's peak: `memory_stats()['peak_bytes_in_use']` on an accelerator, else the peak RSS."""
    if jax.default_backend() != "cpu":
        return float((jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", float("nan")))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024))


def mode_job(mode: Mode, batch_size: int, prompts: int):
    """The job a TrainWorker running `mode` would have, for the dry run: the Qwen3-0.6B recipe with the mode's
    model, rows (no microbatches), layout, precision and loss, on this process's devices."""
    import runpy

    from marinrl.recipe import parse_recipe

    recipe = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "experiments" /
                                "grpo_math_qwen3_0p6b.py"), run_name="recipe")["RECIPE"]
    job = parse_recipe(recipe, ["--model.hf_checkpoint=null", "--trainer.per_device_parallelism=-1",
                                f"--groups_per_step={prompts}", f"--n_generations={batch_size // prompts}"])
    return dataclasses.replace(job, model=mode.model, batching=mode.batching, loss=mode.loss,
                               trainer=dataclasses.replace(job.trainer, mp=mode.mp))


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class _Timer:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


@dataclasses.dataclass
class Mode:
    """One loss configuration and layout, with its own Trainer, state and (when β ≠ 0) frozen reference."""

    name: str
    loss: LossConfig
    model: ModelConfig
    batching: BatchingConfig
    mp: str = "f32"
    """The precision policy (`bf16` variant: p=f32,c=bfloat16: float32 masters, bfloat16 compute)."""
    levanter_dots: bool = False
    """`levanter_dots` variant: the projections' dots as Levanter writes them (3-D, before flat_dots.py)."""
    logits: str = "blockwise"
    """`full` variant: `cross_entropy_block_size` = the vocabulary (one block); `blockwise`: marinrl's default."""
    trainer: Trainer | None = None
    rss_before_model: float = float("nan")  # bytes, when setup began
    rss_after_setup: float = float("nan")  # bytes: model, trainer state (and reference) built
    rss_after_first_step: float = float("nan")  # bytes: the first step compiled and run
    state: object = None
    reference: object = None
    ref_fn: object = None
    batches: list = dataclasses.field(default_factory=list)
    update: list = dataclasses.field(default_factory=list)  # (wall, cpu) per measured step
    ref: list = dataclasses.field(default_factory=list)
    first_step_s: float = float("nan")
    first_breakdown: dict = dataclasses.field(default_factory=dict)
    trained: list = dataclasses.field(default_factory=list)  # loss-mask tokens per step
    padding: list = dataclasses.field(default_factory=list)  # positions holding no token / positions, per step

    @classmethod
    def parse(cls, spec: str, args) -> Mode:
        head, *variants = spec.split("+")
        if not head.startswith("kl_"):
            raise SystemExit(f"unknown mode {spec!r}: expected kl_<beta>[+bucket<N>][+scanned], e.g. kl_0.04")
        _, _, max_length, min_bucket = SHAPES[args.shape]
        batching, scan_layers, mp = BatchingConfig(max_length=max_length, min_bucket=min_bucket), False, "f32"
        if args.shape == "vocab150k":  # one rollout per row: rows × length as the dry run counts them
            batching = dataclasses.replace(batching, layout="padded")
        levanter_dots, logits = False, "blockwise"
        for v in variants:
            if v.startswith("bucket") and v[6:].isdigit():
                batching = dataclasses.replace(batching, min_bucket=int(v[6:]))
            elif v in ("padded", "packed", "shared"):
                batching = dataclasses.replace(batching, layout=v)
            elif v == "scanned":
                scan_layers = True
            elif v == "bf16":
                mp = "p=f32,c=bfloat16"
            elif v == "levanter_dots":
                levanter_dots = True
            elif v in ("blockwise", "full"):
                logits = v
            else:
                raise SystemExit(f"unknown variant {v!r} in mode {spec!r}: expected padded, packed, shared, "
                                 "bucket<N>, scanned, bf16, levanter_dots, blockwise or full")
        vocab = SHAPE_VOCAB.get(args.shape, VOCAB)
        model = reference_model_config(seed=args.seed, attn_backend=args.attn_backend, scan_layers=scan_layers,
                                       seq_len=max(256, max_length), vocab=vocab)
        if logits == "full":
            model = dataclasses.replace(model, model=dataclasses.replace(model.model, cross_entropy_block_size=vocab))
        if args.shape == "quickstart":  # experiments/quickstart.yaml's model
            llama = dataclasses.replace(model.model, seq_len=64, hidden_dim=64, intermediate_dim=256, num_layers=2)
            model = dataclasses.replace(model, model=llama, init_std=None)
        batching = batching.for_model(model.model.hidden_dim)  # as the worker does
        return cls(spec, LossConfig.preset("grpo", kl_beta=float(head[3:])), model, batching, mp, levanter_dots,
                   logits)

    def setup(self, trainer_cfg, optimizer) -> None:
        """What `TrainWorker.run` does before its loop (minus the replay buffer and the weight server)."""
        self.rss_before_model = current_rss_bytes()
        trainer_cfg = dataclasses.replace(trainer_cfg, mp=jmp.get_policy(self.mp))
        self.trainer = Trainer(trainer_cfg, optimizer, functools.partial(_step_loss, config=self.loss),
                               add_default_hooks=False)
        self.trainer.__enter__()
        def model_init():
            model = build_model(self.model)
            return levanter_dots(model) if self.levanter_dots else model

        self.state = self.trainer.initial_state(jax.random.PRNGKey(trainer_cfg.seed), model_init=model_init)
        self.reference = model_init() if self.loss.uses_reference else None
        self.ref_fn = hax.named_jit(token_logprobs, axis_resources=self.trainer.compute_axis_mapping)

    def step(self, batch: TrainingBatch) -> tuple[_Timer, _Timer, float]:
        """One worker step on `batch`: (reference timer, update timer, loss)."""
        batch = hax.shard(batch, self.trainer.compute_axis_mapping)
        with _Timer() as ref_t:
            ref = self.ref_fn(self.reference, batch) if self.reference is not None else None
            if ref is not None:
                ref.array.block_until_ready()
        with _Timer() as update_t:
            info = self.trainer.train_step(self.state, StepInput(batch, ref))
            jax.block_until_ready(info.state.model)
        self.state = info.state
        if not math.isfinite(info.loss):
            raise RuntimeError(f"{self.name}: loss {info.loss} at step {int(info.step) + 1}")
        return ref_t, update_t, float(info.loss)

    def memory(self, batch_size: int, prompts: int, prompt_tokens: int, response_tokens: int) -> dict:
        """The measured peak against the dry run's for this mode (call in a process of its own)."""
        from marinrl.dry_run import predicted_memory

        plan = predicted_memory(mode_job(self, batch_size, prompts), "trainer", jax.device_count(),
                                prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                                cpu=jax.default_backend() == "cpu")
        peak = peak_bytes()
        cpu = jax.default_backend() == "cpu"
        measured = peak - self.rss_before_model if cpu else peak
        gib = float(1 << 30)
        b = plan.bytes_per_device
        # what the process keeps after its first step beyond the trainer state, beside the dry run's `cpu_runtime`
        runtime = self.rss_after_first_step - self.rss_before_model - b["parameters"] - b["optimizer_state"]
        return {"logits": self.logits, "mp": self.mp,
                "peak_gib": round(measured / gib, 3), "predicted_peak_gib": round(plan.peak_bytes_per_device / gib, 3),
                "peak_ratio": round(measured / plan.peak_bytes_per_device, 3),
                "runtime_gib": round(runtime / gib, 3) if cpu else None,
                "peak_rss_gib": round(peak / gib, 3) if cpu else None,
                "rss_before_model_gib": round(self.rss_before_model / gib, 3) if cpu else None,
                "rss_after_setup_gib": round(self.rss_after_setup / gib, 3) if cpu else None,
                "rss_after_first_step_gib": round(self.rss_after_first_step / gib, 3) if cpu else None,
                "predicted_gib": {k: round(v / gib, 3) for k, v in plan.bytes_per_device.items()}}

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.__exit__(None, None, None)

    def result(self) -> dict:
        def timed(pairs, i):
            return stats([p[i] for p in pairs])

        return {"mode": self.name, "update_s": timed(self.update, 0), "ref_logprobs_s": timed(self.ref, 0),
                "first_step_s": stats([self.first_step_s]),
                "step_s": stats([u[0] + r[0] for u, r in zip(self.update, self.ref)]),
                "update_cpu_s": timed(self.update, 1), "ref_logprobs_cpu_s": timed(self.ref, 1),
                "trained_tokens_per_s": stats([t / u[0]
                                               for t, u in zip(self.trained[FIRST_MEASURED - 1:], self.update)]),
                "padding_fraction": float(np.mean(self.padding)),
                "rows": sorted({b.Batch.size for b in self.batches}),
                "positions": sorted({b.Pos.size for b in self.batches}),
                "devices": jax.device_count()}


def _summary(mode: Mode, r: dict) -> str:
    def timed(key: str, cpu_key: str) -> str:
        t = r[key]
        return f"{t['median']:.4f} s (min {t['min']:.4f}, max {t['max']:.4f}; cpu {r[cpu_key]['median']:.4f})"

    b = mode.first_breakdown
    ref = (f"reference logprobs {timed('ref_logprobs_s', 'ref_logprobs_cpu_s')}" if mode.reference is not None
           else "no reference model (beta 0)")
    return (f"update {timed('update_s', 'update_cpu_s')}; {ref}; first step {mode.first_step_s:.2f} s "
            f"(setup {b['setup']:.2f}, reference {b['reference']:.2f}, update {b['update']:.2f})")


def run_in_processes(args) -> None:
    """Each mode in a child process of its own (this script with `--modes <mode> --no-processes`), one after
    the other: their output as it comes, then the ratios of their medians and peaks, then their JSON lines."""
    import subprocess

    results = []
    for spec in [m for m in args.modes.split(",") if m]:
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--steps", str(args.steps), "--modes", spec,
               "--devices", str(args.devices), "--attn-backend", args.attn_backend, "--shape", args.shape,
               "--seed", str(args.seed), "--no-processes"]
        print(f"[{spec}] in a process of its own: {' '.join(cmd[1:])}", flush=True)
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        for line in child.stdout:
            if line.startswith("{"):
                results.append(json.loads(line))
            else:
                print(line, end="", flush=True)
        if child.wait():
            raise SystemExit(f"[{spec}] exited with {child.returncode}")
    first = results[0]
    for r in results[1:]:
        line = (f"update {r['mode']} / {first['mode']}: ratio of medians "
                f"{r['update_s']['median'] / first['update_s']['median']:.3f} (separate processes: not paired)")
        if "peak_gib" in r and "peak_gib" in first:
            line += f"; peak {r['peak_gib'] / first['peak_gib']:.2f}×"
        print(line)
    for r in results:
        print(json.dumps(r))


def main(args) -> None:
    if args.processes and len([m for m in args.modes.split(",") if m]) > 1:
        return run_in_processes(args)
    work = pathlib.Path(tempfile.mkdtemp(prefix="marinrl-bench-train-step-"))
    prompts, samples = SHAPES[args.shape][:2]
    batch_size = prompts * samples
    trainer_cfg = cpu_trainer_config(
        num_train_steps=args.steps + 1, train_batch_size=batch_size, log_dir=work / "logs",
        checkpointer=CheckpointerConfig(base_path=str(work / "checkpoints")), id=f"bench-{uuid.uuid4().hex[:8]}",
        # The worker's tracker, quieter: metrics are still fetched and serialized each step, not printed.
        tracker=JsonLoggerConfig(level=logging.WARNING))
    levanter.initialize(trainer_cfg)
    optimizer = to_levanter(RLAdamConfig()).build(trainer_cfg.num_train_steps)
    modes = [Mode.parse(m, args) for m in args.modes.split(",") if m]

    rng = np.random.default_rng(args.seed)
    steps = [synthetic_rollouts(rng, step, args.shape) for step in range(args.steps)]
    for mode in modes:
        mode.batches = [make_training_batch(r, a, batch_size=batch_size, config=mode.batching,
                                            **row_alignment(trainer_cfg)) for r, a in steps]
        mode.trained = [float(np.asarray(b.loss_mask.array).sum()) for b in mode.batches]
        mode.padding = [float((np.asarray(b.segment_ids.array) < 0).mean()) for b in mode.batches]
    trained = float(np.mean(modes[0].trained))
    longest = max(r.num_tokens for rollouts, _ in steps for r in rollouts)

    load_start = os.getloadavg()[0]
    print(f"train step at the {args.shape} shape on {jax.device_count()} {jax.default_backend()} device(s): "
          f"{batch_size} rollouts of up to {longest} tokens, {trained:.0f} trained tokens per step; "
          f"attention {args.attn_backend}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
          f"load average {load_start:.1f} on {os.cpu_count()} CPUs")
    try:
        # First steps one mode after the other (compiles), then the other steps interleaved, alternating order.
        for mode in modes:
            print(f"[{mode.name}] {describe(mode.loss)}; rows × positions {mode.batches[0].Batch.size} × "
                  f"{mode.batches[0].Pos.size} (first batch); "
                  f"scan_layers={mode.model.model.scan_layers}")
            with _Timer() as setup_t:
                mode.setup(trainer_cfg, optimizer)
            mode.rss_after_setup = current_rss_bytes()
            ref_t, update_t, _ = mode.step(mode.batches[0])
            mode.rss_after_first_step = current_rss_bytes()
            mode.first_step_s = setup_t.wall + ref_t.wall + update_t.wall
            mode.first_breakdown = {"setup": setup_t.wall, "reference": ref_t.wall, "update": update_t.wall}
        for step in range(1, args.steps):
            for mode in modes if step % 2 else reversed(modes):
                ref_t, update_t, _ = mode.step(mode.batches[step])
                if step + 1 >= FIRST_MEASURED:
                    mode.ref.append((ref_t.wall, ref_t.cpu))
                    mode.update.append((update_t.wall, update_t.cpu))
    finally:
        for mode in reversed(modes):
            mode.close()

    load = [load_start, os.getloadavg()[0]]
    results = [{**mode.result(), "load_avg": load} for mode in modes]
    if len(modes) == 1 and args.shape in FIXED_LENGTHS:  # a process of its own: its peak is the mode's
        results[0].update(modes[0].memory(batch_size, prompts, *FIXED_LENGTHS[args.shape]))
        results[0]["machine"] = machine()
    for mode, r in zip(modes, results):
        print(f"[{mode.name}] {_summary(mode, r)}; steps {FIRST_MEASURED}-{args.steps}")
    for mode, r in zip(modes, results):
        print(f"[{mode.name}] trained tokens/s {r['trained_tokens_per_s']['median']:.0f}; padding fraction "
              f"{r['padding_fraction']:.3f}; rows {r['rows']}, positions {r['positions']}")
    for mode in modes[1:]:
        ratio = statistics.median([a[0] / b[0] for a, b in zip(mode.update, modes[0].update)])
        line = f"update {mode.name} / {modes[0].name}: median paired ratio {ratio:.3f}"
        if mode.reference is not None and modes[0].reference is not None:
            ref_ratio = statistics.median([a[0] / b[0] for a, b in zip(mode.ref, modes[0].ref)])
            line += f"; reference logprobs {ref_ratio:.3f}"
        print(line)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB (all modes in one process); "
          f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
          "(wall times scale with it, CPU times much less)")
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main(ARGS)
    sys.stdout.flush()
