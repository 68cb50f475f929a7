"""End to end: RLJob on a local Ray at the reference shape of docs/performance.md, on-policy and async.

Shape: Llama hidden 128, 4 layers, 4 heads (4 KV), intermediate 512, vocab 512, fp32, init N(0, 0.02);
8 prompts × 8 samples per step; GRPO (group std advantages, PPO clip 0.2) with a k3 KL to the frozen
reference at β = 0.04; AdamW lr 1e-4. Prompts: the `echo` env with 14 letters of a 26-letter alphabet and
the template `{s}=`, which the byte-level tokenizer encodes as BOS + 14 letters + `=` = 16 tokens; up to 32
new tokens at temperature 1.0 (a random-init model rarely emits EOS, so responses run to ~32 tokens).

Modes, run one after the other, each a fresh RLJob with its own local Ray (1 trainer, 1 rollout worker):
- `on_policy`: max_staleness 0 (generation of step s waits for weights s-1; training waits for it);
- `async`: max_staleness 1 (generation of step s+1 overlaps training on step s; weights swap between batches);
- `inflight`: `async` plus in-flight weight updates (`inflight.enabled`, swaps every 16 decode steps, KV kept):
  new weights are taken while a batch is being generated.

Shapes (`--shape`):
- `reference` (above): 32 new tokens, which a random-init model runs to the end;
- `long`: up to `--max_tokens` (256) new tokens whose lengths vary widely: the lesson stops at any of 8 digit
  characters, each about 1/512 likely per token under a near-uniform random-init model, so a response's
  length is roughly geometric with mean ~64 and a tail to the cap (the model's seq_len is 512). This is where
  a batch waits for its longest sequence, and where in-flight updates should help most.
- `roles`: two agents (the `two_roles` environment: `first` and `second` see the same 3-token prompt and
  each answers up to 32 tokens, graded on its first byte), 8 problems per batch, so 8 groups per agent;
  `--policies` says who trains them: `one` (both agents one shared model: one trainer, which trains 8
  of a batch's 16 groups per step), `l3` (a `full` model per agent: two trainers of 8 groups each) or
  `l2` (a LoRA adapter per agent, rank 8, on a copy of the base each: two trainers). Peak RSS is per
  process (the two trainers' are listed as trainer, trainer-2); `weight_bytes` is the bytes per
  published version of each trainer's weight stream.

Figures (median, min, max over trainer steps 3..--steps, 1-based):
- `step_s`: `train/step_s` of the trainer's history (wall time of one trainer step);
- `update_s`: `train/update_s` (policy update: forward, backward, AdamW; reference logprobs included);
- `wait_s`: `train/wait_s` (the trainer waiting for rollouts); `idle_fraction` = wait_s / step_s per step;
- `batch_s`, `publish_s`: `train/batch_s` (building the training batch) and `train/publish_s` (publishing weights);
  step_s ≈ wait_s + batch_s + update_s + publish_s. Reference logprobs are inside update_s (not split out here;
  bench/train_step.py measures them alone);
- `generation_s`, `gen_tokens_per_s`: the rollout worker's `rollout/generation_s` and `rollout/gen_tokens_per_s`
  per batch (its TensorBoard event file), over batches for weight steps 2..steps-1;
- `token_staleness`, `version_spread_max`: the trainer's `batch/token_staleness_mean` (trainer step minus the
  weight step of each trained token) and `batch/version_spread_max` (weight versions inside one rollout);
  `inflight_swaps`: the rollout worker's swaps over the run;
- `first_step_s`: from calling `RLJob.run()` (Ray start, actor start, model init, compiles) to the wall time of
  the trainer's first logged step;
- `peak_rss_mb`: VmHWM of the trainer actor and rollout actor processes (sampled from /proc every 0.2 s while
  they live), and the driver's ru_maxrss.

The JAX persistent compilation cache (.jax_cache) is used as the job configures it, so `first_step_s`
depends on whether earlier runs filled it. Prints a table, then one JSON line per mode.

    python bench/e2e.py [--steps 20] [--modes on_policy,async]
    python bench/e2e.py --shape long --modes async,inflight [--max_tokens 256]
    python bench/e2e.py --shape roles --modes async --policies one,l3,l2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402
import ray  # noqa: E402
from levanter.models.llama import LlamaConfig  # noqa: E402
from machine import machine  # noqa: E402  (bench/machine.py)

from marinrl.config.batching import BatchingConfig  # noqa: E402
from marinrl.config.curriculum import CurriculumConfig, LessonConfig  # noqa: E402
from marinrl.config.env import EnvConfig  # noqa: E402
from marinrl.config.inflight import InflightConfig  # noqa: E402
from marinrl.config.lora import LoraRLConfig  # noqa: E402
from marinrl.config.loss import LossConfig  # noqa: E402
from marinrl.config.model import ModelConfig  # noqa: E402
from marinrl.config.policies import PolicyConfig  # noqa: E402
from marinrl.config.trainer import RLAdamConfig  # noqa: E402
from marinrl.job.actors import actor_env  # noqa: E402
from marinrl.job.rl_job import RLJob, RLJobConfig  # noqa: E402
from marinrl.report.page import read_event_scalars, read_event_wall_times  # noqa: E402

MODES = {"on_policy": 0, "async": 1, "inflight": 1}
"""Each mode's max_staleness."""
SHAPES = ("reference", "long", "roles")
POLICIES = ("one", "l3", "l2")
"""The `roles` shape's policy layouts."""
LONG_STOPS = tuple("01234567")


