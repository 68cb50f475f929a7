"""bench/rehearsal.py's report: the figures of a finished rehearsal, read back from its folder
(`watched.json`, the resumed job's `result-2.json`, the run folder's logs, checkpoints and weights), and
the dry run's prediction to set beside them. A figure that cannot be had is None, with a line in
`not_available` saying why."""

from __future__ import annotations

import json
import pathlib
from typing import Optional

from rehearsal_logs import (
    checkpoint_seconds,
    newest_checkpoint,
    packed_elements,
    process_stats,
    published_versions,
    run_logs,
)

GiB = float(1 << 30)


def predicted_peak_gib(config_yaml: str, devices: int) -> tuple[dict, list[str]]:
    """Per role, the dry run's predicted peak per process (GiB), where `marinrl.dry_run` has it."""
    import marinrl.dry_run as dry_run
    from marinrl.recipe import parse_recipe

    if not hasattr(dry_run, "predicted_memory"):
        return ({"trainer": None, "rollout": None},
                ["predicted_peak_gib: marinrl.dry_run.predicted_memory is not available yet"])
    job = parse_recipe(config_yaml, [])
    out, missing = {}, []
    for role in ("trainer", "rollout"):
        try:
            plan = dry_run.predicted_memory(job, role, n_devices=devices, cpu=True)  # fake CPU devices
            out[role] = round(plan.peak_bytes_per_process / GiB, 3)
        except Exception as e:  # the prediction is reported, not trusted: say why it is missing
            out[role] = None
            missing.append(f"predicted_peak_gib.{role}: {type(e).__name__}: {e}")
    return out, missing


def read_report(cfg, root: pathlib.Path) -> dict:
    """The rehearsal's figures from `root`: watched.json, the resumed job's result, the run folder."""
    watched_path = root / "watched.json"
    if not watched_path.exists():
        raise FileNotFoundError(f"{watched_path}: no finished rehearsal under {root}")
    watched = json.loads(watched_path.read_text())
    run_dir = root / f"rehearsal-{cfg.scale}"
    logs1 = run_logs(run_dir / "logs", until=watched["log_offsets"])
    logs2 = run_logs(run_dir / "logs", after=logs1)
    predicted, missing = predicted_peak_gib((root / "job.yaml").read_text(), cfg.devices)
    report = _report(cfg, json.loads((root / "result-2.json").read_text()), watched["killed_at"], logs1, logs2,
                     watched["peaks_mb"], predicted, missing, run_dir, root / "hf-checkpoint", watched["phases"])
    report.update(machine=watched["machine"], load_avg_end=watched["load_avg_end"])
    report["mismatch"] = _mismatch(root, logs1, logs2, report["not_available"])
    return report


def _mismatch(root: pathlib.Path, logs1, logs2, missing: list) -> Optional[dict]:
    """The mismatch phase's figures (bench/rehearsal_mismatch.py: both heads, strict precision), with the job's own
    per-step `train/mismatch/*` (its bfloat16 head, XLA:CPU's default precision; medians over the steps) beside
    them as `job_bf16_head`."""
    path = root / "mismatch.json"
    if not path.exists():
        missing.append("mismatch: no mismatch phase ran (--mismatch false)")
        return None
    out = json.loads(path.read_text())
    job = {k: _median(logs1.metric(f"train/mismatch/{k}") + logs2.metric(f"train/mismatch/{k}"))
           for k in ("k3_kl", "abs_logprob_mean", "abs_logprob_max")}
    out["job_bf16_head"] = job if any(v is not None for v in job.values()) else None
    return out


