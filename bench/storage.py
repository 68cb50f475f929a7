"""Rollout storage throughput: Parquet files (ours) against the same batches pickled.

Both formats are timed per file on the same path (fetch the bytes, decode to a RolloutBatch); one
full `RolloutReader.read_new()` poll (listing included) is reported beside them.

Batches of 64 rollouts × 512 tokens (128 prompt + 384 response, vocab 32k), written to and read
back from file:// and memory://. Prints rollouts/s, MB/s and bytes per rollout for a person, then
one JSON line per filesystem (docs/performance.md).
"""

from __future__ import annotations

import json
import pickle
import statistics
import sys
import tempfile
import time
import uuid

import fsspec
import numpy as np

from marinrl.storage.format import decode_batch
from marinrl.storage.rollouts import RolloutReader, RolloutWriter
from marinrl.types import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata

N_BATCHES, GROUPS, GROUP_SIZE, PROMPT, RESPONSE, VOCAB = 20, 8, 8, 128, 384, 32_000


def make_batches(seed: int = 0) -> list[RolloutBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for b in range(N_BATCHES):
        meta = RolloutMetadata("bench-worker", b, time.time())
        groups = []
        for _ in range(GROUPS):
            gid = uuid.uuid4().hex
            prompt = rng.integers(0, VOCAB, PROMPT)
            rollouts = []
            for _ in range(GROUP_SIZE):
                reward = float(rng.integers(0, 2))
                rewards = np.zeros(RESPONSE, np.float32)
                rewards[-1] = reward
                rollouts.append(Rollout(
                    prompt_tokens=prompt, response_tokens=rng.integers(0, VOCAB, RESPONSE),
                    response_logprobs=-rng.exponential(1.0, RESPONSE).astype(np.float32), temperature=1.0,
                    loss_mask=np.ones(RESPONSE, bool), token_rewards=rewards, episode_reward=reward,
                    finish_reason="stop", env_name="math", lesson_id="math-easy", group_id=gid, metadata=meta))
            groups.append(RolloutGroup(tuple(rollouts)))
        out.append(RolloutBatch(tuple(groups), meta))
    return out


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_parquet(url: str, batches: list[RolloutBatch]) -> tuple[list[float], list[float], int, float]:
    """Per-file write and fetch+decode times, bytes written, and one reader poll over all files."""
    writer = RolloutWriter(url)
    paths: list[str] = []
    write_s = [timed(lambda b=b: paths.append(writer.write(b))) for b in batches]
    fs, _ = fsspec.core.url_to_fs(url)
    read_s = [timed(lambda p=p: decode_batch(fs.cat_file(p), p)) for p in paths]
    reader = RolloutReader(url)
    poll_s = timed(reader.read_new)  # listing + fetch + decode of every file, as the trainer polls
    assert reader.metrics["files_read"] == len(batches)
    return write_s, read_s, writer.bytes_written, poll_s


def bench_pickle(url: str, batches: list[RolloutBatch]) -> tuple[list[float], list[float], int]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    paths, total = [], 0

    def write(b):
        nonlocal total
        data = pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL)
        path = f"{root}/{len(paths):06d}.pkl"
        fs.pipe_file(path, data)
        paths.append(path)
        total += len(data)

    write_s = [timed(lambda b=b: write(b)) for b in batches]
    read_s = [timed(lambda p=p: pickle.loads(fs.cat_file(p))) for p in paths]
    return write_s, read_s, total


def summary(per_batch_s: list[float]) -> dict:
    rates = [GROUPS * GROUP_SIZE / s for s in per_batch_s[2:]]  # the first two warm up caches
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def main() -> None:
    batches = make_batches()
    n_rollouts = N_BATCHES * GROUPS * GROUP_SIZE
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, base in (("file", f"file://{tmp}"), ("memory", f"memory://bench-{uuid.uuid4().hex[:8]}")):
            # Interleave the two formats pair by pair: the machine is shared and noisy.
            pq_w, pq_r, pk_w, pk_r, pq_bytes, pk_bytes, polls = [], [], [], [], 0, 0, []
            for rep in range(3):
                w, r, nb, poll = bench_parquet(f"{base}/parquet-{rep}", batches)
                pq_w += w; pq_r += r; pq_bytes = nb; polls.append(n_rollouts / poll)  # noqa: E702
                w, r, nb = bench_pickle(f"{base}/pickle-{rep}", batches)
                pk_w += w; pk_r += r; pk_bytes = nb  # noqa: E702
            res = {
                "mode": mode,
                "write_rollouts_per_s": summary(pq_w), "read_rollouts_per_s": summary(pq_r),
                "bytes_per_rollout": pq_bytes / n_rollouts,
                "reader_poll_rollouts_per_s": {"median": statistics.median(polls), "min": min(polls),
                                               "max": max(polls)},
                "pickle_write_rollouts_per_s": summary(pk_w), "pickle_read_rollouts_per_s": summary(pk_r),
                "pickle_bytes_per_rollout": pk_bytes / n_rollouts,
            }
            res["read_ratio_vs_pickle"] = (res["pickle_read_rollouts_per_s"]["median"]
                                           / res["read_rollouts_per_s"]["median"])
            res["size_ratio_vs_pickle"] = res["bytes_per_rollout"] / res["pickle_bytes_per_rollout"]
            results.append(res)
            mb = lambda rate, bpr: rate * bpr / 1e6  # noqa: E731
            print(f"[{mode}] {GROUPS * GROUP_SIZE} rollouts × {PROMPT + RESPONSE} tokens per batch, "
                  f"{N_BATCHES} batches × 3")
            for label, prefix, bpr in (("parquet", "", res["bytes_per_rollout"]),
                                       ("pickle ", "pickle_", res["pickle_bytes_per_rollout"])):
                w, r = res[f"{prefix}write_rollouts_per_s"]["median"], res[f"{prefix}read_rollouts_per_s"]["median"]
                print(f"  {label}: write {w:9.0f} rollouts/s ({mb(w, bpr):6.1f} MB/s)   "
                      f"read+decode {r:9.0f} rollouts/s ({mb(r, bpr):6.1f} MB/s)   {bpr:8.0f} bytes/rollout")
            print(f"  RolloutReader.read_new over all {N_BATCHES} files (listing included): "
                  f"{res['reader_poll_rollouts_per_s']['median']:.0f} rollouts/s")
            print(f"  pickle reads {res['read_ratio_vs_pickle']:.2f}× faster (target ≤ 2); "
                  f"parquet files are {res['size_ratio_vs_pickle']:.2f}× pickle's size (target ≤ 1)")
    for res in results:
        print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
