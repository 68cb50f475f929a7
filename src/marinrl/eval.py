"""Offline evaluation of a saved checkpoint: `marinrl eval` (docs/evaluation.md).

    marinrl eval --checkpoint runs/demo/checkpoints --lessons echo 'parity:{"n_bits": 2}' \\
        --n-examples 64 --output evals/demo

loads the policy from a Levanter checkpoint (a `step-N` directory, or a run's checkpoint folder: its
latest step) or a Hugging Face checkpoint directory, serves it with an `InferenceServer`, and runs
each lesson's environment through a `RolloutManager` with no curriculum, no Ray, no weight transfer.
One sample per prompt (greedy unless a temperature is given) goes through `evaluate_lesson`; K
samples per prompt (pass@K) through `sample_batch` in eval mode. Prompts go in batches of
`batch_size`, one manager call each, under a progress bar; each call's rollouts become one Parquet
rollout file under `OUTPUT/rollouts/` (worker_id "eval", the checkpoint's weight step), the
per-lesson metrics go to `OUTPUT/metrics.json`, and a short table is printed at the end.

`main(config)` is `run(prepare(config))`: `prepare` checks everything the user gave (checkpoint,
lessons, environments, output directory) before any weights load, so a typo fails in a second.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import zlib
from typing import Any, Literal, Optional, Sequence

import draccus
import fsspec
import numpy as np
import yaml

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.config.env import EnvConfig
from marinrl.config.eval import EvalConfig
from marinrl.config.model import ModelConfig
from marinrl.config.serve import ServeConfig
from marinrl.envs.base import Env, make_env, with_endpoint_if_needed
from marinrl.inference.context import lesson_sampling
from marinrl.models.policy_model import MODEL_CONFIG_FILE

logger = logging.getLogger(__name__)

WORKER_ID = "eval"
"""worker_id stamped on every evaluation rollout."""
METRICS_FILE = "metrics.json"
ROLLOUTS_DIR = "rollouts"


# ------------------------------------------------------------------------------- lessons


_LESSON_ID = re.compile(r"([A-Za-z0-9_.-]+)=(.*)", re.S)


def parse_lesson(spec: str) -> LessonConfig:
    """A lesson from a command-line spec: `ENV` or `ENV:{json args}`, optionally prefixed `ID=`.

    ENV is a registered environment name or a dotted class path (`pkg.mod.Cls`, `pkg.mod:Cls`); the
    lesson id defaults to ENV. Examples: `echo`, `echo:{"alphabet_size": 10}`,
    `pairs=echo:{"length": 2}`. Budget and temperature are LessonConfig's defaults."""
    lesson_id, rest = None, spec
    m = _LESSON_ID.fullmatch(spec)
    if m:
        lesson_id, rest = m.groups()
    i = rest.find(":{")
    name, args = (rest[:i], rest[i + 1:]) if i >= 0 else (rest, None)
    if not name:
        raise ValueError(f"lesson {spec!r}: no environment name (expected ENV, ENV:{{json args}} or ID=ENV:{{...}})")
    parsed: dict[str, Any] = {}
    if args is not None:
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"lesson {spec!r}: environment arguments are not valid JSON: {e}") from e
    return LessonConfig(lesson_id or name, EnvConfig(name, parsed))


def load_lessons(path: str, lesson_ids: Sequence[str] = ()) -> tuple[LessonConfig, ...]:
    """The lessons of a YAML file holding a CurriculumConfig, or a job config with a `curriculum:`
    section; `lesson_ids` picks some of them, in that order (default: all)."""
    curriculum = _load_yaml_config(path, CurriculumConfig, "curriculum")
    if not lesson_ids:
        return curriculum.lessons
    known = [lesson.lesson_id for lesson in curriculum.lessons]
    unknown = [i for i in lesson_ids if i not in known]
    if unknown:
        raise ValueError(f"unknown lesson(s) {unknown} in {path}; known: {known}")
    return tuple(curriculum.lesson(i) for i in lesson_ids)


