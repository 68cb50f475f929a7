"""`marinrl report RUN_DIR`: PNG plots and a small HTML page from a run's tracker logs and rollout files.

Its inputs (rollout files, the trainer's and rollout workers' TensorBoard event files, Levanter's JSON
logs) are read by `sources.py`; trainer steps are numbered from 1 (step s publishes weight
version s), rollout workers' metrics by the weight step they hold.

The output is `RUN_DIR/report/index.html` plus one PNG per figure next to it.
"""

from __future__ import annotations

import html
import math
import pathlib
import re
import statistics
from collections import defaultdict
from typing import Iterable, Optional

import numpy as np

from marinrl.report.sources import (  # noqa: F401  (read_*: part of this module's API)
    LessonStats,
    RunData,
    Series,
    load_run,
    read_event_scalars,
    read_event_wall_times,
    read_json_logs,
    read_rollouts,
)

MISMATCH_METRICS = ("abs_logprob_mean", "abs_logprob_max", "k3_kl", "tis_clipped_frac", "mis_masked_frac")
"""The loss's `mismatch/*` metrics (marinrl/train/mismatch.py), logged as `train/mismatch/<name>`."""


def _median(values: Iterable[float]) -> Optional[float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _xy(series: Series) -> tuple[list[int], list[float]]:
    steps = sorted(series)
    return steps, [series[s] for s in steps]


def _merge_workers(workers: dict[str, dict[str, Series]], tag: str) -> Series:
    """The mean over workers of `tag` at each weight step."""
    values: dict[int, list[float]] = defaultdict(list)
    for metrics in workers.values():
        for step, v in metrics.get(tag, {}).items():
            values[step].append(v)
    return {s: float(np.mean(v)) for s, v in sorted(values.items())}


def _tags(data: RunData, prefix: str) -> list[str]:
    tags = set(t for t in data.trainer if t.startswith(prefix))
    for metrics in data.workers.values():
        tags.update(t for t in metrics if t.startswith(prefix))
    return sorted(tags)


def write_report(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """Writes the PNGs and `index.html` (default under RUN_DIR/report/) and returns the HTML's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load_run(run_dir)
    out = pathlib.Path(out_dir) if out_dir is not None else data.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    sections: list[str] = []
    lessons = list(data.lessons)
    for w in data.workers.values():  # lessons only seen in evals (e.g. not yet sampled) still get a line
        for tag in w:
            m = re.match(r"^eval/(.+)/reward_mean$", tag)
            if m and m.group(1) not in lessons:
                lessons.append(m.group(1))

    def figure(name: str, title: str, draw, caption: str) -> None:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        draw(ax)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        sections.append(f"<h2>{html.escape(title)}</h2><p>{caption}</p>"
                        f"<img src=\"{name}\" alt=\"{html.escape(title)}\">")

    def note(title: str, text: str) -> None:
        sections.append(f"<h2>{html.escape(title)}</h2><p class=\"note\">{text}</p>")

    # -- reward per lesson (rollout files)
    if data.lessons:
        def draw_reward(ax):
            for lesson_id, st in data.lessons.items():
                steps = sorted(st.rewards)
                ax.plot(steps, [np.mean(st.rewards[s]) for s in steps], "o-", ms=3, label=lesson_id)
            ax.set_xlabel("weight step (of the policy that generated the rollouts)")
            ax.set_ylabel("mean reward")
        figure("reward_per_lesson.png", "Training reward per lesson", draw_reward,
               f"Mean episode reward of the rollouts in <code>rollouts/</code>, per lesson and weight step "
               f"({sum(st.n for st in data.lessons.values())} rollouts).")
    else:
        note("Training reward per lesson", "No readable rollout files under <code>rollouts/</code>.")

    # -- eval reward (rollout workers' trackers)
    eval_tags = {lesson: f"eval/{lesson}/reward_mean" for lesson in lessons}
    eval_series = {lesson: _merge_workers(data.workers, tag) for lesson, tag in eval_tags.items()}
    eval_series = {k: v for k, v in eval_series.items() if v}
    if eval_series:
        def draw_eval(ax):
            for lesson_id, series in eval_series.items():
                ax.plot(*_xy(series), "o-", label=lesson_id)
            ax.set_xlabel("weight step")
            ax.set_ylabel("eval reward")
        figure("eval_reward.png", "Eval reward per lesson", draw_eval,
               "<code>eval/&lt;lesson&gt;/reward_mean</code> of the full evaluations the rollout workers run "
               "(held-out prompts, each lesson's eval sampling), from their TensorBoard event files.")
    else:
        note("Eval reward per lesson", "No <code>eval/*/reward_mean</code> metrics in the rollout workers' "
             "TensorBoard event files.")

    # -- response length (rollout files)
    if data.lessons:
        def draw_length(ax):
            for lesson_id, st in data.lessons.items():
                steps = sorted(st.lengths)
                ax.plot(steps, [np.mean(st.lengths[s]) for s in steps], "o-", ms=3, label=lesson_id)
            ax.set_xlabel("weight step")
            ax.set_ylabel("response tokens (mean)")
        figure("response_length.png", "Response length per lesson", draw_length,
               "Mean number of response tokens of the rollouts, per lesson and weight step.")

    # -- staleness (trainer)
    stale_mean, stale_max = data.trainer.get("batch/staleness_mean", {}), data.trainer.get("batch/staleness_max", {})
    at_write = _merge_workers(data.workers, "rollout/staleness_at_write")
    if stale_mean or stale_max or at_write:
        def draw_stale(ax):
            if stale_mean:
                ax.plot(*_xy(stale_mean), label="trained batch: mean")
            if stale_max:
                ax.plot(*_xy(stale_max), "--", label="trained batch: max")
            ax.set_xlabel("trainer step")
            ax.set_ylabel("weight versions behind")
        figure("staleness.png", "Staleness", draw_stale,
               "How many weight versions behind the trainer the rollouts of each trained batch were "
               "(<code>batch/staleness_mean</code>, <code>batch/staleness_max</code>).")
    else:
        note("Staleness", "No staleness metrics in the trainer's logs.")

    # -- sampler/trainer mismatch (trainer)
    mismatch = {name: data.trainer.get(f"train/mismatch/{name}", {}) for name in MISMATCH_METRICS}
    if any(mismatch.values()):
        def draw_mismatch(ax):
            for name, series in mismatch.items():
                if series:
                    ax.plot(*_xy(series), "--" if name.endswith("_frac") else "-", label=name)
            ax.set_yscale("symlog", linthresh=1e-4)  # from rounding (~1e-6) to whole nats, and fractions
            ax.set_xlabel("trainer step")
            ax.set_ylabel("nats | fraction of tokens")
        figure("mismatch.png", "Sampler/trainer mismatch", draw_mismatch,
               "The sampler's stored logprobs μ against the trainer's own at the start of each step, on the trained "
               "tokens (<code>train/mismatch/*</code>): mean and max |log π − log μ|, the k3 KL estimate, and the "
               "fractions of tokens TIS would clip and MIS would mask at the configured bounds. With staleness "
               "&gt; 0 they include the policy's change since the rollouts' weights (docs/training.md).")
    else:
        note("Sampler/trainer mismatch", "No <code>train/mismatch/*</code> metrics in the trainer's logs.")

    # -- step time split
    step_s, wait_s, update_s = (data.trainer.get(k, {}) for k in ("train/step_s", "train/wait_s", "train/update_s"))
    gen_s = _merge_workers(data.workers, "rollout/generation_s")
    if step_s:
        steps = sorted(step_s)

        def draw_split(ax):
            wait = np.array([wait_s.get(s, 0.0) for s in steps])
            update = np.array([update_s.get(s, 0.0) for s in steps])
            other = np.maximum(np.array([step_s[s] for s in steps]) - wait - update, 0.0)
            ax.bar(steps, wait, label="trainer waiting for rollouts", color="tab:orange")
            ax.bar(steps, update, bottom=wait, label="policy update", color="tab:blue")
            ax.bar(steps, other, bottom=wait + update, label="other (batching, publishing weights)", color="tab:gray")
            if gen_s:
                ax.plot(*_xy(gen_s), "k.-", label="generation per batch (rollout worker, at weight step)")
            later = [step_s[s] for s in steps if s > 1] + [v for s, v in gen_s.items() if s > 1]
            if later and step_s[steps[0]] > 2 * max(later):  # the first step's compiles would flatten the rest
                ax.set_ylim(0, 1.2 * max(later))
                ax.annotate(f"step {steps[0]}: {step_s[steps[0]]:.1f} s (compiles), clipped",
                            (steps[0], 1.15 * max(later)), fontsize=8, va="top")
            ax.set_xlabel("trainer step")
            ax.set_ylabel("seconds")
        figure("step_time.png", "Step time split", draw_split,
               "Per trainer step: waiting for rollouts (<code>train/wait_s</code>), the update "
               "(<code>train/update_s</code>) and the rest of <code>train/step_s</code>; the line is the rollout "
               "workers' generation time per batch (<code>rollout/generation_s</code>).")
    else:
        note("Step time split", "No <code>train/step_s</code> in the trainer's logs.")

    # -- curriculum weights
    weight_tags = [t for t in _tags(data, "curriculum/") if t.endswith("weight")]
    if weight_tags:
        def draw_weights(ax):
            for tag in weight_tags:
                series = data.trainer.get(tag) or _merge_workers(data.workers, tag)
                ax.plot(*_xy(series), label=tag[len("curriculum/"):].removesuffix("/weight"))
            ax.set_xlabel("trainer step")
            ax.set_ylabel("sampling weight")
        figure("curriculum_weights.png", "Curriculum sampling weights", draw_weights,
               "The curriculum's sampling weight of each lesson (<code>curriculum/&lt;lesson&gt;/weight</code>), as "
               "logged with each trainer step.")
    else:
        note("Curriculum sampling weights",
             "Not logged: this run's trackers hold no <code>curriculum/*weight</code> metrics (neither the trainer "
             "nor the rollout workers log the curriculum's weights), so there is no curve to show. The training "
             "reward per lesson above shows which lessons were sampled at each weight step.")

    # -- summary tables
    steady = [s for s in sorted(step_s) if s >= 3]
    med_step = _median(step_s[s] for s in steady)
    med_wait = _median(wait_s.get(s) for s in steady)
    med_update = _median(update_s.get(s) for s in steady)
    idle = (med_wait / med_step) if med_wait is not None and med_step else None
    trainer_steps = max(step_s) if step_s else 0
    rows = [
        ("run directory", html.escape(str(data.run_dir))),
        ("trainer steps", str(trainer_steps)),
        ("trainer metrics from", html.escape(data.trainer_source)),
        ("rollout workers", str(len(data.workers))),
        ("rollouts", str(sum(st.n for st in data.lessons.values()))),
        ("median seconds per step (steps ≥ 3)", _fmt(med_step)),
        ("median update seconds", _fmt(med_update)),
        ("median wait seconds", _fmt(med_wait)),
        ("median generation seconds per batch", _fmt(_median(gen_s.values()))),
        ("trainer idle fraction (median wait / median step)", _fmt(idle, 2)),
        ("unreadable rollout files", str(len(data.unreadable))),
    ]
    lesson_rows = []
    for lesson_id in lessons:
        st = data.lessons.get(lesson_id, LessonStats())
        steps = sorted(st.rewards)
        ev = eval_series.get(lesson_id, {})
        ev_steps = sorted(ev)
        lesson_rows.append(
            f"<tr><td>{html.escape(lesson_id)}</td><td>{st.n}</td>"
            f"<td>{_fmt(float(np.mean(st.rewards[steps[0]])) if steps else None)}</td>"
            f"<td>{_fmt(float(np.mean(st.rewards[steps[-1]])) if steps else None)}</td>"
            f"<td>{_fmt(float(np.mean([x for s in steps for x in st.lengths[s]])) if steps else None, 1)}</td>"
            f"<td>{_fmt(ev[ev_steps[0]]) if ev else '–'}</td><td>{_fmt(ev[ev_steps[-1]]) if ev else '–'}</td></tr>")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>marinrl report: {html.escape(data.run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto}} td,th{{padding:2px 10px;text-align:left}}
table{{border-collapse:collapse}} tr:nth-child(even){{background:#f3f3f3}} .note{{color:#8a4b00}}
img{{max-width:100%}}</style>
</head><body>
<h1>marinrl report: {html.escape(data.run_dir.name)}</h1>
<table>{''.join(f'<tr><th>{k}</th><td>{v}</td></tr>' for k, v in rows)}</table>
<h2>Lessons</h2>
<table><tr><th>lesson</th><th>rollouts</th><th>reward, first weight step</th><th>reward, last weight step</th>
<th>response tokens</th><th>eval reward, first</th><th>eval reward, last</th></tr>
{''.join(lesson_rows)}</table>
{''.join(sections)}
{''.join(f'<p class="note">unreadable: {html.escape(u)}</p>' for u in data.unreadable)}
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index


def main(run_dir: str, out_dir: Optional[str] = None) -> int:
    index = write_report(run_dir, out_dir)
    pngs = sorted(p.name for p in index.parent.glob("*.png"))
    print(f"[marinrl] report: {index} ({', '.join(pngs)})")
    return 0
