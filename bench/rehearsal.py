"""The real-size rehearsal: the Qwen3-0.6B recipe end to end on this machine's CPU, scaled down in
prompts, samples and lengths but not in the model (issue 19).

What it runs, in one local Ray per job on fake CPU devices (`--devices`, 2 by default):
1. writes Qwen3-0.6B's architecture (experiments/grpo_math_qwen3_0p6b.py) with random weights through
   transformers (`Qwen3ForCausalLM`, bf16 safetensors) and the byte-level tokenizer, into a temp folder;
2. runs the recipe's config (its `RECIPE` YAML through `marinrl.recipe`'s draccus path) with an overlay
   that fits 2 cores: 2 prompts x 2 samples of `arithmetic` (difficulty 1, ~16-token prompts), 16 new
   tokens, rows of 64 tokens, the step's rows in one microbatch; trainer FSDP over the devices with
   gradient checkpointing (the recipe's), rollouts tensor-parallel over them (`inference.model_axis_size`)
   in bfloat16, delta weight sync (`weights: {type: filesystem, delta: true}`), the recipe's engine backend;
3. SIGKILLs the job's process (and then the Ray processes it started, as a host crash would) once the
   checkpoint after step `--kill_after` is complete (committed and its digest written: the save's last file),
   then runs the same config again: the trainer resumes
   from that checkpoint and trains to step `--kill_after + 1`;
4. measures the rollout/trainer logprob mismatch with a bfloat16 and a float32 LM head (`model.lm_head_float32`)
   in a process of its own, the job's parts over the same checkpoint (bench/rehearsal_mismatch.py: why a
   phase and not a job, and why under XLA's strict precision); `--mismatch_only true` runs steps 1 and 4 alone.

It prints the phase times (from the actors' `startup:` lines and JSON log metrics; docs/performance.md,
"First step") and one final JSON line: docs/performance.md, "Rehearsal", says what each field is. Fields
the code cannot give yet are null, each with a line in `not_available` saying why: never a made-up number.

    python bench/rehearsal.py                      # the real size (596M parameters; > 24 GiB today)
    python bench/rehearsal.py --scale small        # the harness alone (4.2M parameters), ~2 minutes
    python bench/rehearsal.py --root DIR --report_only true   # read a finished rehearsal back
    python bench/rehearsal.py --mismatch_only true  # the checkpoint and the mismatch phase, no job (~2 min full)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def _fake_devices_from_argv(argv: list[str]) -> int:
    """`--devices N` read before JAX loads (the harness's dry run and the job's actors inherit XLA_FLAGS)."""
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 2


if __name__ == "__main__" and _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"{_DEVICES_FLAG}={_fake_devices_from_argv(sys.argv)}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("WANDB_MODE", "offline")

import draccus  # noqa: E402

_BENCH = pathlib.Path(__file__).resolve().parent
_REPO = _BENCH.parent
sys.path.insert(0, str(_BENCH))
from rehearsal_logs import newest_checkpoint, run_logs  # noqa: E402
from rehearsal_report import print_phases, read_report  # noqa: E402

QWEN3_0P6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0)
"""experiments/grpo_math_qwen3_0p6b.py's `model.model` in transformers' names."""
SCALES = {
    "full": QWEN3_0P6B,
    "small": {**QWEN3_0P6B, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096},
    "tiny": {**QWEN3_0P6B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512},
}


MEMORY_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1048576",  # the actors return freed weight buffers (a received version) to the OS
    "RAY_memory_usage_threshold": "0.99",  # the job's local Ray kills workers at 99% of the machine, not 95%
}
"""What a 24 GiB machine needs to hold a 0.6B trainer (16-17 GB inside an update on 2 fake devices) and a
rollout worker at once (docs/performance.md, "Rehearsal")."""


@dataclasses.dataclass
class RehearsalConfig:
    scale: str = "full"
    """`full`: Qwen3-0.6B's real size. `small` (4 layers, hidden 256) and `tiny` (2 layers, hidden 64) check
    the harness in minutes; only `full` rehearses the recipe."""
    devices: int = 2
    """Fake CPU devices per process: the trainer's FSDP axis and the rollout's tensor-parallel axis."""
    groups: int = 2
    """Prompts per step (`groups_per_step`)."""
    generations: int = 2
    """Samples per prompt (`n_generations`)."""
    max_tokens: int = 16
    """New tokens per sample."""
    row_length: int = 64
    """`batching.max_length` and the engine's `max_seq_len`: prompt + response."""
    kill_after: int = 3
    """Steps trained (and checkpointed) before the job is SIGKILLed; the resumed job trains one more."""
    rollout_dtype: str = "bfloat16"
    """`inference.dtype`: the recipe's bfloat16 rollouts, or float32 (for a trainer that cannot publish
    bf16 weights yet)."""
    init: str = "hf"
    """`hf`: both roles load the HF checkpoint written by transformers (the recipe's path). `scratch`: both
    build the same architecture from the same seed instead (no checkpoint read; the tokenizer is still the
    written one): the harness without the checkpoint read."""
    delta: bool = True
    """Delta weight sync (`weights.delta`): each side then keeps a host copy of the last version."""
    max_staleness: int = 0
    """0 (the default): generation and training one after the other, so the trainer's update (17 GB) and a
    rollout worker's receive (6.7 GB) never peak together on 24 GiB; the recipe's 1 overlaps them."""
    checkpoint_dtype: str = "bfloat16"
    """The HF checkpoint's dtype (Qwen3-0.6B ships bfloat16; float32 for a loader that keeps bf16 tensors
    as bf16 whatever dtype it is asked for, as Levanter's safetensors reader does with ml_dtypes' bfloat16)."""
    backend: str = "engine"
    """The rollout backend: the recipe's `engine`, or `scan`."""
    root: Optional[str] = None
    """Folder for the checkpoint and the run (default: a temp folder, deleted at the end)."""
    report_only: bool = False
    """Read a finished rehearsal back from `root` (its watched.json and run folder) instead of running one."""
    job_timeout_s: float = 1800.0
    """Each job's limit: past it the job is killed and the rehearsal fails, naming the phase."""
    mismatch: bool = True
    """Measure the rollout/trainer mismatch with each LM head after the jobs (bench/rehearsal_mismatch.py)."""
    mismatch_only: bool = False
    """Write the checkpoint and measure the mismatch only: no job (its JSON line holds `mismatch` alone)."""

    def __post_init__(self):
        if self.scale not in SCALES:
            raise ValueError(f"RehearsalConfig.scale: {self.scale!r} is not one of {sorted(SCALES)}")
        if self.init not in ("hf", "scratch"):
            raise ValueError(f"RehearsalConfig.init: {self.init!r} is not hf or scratch")
        if self.backend not in ("engine", "scan"):
            raise ValueError(f"RehearsalConfig.backend: {self.backend!r} is not engine or scan")
        if self.report_only and self.root is None:
            raise ValueError("RehearsalConfig.report_only needs root: the folder of a finished rehearsal")
        for name in ("rollout_dtype", "checkpoint_dtype"):
            if getattr(self, name) not in ("bfloat16", "float32"):
                raise ValueError(f"RehearsalConfig.{name}: {getattr(self, name)!r} is not bfloat16 or float32")
        for name in ("devices", "groups", "generations", "max_tokens", "kill_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"RehearsalConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.generations < 2:
            raise ValueError("RehearsalConfig.generations must be >= 2 (GRPO's advantages are relative to the group)")
        if (self.groups * self.generations) % self.devices:
            raise ValueError(f"RehearsalConfig: groups x generations = {self.groups * self.generations} rows do not "
                             f"divide over devices={self.devices}")
        if self.max_tokens + 16 > self.row_length:
            raise ValueError(f"RehearsalConfig.row_length={self.row_length} leaves no room for a ~16-token prompt "
                             f"and max_tokens={self.max_tokens}")


# ------------------------------------------------------------------ the inputs


def write_hf_checkpoint(path: str, scale: str, dtype: str = "bfloat16", seed: int = 0, weights: bool = True) -> None:
    """Qwen3 at `scale` with transformers' random init, saved as `dtype` safetensors with the byte-level
    tokenizer. Run in a child process: torch's copy of the model leaves the harness's memory with it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from marinrl.models.tokenizers import byte_tokenizer

    torch.manual_seed(seed)
    torch.set_default_dtype(getattr(torch, dtype))  # built in its dtype: no second copy to cast
    config = Qwen3Config(**SCALES[scale], max_position_embeddings=4096, torch_dtype=dtype)
    if weights:
        Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    byte_tokenizer(512).save_pretrained(path)


def job_yaml(cfg: RehearsalConfig, root: str, checkpoint: str) -> str:
    """The recipe's YAML with the rehearsal's overlay (marinrl.recipe.recipe_yaml: mappings merge, lists are
    replaced): one local Ray, CPU placements, shapes that fit 2 cores."""
    import importlib.util

    import yaml

    from marinrl.recipe import recipe_yaml

    spec = importlib.util.spec_from_file_location("recipe", _REPO / "experiments" / "grpo_math_qwen3_0p6b.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    lesson = {"lesson_id": "arithmetic", "env": {"name": "arithmetic",
                                                 "args": {"difficulty": 1, "chat": False, "instruction": ""}},
              "temperature": 1.0, "max_tokens": cfg.max_tokens, "graduate_at": None}
    overlay = {
        "run_id": f"rehearsal-{cfg.scale}", "run_root": root,
        "model": _model_overlay(cfg, checkpoint),
        "curriculum": {"lessons": [lesson]},
        "num_train_steps": cfg.kill_after + 1, "checkpoint_every": cfg.kill_after,
        "groups_per_step": cfg.groups, "n_generations": cfg.generations, "n_rollout_workers": 1,
        "eval_every": 10_000, "eval_examples": cfg.groups,
        "batching": {"max_length": cfg.row_length, "min_bucket": cfg.row_length},
        # One microbatch per step: gradient accumulation's f32 accumulator is another copy of the weights
        # (2.4 GB at 0.6B) that rows of 64 tokens do not need.
        "trainer": {"per_device_parallelism": cfg.groups * cfg.generations // cfg.devices,
                    "tracker": [{"type": "json_logger"}]},
        "inference": {"backend": cfg.backend, "dtype": cfg.rollout_dtype, "model_axis_size": cfg.devices,
                      "engine": {"max_seqs": cfg.groups * cfg.generations, "max_seq_len": cfg.row_length,
                                 "max_prefill_tokens": cfg.groups * cfg.row_length}},
        "weights": {"type": "filesystem", "root": f"{root}/rehearsal-{cfg.scale}/weights", "delta": cfg.delta},
        "max_staleness": cfg.max_staleness,
        "ray": {"address": None, "trainer": {"tpu": None}, "rollout": {"tpu": None}},
    }
    merged = yaml.safe_load(recipe_yaml(recipe.RECIPE, yaml.safe_dump(overlay, sort_keys=False)))
    for role in ("trainer", "rollout"):  # the recipe's custom resources (its cluster's node labels) go: mappings merge
        merged["ray"][role]["resources"] = {}
    return yaml.safe_dump(merged, sort_keys=False)


def _model_overlay(cfg: RehearsalConfig, checkpoint: str) -> dict:
    dims = SCALES[cfg.scale]
    if cfg.init == "hf":
        return {"hf_checkpoint": checkpoint, "vocab_size": dims["vocab_size"]}
    return {"hf_checkpoint": None, "tokenizer": checkpoint, "vocab_size": dims["vocab_size"], "seed": 0,
            "model": {"hidden_dim": dims["hidden_size"], "intermediate_dim": dims["intermediate_size"],
                      "num_layers": dims["num_hidden_layers"], "num_heads": dims["num_attention_heads"],
                      "num_kv_heads": dims["num_key_value_heads"], "head_dim": dims["head_dim"]}}


def run_job_child(yaml_path: str, result_path: str) -> None:
    """The job's process (`python -c`): parse the YAML as a recipe does, run it, write its JobResult."""
    from marinrl.recipe import parse_recipe, run_job

    config = parse_recipe(pathlib.Path(yaml_path).read_text(), [])
    result = run_job(config)
    pathlib.Path(result_path).write_text(json.dumps(dataclasses.asdict(result), default=str))


# ------------------------------------------------------------------ the jobs


def _session(sid: int) -> set[int]:
    """The processes of the job's session (it starts one): Ray's GCS, raylet and actors stay in it, and are
    found there even after the job's process died and left them to init."""
    import psutil

    out = set()
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                out.add(pid)
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _refused_weights(rollout_log: pathlib.Path) -> Optional[str]:
    """The rollout worker's last refusal of the trainer's weights once it has refused 10 (a dtype or shape
    its model does not take: it would wait for weights until the job's timeout)."""
    try:
        with rollout_log.open("rb") as f:
            f.seek(max(0, rollout_log.stat().st_size - 20_000))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        m = re.search(r"weight transfer from .* failed \((\d+) so far\)", line)
        if m:
            return line if int(m[1]) >= 10 else None
    return None


def _wait_for(condition, what: str, proc: subprocess.Popen, log: pathlib.Path, timeout_s: float,
              rollout_log: Optional[pathlib.Path] = None) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        refused = _refused_weights(rollout_log) if rollout_log is not None else None
        if refused:
            raise RuntimeError(f"the rollout worker cannot load the trainer's weights (waiting for {what}):\n{refused}")
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited ({proc.returncode}) while waiting for {what}; its log "
                               f"{log} ends:\n{log.read_text()[-4000:]}")
        if time.time() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s:.0f} s; the job's log {log}")
        time.sleep(0.2)


