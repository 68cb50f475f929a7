"""The CPU quickstart: a real RL run that visibly learns in a few minutes on a laptop.

A tiny random-init Llama (2 layers, hidden 64, byte-level vocabulary of 512) learns the `echo` task
with GRPO (and a KL to its initial weights, which keeps every letter sampled): prompt `37c=` answers
`c` (10 letters, two distractor digits). One local Ray, one rollout worker and the trainer, asynchronous
(max_staleness 1), rollouts as Parquet files under runs/<run_id>/, JSON and TensorBoard tracking. Greedy eval reward is
measured on held-out prompts: a fifth of the 1,000 prompts are never drawn for training
(`holdout: 0.2`), so the eval measures the rule the model learned, not prompts it memorized.

The job is experiments/quickstart.yaml (the same file `marinrl train` runs, with the same `--key value`
overrides); this script adds a fresh run id, a summary, a plot and a pass/fail check:

    python experiments/quickstart.py [--num_train_steps N] [--max_staleness 0] [--run_id NAME] \
        [--target_eval_reward 0.8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Sequence

import draccus

from marinrl.job.rl_job import JobResult, RLJob, RLJobConfig

JOB_YAML = pathlib.Path(__file__).with_name("quickstart.yaml")


@dataclasses.dataclass
class QuickstartConfig:
    job: RLJobConfig
    target_eval_reward: float = 0.8
    """The run fails (exit 1) if the final greedy eval reward is below this."""

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> QuickstartConfig:
        """experiments/quickstart.yaml with `argv`'s overrides, under a fresh run id unless `--run_id`
        names one (a rerun must not resume the last run)."""
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--target_eval_reward", type=float, default=cls.target_eval_reward)
        args, overrides = parser.parse_known_args(argv)
        job = draccus.parse(RLJobConfig, config_path=str(JOB_YAML), args=overrides)
        if not any(a == "--run_id" or a.startswith("--run_id=") for a in overrides):
            job = dataclasses.replace(job, run_id=time.strftime("quickstart-%Y%m%d-%H%M%S"))
        return cls(job, args.target_eval_reward)


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
    job = config.job
    print(f"[marinrl] quickstart {job.run_id}: writing to {job.run_dir}", flush=True)
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
    print("[marinrl] eval reward (greedy, held-out prompts): "
          + "  ".join(f"step {s}: {r:.2f}" for s, r in curve))
    print(f"[marinrl] plot: {run_dir / 'reward.png'}   summary: {run_dir / 'summary.json'}")
    end = summary["eval_reward_end"]
    if end is None or end < config.target_eval_reward:
        print(f"[marinrl] did not reach eval reward {config.target_eval_reward} (got {end})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(QuickstartConfig.from_args(sys.argv[1:])))