def job_config(mode: str, steps: int, root: str, shape: str = "reference", max_tokens: int = 256,
               policies: str = "one") -> RLJobConfig:
    long = shape == "long"
    lesson = LessonConfig(lesson_id="echo14", env=EnvConfig("echo", {"alphabet_size": 26, "length": 14}),
                          max_tokens=max_tokens if long else 32, stop=LONG_STOPS if long else (), temperature=1.0,
                          graduate_at=None)
    policy_map = {}
    if shape == "roles":
        lesson = LessonConfig(lesson_id="roles", env=EnvConfig("two_roles", {"policies": {"second": "other"}}),
                              max_tokens=32, temperature=1.0, graduate_at=None)
        spec = {"one": "shared", "l3": "full", "l2": "lora"}[policies]
        lora = LoraRLConfig(rank=8, alpha=16.0) if spec == "lora" else None
        policy_map = {name: PolicyConfig(specialization=spec, lora=lora) for name in ("policy", "other")}
    llama = LlamaConfig(seq_len=512 if long else 64, hidden_dim=128, intermediate_dim=512, num_layers=4, num_heads=4,
                        num_kv_heads=4, gradient_checkpointing=False, tie_word_embeddings=False, scan_layers=False)
    batching = BatchingConfig(max_length=16 + max_tokens + 16, min_bucket=16) if long else BatchingConfig(
        max_length=64, min_bucket=16)
    return RLJobConfig(
        run_id=f"e2e-{shape}-{mode}" + (f"-{policies}" if shape == "roles" else ""), run_root=root,
        policies=policy_map,
        model=ModelConfig(model=llama, vocab_size=512, seed=0, init_std=0.02, dtype="float32"),
        curriculum=CurriculumConfig(lessons=(lesson,)), num_train_steps=steps, groups_per_step=8, n_generations=8,
        max_staleness=MODES[mode], loss=LossConfig.preset("grpo", kl_beta=0.04),
        optimizer=RLAdamConfig(learning_rate=1e-4), eval_every=10_000, eval_examples=8, batching=batching,
        inflight=InflightConfig(enabled=mode == "inflight", swap_every_tokens=16, kv="keep"))


class RssWatcher:
    """Peak resident memory (VmHWM) of the Ray actor processes under this driver, by role."""

    ROLES = {"TrainerActor": "trainer", "RolloutActor": "rollout"}

    def __init__(self, interval_s: float = 0.2):
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _hwm_mb(pid: int) -> float:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def _loop(self, interval_s: float) -> None:
        me = psutil.Process()
        names: dict[int, str] = {}  # pid -> role, numbered from the second process of a role on (trainer-2)
        while not self._stop.is_set():
            try:
                children = me.children(recursive=True)
            except psutil.Error:
                children = []
            for proc in children:
                try:
                    title = " ".join(proc.cmdline())
                    role = next((r for k, r in self.ROLES.items() if f"ray::{k}" in title), None)
                    if role:
                        if proc.pid not in names:
                            n = sum(1 for r in names.values() if r.split("-")[0] == role)
                            names[proc.pid] = role if n == 0 else f"{role}-{n + 1}"
                        role = names[proc.pid]
                        self.peaks[role] = max(self.peaks.get(role, 0.0), self._hwm_mb(proc.pid))
                except (psutil.Error, OSError):
                    continue
            self._stop.wait(interval_s)