def load_model_config(path: str) -> ModelConfig:
    """A ModelConfig from a YAML file holding one, or a job config with a `model:` section."""
    return _load_yaml_config(path, ModelConfig, "model")


def _load_yaml_config(path: str, cls: type, section: str):
    fs, plain = fsspec.core.url_to_fs(path)
    if not fs.exists(plain):
        raise FileNotFoundError(f"config file not found: {path}")
    with fs.open(plain, "r") as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a YAML mapping, got {type(raw).__name__}")
    try:
        return draccus.decode(cls, raw)
    except Exception as whole:  # not a bare `cls`: maybe a job config holding one under `section`
        if not isinstance(raw.get(section), dict):
            raise ValueError(f"{path}: neither a {cls.__name__} nor a config with a `{section}:` section: "
                             f"{whole}") from whole
        try:
            return draccus.decode(cls, raw[section])
        except Exception as e:
            raise ValueError(f"{path}: `{section}:` is not a valid {cls.__name__}: {e}") from e


# ---------------------------------------------------------------------------- checkpoints


class CheckpointLoadError(ValueError):
    """The checkpoint resolved, but its weights do not load (truncated or garbled files, another model's shape)."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint on disk, resolved: its format, the directory the weights load from, its weight step."""

    kind: Literal["levanter", "hf"]
    path: str
    """For Levanter, the `step-N` directory chosen (the latest under a run's folder)."""
    weight_step: int


def resolve_checkpoint(path: str) -> Checkpoint:
    """What `path` holds. A directory with config.json is a Hugging Face checkpoint; its weight step
    is N if the directory is named `step-N` (as Levanter's HF export names them), else 0. Otherwise a
    `step-N` directory with metadata.json, or a folder of them (the latest wins), is a Levanter
    checkpoint; its weight step is the number of updates the TrainWorker recorded in its sidecar if
    there is one (Levanter's Trainer names `step-N` after the 0-indexed step it just completed, so
    those weights have N + 1 updates), else metadata.json's step (what `save_levanter_checkpoint` was
    given). Raises FileNotFoundError or ValueError naming `path`."""
    fs, plain = fsspec.core.url_to_fs(path)
    plain = plain.rstrip("/")
    if not fs.exists(plain):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if fs.exists(f"{plain}/config.json"):
        m = re.fullmatch(r"step-(\d+)", os.path.basename(plain))
        return Checkpoint("hf", path, int(m.group(1)) if m else 0)
    from levanter.checkpoint import discover_latest_checkpoint

    from marinrl.train.checkpoints import CheckpointDigestError, newest_loadable, verified

    step_dir = discover_latest_checkpoint(path)
    if step_dir is None:
        raise ValueError(f"{path} is neither a Levanter checkpoint (a step-N directory with metadata.json, or a "
                         "folder of them) nor a Hugging Face checkpoint (a directory with config.json)")
    try:
        verified(step_dir)  # a garbled chunk may still decode: its bytes would be evaluated as weights
    except CheckpointDigestError as e:
        intact = newest_loadable(path)  # None when `path` is the damaged step-N folder itself
        raise ValueError(f"{e}; evaluate another checkpoint"
                         + (f" (the newest intact one here: --checkpoint {intact.path})" if intact else "")) from None
    return Checkpoint("levanter", step_dir, _levanter_weight_step(step_dir))


def _levanter_weight_step(step_dir: str) -> int:
    from marinrl.train.worker import SIDECAR

    fs, plain = fsspec.core.url_to_fs(step_dir)
    plain = plain.rstrip("/")
    sidecar = f"{plain}/{SIDECAR}"
    if fs.exists(sidecar):
        return int(json.loads(fs.cat_file(sidecar))["step"])
    return int(json.loads(fs.cat_file(f"{plain}/metadata.json"))["step"])