def start_job(yaml_path: pathlib.Path, result_path: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    code = f"import sys; sys.path.insert(0, {str(_BENCH)!r}); import rehearsal; " \
           f"rehearsal.run_job_child({str(yaml_path)!r}, {str(result_path)!r})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True,  # its actors measure their programs' constants
                            env={**os.environ, "MARINRL_AUDIT_PROGRAMS": "1", **MEMORY_ENV})


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the job's process, then what it started (Ray's GCS, raylet, the actors), as a lost host."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    started = _session(proc.pid)
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 60
    while any(_alive(p) for p in started) and time.time() < deadline:
        time.sleep(0.2)


# ------------------------------------------------------------------ main


def main(cfg: RehearsalConfig) -> dict:

    started = time.time()
    tmp = tempfile.TemporaryDirectory(prefix="marinrl-rehearsal-") if cfg.root is None else None
    root = pathlib.Path(cfg.root or tmp.name).resolve()
    try:
        if cfg.mismatch_only:
            report = {"scale": cfg.scale, "init": cfg.init, "backend": cfg.backend,
                      "mismatch": mismatch_phase(cfg, root, write_checkpoint(cfg, root)),
                      "total_s": round(time.time() - started, 1)}
            print(json.dumps(report), flush=True)
            return report
        if not cfg.report_only:
            rehearse(cfg, root)
        report = read_report(cfg, root)
    finally:
        if tmp is not None:
            tmp.cleanup()
    report["total_s"] = round(time.time() - started, 1)
    print_phases(report)
    print(json.dumps(report), flush=True)
    return report