def stats(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def _weight_bytes(log: pathlib.Path) -> float | None:
    """Median bytes per published version, from a trainer's JSON log lines."""
    sent = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if "json_logger: {" in line:
            metrics = json.loads(line.split("json_logger: ", 1)[1]).get("metrics", {})
            if "weights/bytes" in metrics:
                sent.append(metrics["weights/bytes"])
    return statistics.median(sent) if sent else None


def run_mode(mode: str, steps: int, root: str, shape: str = "reference", max_tokens: int = 256,
             policies: str = "one") -> dict:
    cfg = job_config(mode, steps, root, shape, max_tokens, policies)
    started = time.time()
    # The local Ray is started here, as RLJob would start it, but with address="local": a bare ray.init()
    # connects to any other Ray found running on the machine (e.g. a test session) instead of starting one.
    trainers = 2 if shape == "roles" and policies != "one" else 1
    ray.init(address="local", num_cpus=cfg.n_rollout_workers + trainers + 1, include_dashboard=False,
             namespace=f"marinrl-{cfg.run_id}", object_store_memory=512 * 1024 * 1024,
             runtime_env={"env_vars": actor_env()}, log_to_driver=False)
    try:
        with RssWatcher() as rss:
            result = RLJob(cfg).run()
    finally:
        ray.shutdown()
    run_dir = pathlib.Path(cfg.run_dir)
    history = [h for h in result.train["history"] if 3 <= h["step"] <= steps]
    first_dir = run_dir / "policies" / "policy" if result.policies else run_dir
    first_logged = read_event_wall_times(first_dir / "tensorboard" / "trainer", "train/step_s")
    logs = sorted((run_dir / "logs").glob("trainer*.log"))
    second = result.policies.get("other")
    second_history = [h for h in second["history"] if 3 <= h["step"] <= steps] if second else []
    worker = read_event_scalars(run_dir / "tensorboard" / "rollout-0")
    window = range(2, steps)  # batches generated with weights 2..steps-1 are those trained at steps 3..steps

    def worker_values(tag):
        return [v for s, v in worker.get(tag, {}).items() if s in window]

    peaks = {role: round(mb, 1) for role, mb in sorted(rss.peaks.items())}
    peaks["driver"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return {
        "mode": mode,
        "shape": shape,
        "policies": policies if shape == "roles" else None,
        "second_step_s": stats([h["train/step_s"] for h in second_history]) if second else None,
        "second_update_s": stats([h["train/update_s"] for h in second_history]) if second else None,
        "weight_bytes": {log.stem: _weight_bytes(log) for log in logs},
        "steps": result.train["final_step"],
        "step_s": stats([h["train/step_s"] for h in history]),
        "update_s": stats([h["train/update_s"] for h in history]),
        "wait_s": stats([h["train/wait_s"] for h in history]),
        "batch_s": stats([h.get("train/batch_s") for h in history]),
        "publish_s": stats([h.get("train/publish_s") for h in history]),
        "generation_s": stats(worker_values("rollout/generation_s")),
        "gen_tokens_per_s": stats(worker_values("rollout/gen_tokens_per_s")),
        "idle_fraction": stats([h["train/wait_s"] / h["train/step_s"] for h in history]),
        "token_staleness": stats([h.get("batch/token_staleness_mean") for h in history]),
        "version_spread_max": stats([h.get("batch/version_spread_max") for h in history]),
        "inflight_swaps": result.rollouts[0].get("inflight_swaps") if result.rollouts else None,
        "response_length": stats(worker_values("rollout/response_length_mean")),
        "first_step_s": round(min(first_logged.values()) - started, 2) if first_logged else None,
        "peak_rss_mb": peaks,
        "staleness_max": max((h["batch/staleness_max"] for h in result.train["history"]), default=None),
        "job_s": round(result.seconds, 1),
    }


def _fmt(s: dict | None) -> str:
    return "-" if s is None else f"{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="trainer steps per mode; medians over 3..steps")
    parser.add_argument("--modes", default="on_policy,async")
    parser.add_argument("--root", default=None, help="run root (default: a temporary directory)")
    parser.add_argument("--shape", default="reference", choices=SHAPES)
    parser.add_argument("--max_tokens", type=int, default=256, help="long shape: the cap on new tokens")
    parser.add_argument("--policies", default="one", help=f"roles shape: some of {','.join(POLICIES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; expected some of {sorted(MODES)}")
    layouts = args.policies.split(",") if args.shape == "roles" else ["one"]
    for p in layouts:
        if p not in POLICIES:
            raise SystemExit(f"unknown --policies {p!r}; expected some of {list(POLICIES)}")
    results = []
    before = machine()
    with tempfile.TemporaryDirectory(prefix="marinrl-e2e-") as tmp:
        for mode in modes:
            for layout in layouts:
                results.append(run_mode(mode, args.steps, args.root or tmp, args.shape, args.max_tokens, layout))
    print(f"\nmachine: {json.dumps(before)}; load average at the end: {os.getloadavg()[0]:.2f}")
    print(f"RLJob at the {args.shape} shape, {args.steps} steps per mode; median [min, max] over steps 3..{args.steps}")
    for r in results:
        layout = f" policies={r['policies']}" if r["policies"] else ""
        print(f"\n{r['mode']}{layout} ({r['steps']} steps, job {r['job_s']} s, "
              f"max staleness trained {r['staleness_max']})")
        for key in ("step_s", "update_s", "wait_s", "batch_s", "publish_s", "generation_s", "gen_tokens_per_s",
                    "idle_fraction", "token_staleness", "version_spread_max", "response_length"):
            print(f"  {key:18s} {_fmt(r[key])}")
        print(f"  {'inflight_swaps':18s} {r['inflight_swaps']}")
        print(f"  {'first_step_s':18s} {r['first_step_s']}")
        print(f"  {'peak_rss_mb':18s} {r['peak_rss_mb']}")
        if r["policies"]:
            print(f"  {'second_step_s':18s} {_fmt(r['second_step_s'])}")
            print(f"  {'second_update_s':18s} {_fmt(r['second_update_s'])}")
            print(f"  {'weight_bytes':18s} {r['weight_bytes']}")
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