def _report(cfg, result, killed_at, logs1, logs2, watched, predicted, missing, run_dir, checkpoint, phases) -> dict:
    versions = published_versions(run_dir / "weights")
    params = _param_count(checkpoint, versions)
    snapshots = [v for v in versions if v["kind"] == "snapshot"]
    deltas = [v for v in versions if v["kind"] == "delta"]
    ckpt_step = newest_checkpoint(run_dir / "checkpoints", "metadata.json")
    ckpt_dir = run_dir / "checkpoints" / f"step-{ckpt_step - 1}" if ckpt_step else None
    train = result["train"]
    procs = process_stats(result)  # the actors' `process` dicts (the resumed job's), where the job gives them
    missing = list(missing)
    measured = {}
    for role in ("trainer", "rollout"):
        before_model = [logs.rss_before_model_mb(role) for logs in (logs1, logs2)]
        peaks = [w.get(role) for w in watched]
        from_logs = [p - b for p, b in zip(peaks, before_model) if p is not None and b is not None]
        stats = procs.get(role) or {}
        if stats.get("peak_rss_bytes") is not None and stats.get("rss_before_model_bytes") is not None:
            measured[role] = (stats["peak_rss_bytes"] - stats["rss_before_model_bytes"]) / GiB
        elif from_logs:
            measured[role] = max(from_logs) / 1024
        else:
            measured[role] = None
            missing.append(f"measured_peak_gib.{role}: no VmHWM sample or `startup:` line")
    if not procs:
        missing.append("measured_peak_gib: the job's results carry no `process` stats yet; VmHWM sampled from "
                       "/proc minus the `startup:` line's RSS before the model, the larger of the two jobs")
    hf_reads = {r: s.get("hf_reads") for r, s in procs.items()} or None
    jit_constants = [s.get("jit_constant_bytes") for s in procs.values() if s.get("jit_constant_bytes") is not None]
    if hf_reads is None or None in hf_reads.values():
        missing.append("hf_reads_per_process: the actors' `process.hf_reads` is not available yet")
    if not jit_constants:
        missing.append("jit_constant_bytes: the actors' `process.jit_constant_bytes` is not available yet")
    t1, t2 = logs1.trainer_startup(), logs2.trainer_startup()
    r1 = logs1.rollout_startup()
    updates = logs1.metric("train/update_s")  # the first includes its compile
    train_update = _median(updates[1:] or updates)
    return {
        "scale": cfg.scale, "init": cfg.init, "delta": cfg.delta, "max_staleness": cfg.max_staleness,
        "devices": cfg.devices, "backend": cfg.backend,
        "steps_trained": train["final_step"], "killed_at_step": killed_at,
        "resumed": train.get("resumed_from") is not None, "resumed_from": train.get("resumed_from"),
        "params": params, "rollout_dtype": _published_dtype(versions),
        "weight_bytes_per_version": snapshots[-1]["bytes"] if snapshots else None,
        "delta_bytes": [v["bytes"] for v in deltas], "f32_weight_bytes": params * 4,
        "checkpoint_bytes": _du(ckpt_dir) if ckpt_dir else None,
        "jit_constant_bytes": max(jit_constants) if jit_constants else None,
        "hf_reads_per_process": max(hf_reads.values()) if hf_reads and None not in hf_reads.values() else None,
        "hf_reads": hf_reads,
        "hf_read_bytes": {r: s.get("hf_read_bytes") for r, s in procs.items()} or None,
        # marinrl's "Reading N tensors from <checkpoint>: B of T bytes" lines in the first job's trainer log
        # (one per load; the rollout worker's log carries marinrl's INFO lines only).
        "hf_reads_logged": {"trainer": logs1.count("hf_checkpoints: Reading", "trainer")},
        "predicted_peak_gib": predicted,
        "measured_peak_gib": {r: None if v is None else round(v, 3) for r, v in measured.items()},
        "peak_rss_gib": {r: round(max(w.get(r, 0) for w in watched) / 1024, 3) for r in ("trainer", "rollout")},
        "phases_s": {
            **phases,
            "trainer_load": t1.get("state"), "trainer_first_update": t1.get("first_update"),
            "trainer_compile": _minus(t1.get("first_update"), train_update),
            "trainer_startup_total": t1.get("total"),
            "rollout_load": r1.get("model"), "rollout_first_eval": r1.get("first_eval"),
            "rollout_startup_total": r1.get("total"),
            "generate": _median(logs1.metric("rollout/generation_s") + logs2.metric("rollout/generation_s")),
            "train_update": train_update,
            "publish": _median(logs1.metric("train/publish_s")),
            "checkpoint": checkpoint_seconds(ckpt_dir) if ckpt_dir else None,
            "resume_load": t2.get("state"), "resume_first_step": t2.get("total"),
        },
        "startup": {"trainer": _phases(t1), "rollout": _phases(r1), "trainer_resumed": _phases(t2),
                    "rollout_resumed": _phases(logs2.rollout_startup())},
        "not_available": missing,
    }


def _param_count(checkpoint: pathlib.Path, versions: list[dict]) -> int:
    """Parameters of the HF checkpoint; without one (`init: scratch`), of the first published snapshot."""
    from safetensors import safe_open

    if not list(checkpoint.glob("*.safetensors")):
        return packed_elements(versions[0]["path"]) if versions else 0

    n = 0
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                size = 1
                for d in shape:
                    size *= d
                n += size
    return n


def _published_dtype(versions: list[dict]) -> Optional[str]:
    dtypes = {d for v in versions for d in v.get("float_dtypes", ())}
    return dtypes.pop() if len(dtypes) == 1 else (",".join(sorted(dtypes)) or None)


def _du(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _minus(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else round(a - b, 2)


def _phases(startup: dict) -> dict:
    """A `startup:` line's phase seconds (RSS figures left out)."""
    return {k: v for k, v in startup.items() if isinstance(v, float)}


def _median(values: list) -> Optional[float]:
    values = sorted(v for v in values if v is not None)
    return round(values[len(values) // 2], 3) if values else None


def print_phases(report: dict) -> None:
    m = report["machine"]
    print(f"\nrehearsal ({report['scale']}, {report['params'] / 1e6:.1f}M params) on {m['cpu']} ({m['cpus']} CPUs; "
          f"{m['flags']}), load average {m['load_avg']} before, {report['load_avg_end']} after")
    for k, v in report["phases_s"].items():
        print(f"  {k:24s} {'-' if v is None else f'{v:.2f} s'}")
    for line in report["not_available"]:
        print(f"  [not available] {line}")