def rehearse(cfg: RehearsalConfig, root: pathlib.Path) -> None:
    """Write the checkpoint, run the job until its checkpoint after `kill_after` steps, SIGKILL it, resume
    it to the end. What only the run can see (peak RSS by role, wall times, the machine and its load, the
    log lines each job wrote) goes to `root/watched.json`; the rest is read back from the run folder."""
    from e2e import RssWatcher
    from machine import machine

    from marinrl.train.checkpoints import DIGEST

    watched = {"machine": machine(), "phases": {}}
    phases = watched["phases"]
    t = time.time()
    yaml_path = write_checkpoint(cfg, root)
    phases["write_hf_checkpoint"] = round(time.time() - t, 1)
    run_dir = root / f"rehearsal-{cfg.scale}"
    ckpts = run_dir / "checkpoints"

    log1, result1 = root / "job-1.log", root / "result-1.json"
    t = time.time()
    with RssWatcher() as rss1:
        proc = start_job(yaml_path, result1, log1)
        try:
            # the digest is the save's last file (after Levanter's commit): a checkpoint a resume trusts
            committed = lambda: (newest_checkpoint(ckpts, DIGEST) or 0) >= cfg.kill_after  # noqa: E731
            _wait_for(committed, f"checkpoint at step {cfg.kill_after}", proc, log1, cfg.job_timeout_s,
                      run_dir / "logs" / "rollout-0.log")
            watched["killed_at"] = newest_checkpoint(ckpts, DIGEST)
        finally:
            kill_job(proc)
    phases["job_until_kill"] = round(time.time() - t, 1)
    watched["log_offsets"] = run_logs(run_dir / "logs").offsets

    log2, result2 = root / "job-2.log", root / "result-2.json"
    t = time.time()
    with RssWatcher() as rss2:
        proc = start_job(yaml_path, result2, log2)
        try:
            _wait_for(lambda: result2.exists(), "result of the resumed job", proc, log2, cfg.job_timeout_s)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                kill_job(proc)
    phases["resume_job"] = round(time.time() - t, 1)
    watched.update(peaks_mb=[rss1.peaks, rss2.peaks], load_avg_end=round(os.getloadavg()[0], 2))
    if cfg.mismatch:
        t = time.time()
        mismatch_phase(cfg, root, yaml_path)
        phases["mismatch"] = round(time.time() - t, 1)
    (root / "watched.json").write_text(json.dumps(watched))


