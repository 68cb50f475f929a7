"""Read-only views of a rollout root: every file with its batch or the error that kept it unread (`iter_batches`),
and the per-step and per-environment summary `marinrl inspect` prints (`summarize`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable

import numpy as np

from marinrl.storage.format import RolloutFormatError, decode_batch
from marinrl.storage.fs import open_root, with_retries
from marinrl.storage.layout import QUARANTINE_DIR, list_files, list_steps, step_dir_name
from marinrl.types import RolloutBatch


def iter_batches(root: str, *, storage_options: dict | None = None,
                 fs=None) -> Iterable[tuple[int, str, RolloutBatch | RolloutFormatError]]:
    """Yields (weight_step, path, batch) for every rollout file under `root`, the batch replaced by the
    error saying why when the file cannot be read (a folder named like one, no permission) or decoded:
    the read-only views (`marinrl inspect`, `report`) list such files instead of stopping at them."""
    fs, root_path = open_root(root, storage_options, fs)
    for step in list_steps(fs, root_path):
        for name in list_files(fs, root_path, step):
            path = f"{root_path}/{step_dir_name(step)}/{name}"
            shown = fs.unstrip_protocol(path)
            try:
                data = with_retries(lambda path=path: fs.cat_file(path), "reading", path)
            except FileNotFoundError:
                continue
            except OSError as e:  # not transient: retrying cannot help
                yield step, shown, RolloutFormatError(f"{shown}: cannot be read ({e!r})")
                continue
            try:
                yield step, shown, decode_batch(data, shown)
            except RolloutFormatError as e:
                yield step, shown, e


def summarize(root: str, *, storage_options: dict | None = None, fs=None) -> dict:
    """What `marinrl inspect` prints: per weight step and per environment, plus unreadable files."""
    fs, root_path = open_root(root, storage_options, fs)
    per_step: dict[int, dict] = {}
    per_env: dict[str, dict] = defaultdict(lambda: {"rollouts": 0, "rewards": [], "lengths": [], "finish": Counter()})
    unreadable = []
    for step, _path, batch in iter_batches(root_path, fs=fs):
        s = per_step.setdefault(step, {"files": 0, "rollouts": 0, "groups": 0, "rewards": []})
        if isinstance(batch, RolloutFormatError):
            unreadable.append(str(batch))
            continue
        s["files"] += 1
        s["groups"] += len(batch.groups)
        for r in batch.rollouts:
            s["rollouts"] += 1
            s["rewards"].append(r.episode_reward)
            e = per_env[r.env_name]
            e["rollouts"] += 1
            e["rewards"].append(r.episode_reward)
            e["lengths"].append(r.response_tokens.size)
            e["finish"][r.finish_reason] += 1
    quarantined = sum(1 for _ in _walk_files(fs, f"{root_path}/{QUARANTINE_DIR}"))

    def stats(values):
        return {"mean": float(np.mean(values)), "std": float(np.std(values))} if values else None

    return {
        "root": root,
        "steps": {
            str(step): {"files": v["files"], "rollouts": v["rollouts"], "groups": v["groups"],
                        "reward": stats(v["rewards"])}
            for step, v in sorted(per_step.items())
        },
        "envs": {
            env: {"rollouts": v["rollouts"], "reward": stats(v["rewards"]), "response_length": stats(v["lengths"]),
                  "finish_reasons": dict(v["finish"])}
            for env, v in sorted(per_env.items())
        },
        "totals": {
            "files": sum(v["files"] for v in per_step.values()),
            "rollouts": sum(v["rollouts"] for v in per_step.values()),
            "groups": sum(v["groups"] for v in per_step.values()),
            "unreadable": len(unreadable),
            "quarantined": quarantined,
        },
        "unreadable": unreadable,
    }


def _walk_files(fs, path: str) -> Iterable[str]:
    fs.invalidate_cache(path)
    try:
        for _, _, files in fs.walk(path):
            yield from files
    except FileNotFoundError:
        return
