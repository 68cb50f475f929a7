"""The CPU quickstart: a real RL run that visibly learns in a few minutes on a laptop.

A tiny random-init Llama (2 layers, hidden 64, byte-level vocabulary of 512) learns the `echo` task
(prompt `c=`, answer `c`, 10 letters) with GRPO: one local Ray, one rollout worker and the trainer,
asynchronous (max_staleness 1), rollouts as Parquet files under runs/<run_id>/, JSON and
TensorBoard tracking. Greedy eval reward goes from ~0 to >= 0.8 (measured: 0.9-1.0 by step 40-60 in
most runs, 0.64 at step 100 in the slowest seen). The task has only 10 distinct prompts, so eval
prompts are freshly drawn but not disjoint from training ones.

    python experiments/quickstart.py [--run_id NAME] [--num_train_steps N] [--max_staleness 0] ...
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

import draccus
from levanter.models.llama import LlamaConfig

from marinrl.curriculum import CurriculumConfig, LessonConfig
from marinrl.envs.base import EnvConfig
from marinrl.job import RLJobConfig, RLJob, JobResult
from marinrl.models import ModelConfig
from marinrl.train.batching import BatchingConfig
from marinrl.train.losses import LossConfig


@dataclasses.dataclass
class QuickstartConfig:
    run_id: str = dataclasses.field(default_factory=lambda: time.strftime("quickstart-%Y%m%d-%H%M%S"))
    run_root: str = "runs"
    num_train_steps: int = 200
    max_staleness: int = 1
    """0: exact on-policy; 1 (default): generation overlaps training."""
    learning_rate: float = 1e-3
    groups_per_step: int = 32
    n_generations: int = 16
    eval_every: int = 10
    seed: int = 0
    target_eval_reward: float = 0.8
    """The run fails (exit 1) if the final greedy eval reward is below this."""

    def job(self) -> RLJobConfig:
        echo = LessonConfig(lesson_id="echo", env=EnvConfig("echo", {"alphabet_size": 10, "length": 1}),
                            max_tokens=1, graduate_at=None)
        return RLJobConfig(
            run_id=self.run_id, run_root=self.run_root,
            model=ModelConfig(model=LlamaConfig(seq_len=64, hidden_dim=64, intermediate_dim=256, num_layers=2,
                                                num_heads=4, num_kv_heads=4, gradient_checkpointing=False,
                                                scan_layers=False),
                              vocab_size=512, seed=self.seed),
            curriculum=CurriculumConfig(lessons=(echo,)),
            num_train_steps=self.num_train_steps, groups_per_step=self.groups_per_step,
            n_generations=self.n_generations, max_staleness=self.max_staleness, loss=LossConfig.preset("grpo"),
            learning_rate=self.learning_rate, eval_every=self.eval_every, eval_examples=64, seed=self.seed,
            batching=BatchingConfig(max_length=64, min_bucket=8))  # prompt + answer fit in 8 positions


def eval_curve(result: JobResult, lesson: str = "echo") -> list[tuple[int, float]]:
    evals = result.rollouts[0].get("evals", [])
    return [(e["weight_step"], e["metrics"][f"eval/{lesson}/reward_mean"]) for e in evals
            if f"eval/{lesson}/reward_mean" in e["metrics"]]


def plot(result: JobResult, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = result.train["history"]
    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(steps, [h.get("batch/reward_mean", float("nan")) for h in history], label="train reward (sampled)")
    curve = eval_curve(result)
    ax1.plot([s for s, _ in curve], [r for _, r in curve], "o-", label="eval reward (greedy)")
    ax1.set_ylabel("reward")
    ax1.set_ylim(-0.05, 1.05)
    ax1.legend(loc="lower right")
    ax2.plot(steps, [h.get("batch/staleness_mean", float("nan")) for h in history], label="mean staleness")
    ax2.plot(steps, [h.get("batch/staleness_max", float("nan")) for h in history], "--", label="max staleness")
    ax2.set_xlabel("trainer step")
    ax2.set_ylabel("weight versions")
    ax2.legend(loc="upper right")
    fig.suptitle(f"marinrl quickstart: {result.train['final_step']} steps in {result.seconds:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(config: QuickstartConfig) -> int:
    job = config.job()
    print(f"[marinrl] quickstart {config.run_id}: writing to {job.run_dir}", flush=True)
    result = RLJob(job).run()
    run_dir = pathlib.Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    curve = eval_curve(result)
    history = result.train["history"]
    steady = sorted(h["train/step_s"] for h in history[3:]) or [float("nan")]
    summary = {
        "run_dir": str(run_dir), "seconds": round(result.seconds, 1), "steps": result.train["final_step"],
        "eval_reward_start": curve[0][1] if curve else None, "eval_reward_end": curve[-1][1] if curve else None,
        "eval_curve": curve, "median_step_s": steady[len(steady) // 2],
        "rollouts_written": sum(r.get("rollouts_written", 0) for r in result.rollouts),
        "rollout_worker_restarts": result.rollout_restarts,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(result, run_dir / "reward.png")
    print(f"\n[marinrl] {summary['steps']} steps in {summary['seconds']} s "
          f"(median {summary['median_step_s']:.2f} s/step), {summary['rollouts_written']} rollouts")
    print("[marinrl] eval reward (greedy, fresh prompts each eval): "
          + "  ".join(f"step {s}: {r:.2f}" for s, r in curve))
    print(f"[marinrl] plot: {run_dir / 'reward.png'}   summary: {run_dir / 'summary.json'}")
    end = summary["eval_reward_end"]
    if end is None or end < config.target_eval_reward:
        print(f"[marinrl] did not reach eval reward {config.target_eval_reward} (got {end})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(draccus.parse(QuickstartConfig)))