def write_checkpoint(cfg: RehearsalConfig, root: pathlib.Path) -> pathlib.Path:
    """The HF checkpoint (in a child process) and the job's YAML under `root`; returns the YAML's path."""
    import multiprocessing

    root.mkdir(parents=True, exist_ok=True)
    checkpoint = root / "hf-checkpoint"
    writer = multiprocessing.get_context("spawn").Process(
        target=write_hf_checkpoint,
        args=(str(checkpoint), cfg.scale, cfg.checkpoint_dtype, 0, cfg.init == "hf"))
    writer.start()
    writer.join()
    if writer.exitcode != 0:
        raise RuntimeError(f"writing the HF checkpoint to {checkpoint} failed (exit {writer.exitcode})")
    yaml_path = root / "job.yaml"
    yaml_path.write_text(job_yaml(cfg, str(root), str(checkpoint)))
    return yaml_path


def mismatch_phase(cfg: RehearsalConfig, root: pathlib.Path, yaml_path: pathlib.Path) -> dict:
    """bench/rehearsal_mismatch.py on the job's YAML: the lesson's prompts × samples, both heads."""
    from rehearsal_mismatch import run_phase

    assert yaml_path == root / "job.yaml", yaml_path
    return run_phase(root, cfg.groups, cfg.generations, cfg.max_tokens, temperature=1.0,
                     timeout_s=cfg.job_timeout_s, env={**os.environ, **MEMORY_ENV})


if __name__ == "__main__":
    main(draccus.parse(RehearsalConfig))
