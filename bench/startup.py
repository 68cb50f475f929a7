"""The first answer of `marinrl train`: how long a config mistake takes to be reported, and the driver's peak
RSS, measured on fresh processes (the config layer of docs/architecture.md, "Layers").

Rows, each a fresh interpreter, repeated `--repeats` times in alternating order:
- `range error`: `marinrl train experiments/quickstart.yaml --max_staleness -1` (a range the config checks);
- `unknown field`: `--trainer.num_train_steps 3` (a field the job derives: refused while parsing);
- `valid config, checked`: the quickstart parsed and checked (`RLJobConfig.validate`), what a job whose checks
  need no model build costs the driver before anything heavy;
- `runtime imported first`: the same parse and check after importing the trainer's and the rollout worker's
  modules with Ray (JAX, Levanter, transformers), which is what `import marinrl.job.rl_job` did before the config
  layer and every `marinrl train` paid before its first check: the paired baseline;
- `driver imported`: the same after `import marinrl.job.rl_job` as it is now (Ray, no JAX).
- `preflight error`: `--model.hf_checkpoint /nonexistent` (needs the runtime: answered after the imports).

Prints one line per row (median seconds and peak RSS of the process) and the paired ratio of `valid config,
checked` against `runtime imported first`, with the machine kind. Usage: `python bench/startup.py [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
sys.path.insert(0, str(ROOT / "bench"))

CHECK = ("from marinrl.config.errors import load_job_config; from marinrl.config.job import RLJobConfig; "
         f"load_job_config(RLJobConfig, {str(QUICKSTART)!r}, []).validate()")
ROWS = {
    "range error": ["-m", "marinrl.cli", "train", str(QUICKSTART), "--max_staleness", "-1"],
    "unknown field": ["-m", "marinrl.cli", "train", str(QUICKSTART), "--trainer.num_train_steps", "3"],
    "valid config, checked": ["-c", CHECK],
    "runtime imported first": ["-c", "import ray, marinrl.train.worker, marinrl.rollout.worker; " + CHECK],
    "driver imported": ["-c", "import marinrl.job.rl_job; " + CHECK],
    "preflight error": ["-m", "marinrl.cli", "train", str(QUICKSTART), "--model.hf_checkpoint", "/nonexistent"],
}


def run_once(args: list[str]) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS bytes, exit status, last stderr line) of one fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=ROOT, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().strip().splitlines()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return seconds, usage.ru_maxrss * 1024, proc.returncode, err[-1] if err else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in ROWS}
    said: dict[str, tuple[int, str]] = {}
    names = list(ROWS)
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):  # alternate the order: drift hits every row alike
            seconds, rss, status, line = run_once(ROWS[name])
            samples[name].append((seconds, rss))
            said[name] = (status, line)
    from machine import machine

    print(json.dumps({"machine": machine(), "repeats": args.repeats}))
    for name in names:
        seconds = statistics.median(s for s, _ in samples[name])
        rss = max(m for _, m in samples[name])
        status, line = said[name]
        print(f"{name:24s} {seconds:6.2f} s  peak RSS {rss / 2**30:5.2f} GiB  exit {status}  {line[:110]}")
    fast = [s for s, _ in samples["valid config, checked"]]
    slow = [s for s, _ in samples["runtime imported first"]]
    ratios = [a / b for a, b in zip(fast, slow)]
    print(f"paired ratio, checked without / after the runtime imports: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