def _has_model_config(step_dir: str) -> bool:
    fs, plain = fsspec.core.url_to_fs(step_dir)
    plain = plain.rstrip("/")
    return any(fs.exists(f"{d}/{MODEL_CONFIG_FILE}") for d in (plain, os.path.dirname(plain)))


def check_architecture(checkpoint: Checkpoint, model: Optional[ModelConfig]) -> None:
    """ValueError naming the checkpoint when nothing says its architecture: a Levanter checkpoint without
    model_config.json (a Trainer's) and no `model` given."""
    if checkpoint.kind == "levanter" and model is None and not _has_model_config(checkpoint.path):
        raise ValueError(f"{checkpoint.path} has no {MODEL_CONFIG_FILE} (a Trainer's checkpoint): give its "
                         "architecture with --model-config FILE (a ModelConfig YAML, or the run's job config)")


def load_policy(checkpoint: Checkpoint, config: EvalConfig | ServeConfig):
    """(model, tokenizer) of a resolved checkpoint, read straight onto the rollout mesh of `config.inference`,
    with `config.model`'s architecture and dtype and `config.tokenizer` where they are given."""
    from marinrl.inference.served_model import load_served_model
    from marinrl.models.policy_model import build_tokenizer

    base = config.model or ModelConfig()
    if config.inference.dtype is not None:  # loaded in the dtype it is served in, as a rollout worker does
        base = dataclasses.replace(base, dtype=config.inference.dtype)
    tokenizer = config.tokenizer or base.tokenizer
    if checkpoint.kind == "hf":
        model_config = dataclasses.replace(base, hf_checkpoint=checkpoint.path, levanter_checkpoint=None,
                                           tokenizer=tokenizer)
    else:
        model_config = dataclasses.replace(base, levanter_checkpoint=checkpoint.path, hf_checkpoint=None,
                                           tokenizer=tokenizer)
    model = load_served_model(model_config, config.inference)
    return model, build_tokenizer(dataclasses.replace(model_config, vocab_size=model.Vocab.size))


def load_policy_or_explain(checkpoint: Checkpoint, config: EvalConfig | ServeConfig):
    """`load_policy`, a failure to load (a truncated chunk, a checkpoint of another shape) as one line naming
    the checkpoint (CheckpointLoadError), not tensorstore's stack."""
    try:
        return load_policy(checkpoint, config)
    except Exception as e:
        text = " ".join(str(e).split())
        raise CheckpointLoadError(f"cannot load the weights of {checkpoint.path}: {type(e).__name__}: "
                                  f"{text[:300]}{'…' if len(text) > 300 else ''}") from e


# ---------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An evaluation whose inputs have been checked: what `run` needs besides the weights."""

    config: EvalConfig
    checkpoint: Checkpoint
    weight_step: int
    envs: dict[str, Env]
    output: Optional[str]


def prepare(config: EvalConfig) -> Prepared:
    """Check the checkpoint, build every lesson's environment (an unknown environment or bad
    arguments fail here) and check that the output directory is free, all before any weights load."""
    checkpoint = resolve_checkpoint(config.checkpoint)
    check_architecture(checkpoint, config.model)
    envs = {lesson.lesson_id: make_env(lesson.env) for lesson in config.lessons}
    output = None
    if config.output is not None:
        fs, plain = fsspec.core.url_to_fs(config.output)
        for name in (METRICS_FILE, ROLLOUTS_DIR):
            if fs.exists(f"{plain.rstrip('/')}/{name}"):
                raise FileExistsError(f"{config.output} already holds an evaluation ({name}); "
                                      "choose another output directory")
        output = config.output.rstrip("/")
    weight_step = checkpoint.weight_step if config.weight_step is None else config.weight_step
    return Prepared(config, checkpoint, weight_step, envs, output)


def run(prepared: Prepared) -> dict:
    """Load the weights, evaluate every lesson, write the files, print the table; returns what
    metrics.json holds."""
    from tqdm import tqdm

    from marinrl.job.plan import lesson_runtimes, serve
    from marinrl.rollout.manager import RolloutManager
    from marinrl.storage.rollouts import RolloutWriter

    config, step = prepared.config, prepared.weight_step
    model, tokenizer = load_policy_or_explain(prepared.checkpoint, config)

    def sampling(lesson: LessonConfig):
        return dataclasses.replace(lesson_sampling(lesson, tokenizer, "eval"),
                                   temperature=config.temperature_of(lesson), max_tokens=config.max_tokens_of(lesson))

    runtimes = lesson_runtimes(config.lessons, tokenizer, envs=prepared.envs, sampling=sampling)
    lesson_info = {lesson.lesson_id: {"env": {"name": lesson.env.name, "args": dict(lesson.env.args)},
                                      "temperature": runtimes[lesson.lesson_id].sampling.temperature,
                                      "max_tokens": runtimes[lesson.lesson_id].sampling.max_tokens}
                   for lesson in config.lessons}
    writer = RolloutWriter(f"{prepared.output}/{ROLLOUTS_DIR}") if prepared.output else None
    sizes = [min(config.batch_size, config.n_examples - i) for i in range(0, config.n_examples, config.batch_size)]
    inference = with_endpoint_if_needed(config.inference, [lesson.env for lesson in config.lessons])
    if config.model is not None and config.model.lm_head_float32:  # the head the run's trainer had
        inference = dataclasses.replace(inference, lm_head_float32=True)
    server = serve(inference, model, tokenizer, weight_step=step)
    try:
        manager = RolloutManager(server, runtimes, curriculum=None)
        with tqdm(total=len(sizes) * len(config.lessons), unit="batch", disable=not config.progress) as bar:
            for lesson in config.lessons:
                lesson_id = lesson.lesson_id
                bar.set_description(lesson_id)
                rng = np.random.default_rng([config.seed, zlib.crc32(lesson_id.encode())])
                calls, groups = [], []
                for size in sizes:
                    if config.samples == 1:
                        metrics, batch = manager.evaluate_lesson(lesson_id, size, "eval", rng, step=step,
                                                                 weight_step=step, worker_id=WORKER_ID)
                    else:
                        batch, prefixed = manager.sample_batch(lesson_id, size, config.samples, "eval", rng,
                                                               weight_step=step, worker_id=WORKER_ID)
                        metrics = {k.split("/", 1)[1]: v for k, v in prefixed.items()}
                    calls.append((size, metrics))
                    if batch is not None:
                        groups.extend(batch.groups)
                        if writer is not None:
                            writer.write(batch)
                    bar.update()
                lesson_info[lesson_id]["metrics"] = lesson_metrics(calls, groups, config.samples,
                                                                   config.pass_threshold)
    finally:
        server.shutdown()
    result = {
        "checkpoint": config.checkpoint,
        "checkpoint_kind": prepared.checkpoint.kind,
        "loaded_from": prepared.checkpoint.path,
        "weight_step": step,
        "worker_id": WORKER_ID,
        "n_examples": config.n_examples,
        "samples": config.samples,
        "pass_threshold": config.pass_threshold,
        "seed": config.seed,
        "lessons": lesson_info,
        "rollouts": f"{prepared.output}/{ROLLOUTS_DIR}" if prepared.output else None,
        "files": writer.files_written if writer is not None else 0,
    }
    result = _finite_or_none(result)
    if prepared.output:
        fs, plain = fsspec.core.url_to_fs(prepared.output)
        fs.makedirs(plain, exist_ok=True)
        fs.pipe_file(f"{plain.rstrip('/')}/{METRICS_FILE}",
                     json.dumps(result, indent=1, allow_nan=False).encode())
    print(format_table(result), flush=True)
    return result


def main(config: EvalConfig) -> dict:
    """Evaluate `config.checkpoint` on `config.lessons`; returns what metrics.json holds."""
    return run(prepare(config))


# ------------------------------------------------------------------------------- metrics

# Environment metrics that add up over calls; every other one is a mean or a fraction over the call's
# prompts, and is averaged weighted by them.
_SUMMED = frozenset({"env_failures", "malformed_groups", "dropped_metrics", "groups", "n_samples", "sample_seconds"})


def lesson_metrics(calls: Sequence[tuple[int, dict[str, float]]], groups: Sequence, samples: int,
                   pass_threshold: float) -> dict[str, float]:
    """One lesson's metrics over all its manager calls (`calls`: prompts asked for, metrics returned).

    Environment metrics: counters (`*_count`, failures, groups, seconds) are summed, the rest averaged
    weighted by each call's prompts. Then, computed exactly from the rollouts themselves: `n` (samples),
    `prompts`, `reward_mean`, `reward_std`, `response_length_mean`, `finish_stop_frac`, `pass@1` (the
    fraction of samples with reward >= `pass_threshold`, an unbiased pass@1) and, for K > 1 samples
    per prompt, `pass@K` (the fraction of prompts with at least one passing sample)."""
    out: dict[str, float] = {}
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for size, metrics in calls:
        for key, value in metrics.items():
            if key in _SUMMED or key.endswith("_count"):
                out[key] = out.get(key, 0.0) + value
            else:
                sums[key] = sums.get(key, 0.0) + value * size
                weights[key] = weights.get(key, 0.0) + size
    out.update({key: sums[key] / weights[key] for key in sums})
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = np.array([r.episode_reward for r in rollouts], dtype=np.float64)
    nan = float("nan")
    out.update(
        n=len(rollouts),
        prompts=len(groups),
        reward_mean=float(rewards.mean()) if rollouts else nan,
        reward_std=float(rewards.std()) if rollouts else nan,
        response_length_mean=float(np.mean([r.response_tokens.size for r in rollouts])) if rollouts else nan,
        finish_stop_frac=float(np.mean([r.finish_reason == "stop" for r in rollouts])) if rollouts else nan,
    )
    out["pass@1"] = float(np.mean(rewards >= pass_threshold)) if rollouts else nan
    if samples > 1:
        out[f"pass@{samples}"] = (float(np.mean([max(r.episode_reward for r in g.rollouts) >= pass_threshold
                                                 for g in groups])) if groups else nan)
    return out


def _finite_or_none(x):
    """JSON-ready: NaN and infinities become null (JSON has no NaN)."""
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def format_table(result: dict) -> str:
    """The summary `run` prints: one row per lesson (`failed`: manager calls whose environment raised,
    `dropped`: malformed groups), then where the files went."""
    k = result["samples"]
    headers = ["lesson", "env", "n", "reward", "pass@1"] + ([f"pass@{k}"] if k > 1 else []) + [
        "stop", "length", "failed", "dropped"]

    def num(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    rows = []
    for lesson_id, info in result["lessons"].items():
        m = info["metrics"]
        rows.append([lesson_id, info["env"]["name"], str(m["n"]), num(m["reward_mean"]), num(m["pass@1"])]
                    + ([num(m[f"pass@{k}"])] if k > 1 else [])
                    + [num(m["finish_stop_frac"], 2), num(m["response_length_mean"], 1),
                       str(int(m.get("env_failures", 0))), str(int(m.get("malformed_groups", 0)))])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [f"{result['checkpoint']} ({result['checkpoint_kind']}, weight step {result['weight_step']}), "
             f"{k} sample{'s' if k > 1 else ''} per prompt:"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [headers] + rows]
    if result["rollouts"]:
        lines.append(f"{result['files']} rollout files in {result['rollouts']}; metrics in "
                     f"{os.path.dirname(result['rollouts'])}/{METRICS_FILE}")
    return "\n".join(lines)
