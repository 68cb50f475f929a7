"""The chaos soak: a job of a few hundred steps during which a seeded schedule SIGKILLs the trainer, the
rollout worker, the curriculum actor and the driver at random moments (and, once, corrupts the newest
checkpoint between a death and the restart), restarting the job with the same config each time the driver
dies or the job ends with its trainer's death. It then reads the run's audit trail (marinrl/train/audit.py)
and prints one JSON line: kills per target, restarts, steps, groups trained, lost and duplicated, the
longest stall between trained steps, the final held-out eval, the machine and the seed (docs/training.md,
"The chaos soak").

    python bench/chaos.py [--steps 300] [--kills 12] [--seed 0] [--workdir DIR] [--keep]

The job is experiments/quickstart.yaml (the echo task) checkpointing every `--checkpoint_every` steps. The
driver is `python -m marinrl.cli train` in its own session; every process it starts carries a marker in
its environment, so the harness finds the actors by their Ray process titles among those processes only,
and removes a killed driver's local Ray before the restart without touching any other Ray on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psutil
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

TARGETS = ("trainer", "rollout", "curriculum", "driver")
TITLES = {"trainer": "ray::TrainerActor", "rollout": "ray::RolloutActor", "curriculum": "ray::CurriculumActor"}
MARKER = "MARINRL_CHAOS_RUN"


@dataclasses.dataclass
class Kill:
    target: str
    at_step: int
    """Fires once the live trainer has recorded this step, after `delay_s` more."""
    delay_s: float


def schedule(seed: int, kills: int, steps: int) -> list[Kill]:
    """`kills` kills, each target in turn from shuffled rounds of the four (so three kills hit three
    different targets and four hit all), at steps drawn uniformly from [3, steps - 3], sorted."""
    rng = random.Random(seed)
    targets: list[str] = []
    while len(targets) < kills:
        targets += rng.sample(TARGETS, len(TARGETS))
    at = sorted(rng.randint(3, max(3, steps - 3)) for _ in range(kills))
    return [Kill(t, s, round(rng.uniform(0.0, 2.0), 2)) for t, s in zip(targets[:kills], at)]


def job_yaml(workdir: pathlib.Path, steps: int, checkpoint_every: int, overrides: dict) -> tuple[pathlib.Path, dict]:
    config = yaml.safe_load((ROOT / "experiments" / "quickstart.yaml").read_text())
    config.update(run_id="chaos", run_root=str(workdir / "runs"), num_train_steps=steps,
                  checkpoint_every=checkpoint_every, **overrides)
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


class Job:
    """The driver subprocess and the processes it started (found by the marker in their environment)."""

    def __init__(self, workdir: pathlib.Path, config: pathlib.Path, marker: str):
        self.workdir, self.config, self.marker = workdir, config, marker
        # Ray's sockets live under its temp dir and a Unix socket path has 107 bytes at most: a short one
        self.ray_tmp = tempfile.mkdtemp(prefix="chaos-ray-", dir="/tmp")
        self.proc: subprocess.Popen | None = None
        self.logs: list[pathlib.Path] = []

    def start(self) -> None:
        log = self.workdir / f"driver-{len(self.logs)}.log"
        self.logs.append(log)
        env = {**os.environ, MARKER: self.marker, "RAY_TMPDIR": self.ray_tmp,
               "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
               "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                           str(self.workdir / "jax_cache"))}
        self.proc = subprocess.Popen([sys.executable, "-m", "marinrl.cli", "train", str(self.config)], cwd=self.workdir,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def processes(self) -> list[psutil.Process]:
        mine = []
        for p in psutil.process_iter(["pid"]):
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get(MARKER) == self.marker:
                    mine.append(p)
            except (psutil.Error, OSError):  # gone, a zombie, or another user's
                continue
        return mine

    def actor(self, target: str) -> psutil.Process | None:
        for p in self.processes():
            try:
                if " ".join(p.cmdline()).startswith(TITLES[target]):
                    return p
            except psutil.Error:
                continue
        return None

    def clean_up(self) -> int:
        """SIGKILL every process of this soak's jobs still alive (a killed driver's Ray); returns how many."""
        left = self.processes()
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=30)
        return len(left)

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.logs[-1].read_text(errors="replace").splitlines()[-lines:])


def newest_step(trained: pathlib.Path) -> int:
    """The newest step the live trainer (the newest incarnation) recorded; 0 before any."""
    try:
        incarnations = sorted(p for p in trained.iterdir() if p.is_dir())
    except FileNotFoundError:
        return 0
    if not incarnations:
        return 0
    steps = [int(p.name[5:13]) for p in incarnations[-1].glob("step-*.json")]
    return max(steps, default=0)


def corrupt_newest_checkpoint(checkpoints: pathlib.Path) -> str | None:
    """Truncate the largest model chunk (zarr) of the newest committed checkpoint, if an older committed one
    exists to fall back to; returns the file damaged, or None (nothing to fall back to yet)."""
    committed = sorted((p for p in checkpoints.glob("step-*") if (p / "metadata.json").exists()),
                       key=lambda p: int(p.name[5:]))
    if len(committed) < 2:
        return None
    chunks = [f for f in (committed[-1] / "model").rglob("*") if f.is_file() and not f.name.startswith(".")]
    if not chunks:
        return None
    victim = max(chunks, key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: max(1, victim.stat().st_size // 3)])
    return str(victim)


EVAL_LINE = re.compile(r"eval at weight step (\d+): .*?eval/echo/reward_mean: ([0-9.nan]+)")


def soak(args) -> dict:
    from machine import machine

    from marinrl.train.audit import audit, lineage, read_trail

    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    path, config = job_yaml(workdir, args.steps, args.checkpoint_every, args.override)
    job = Job(workdir, path, uuid.uuid4().hex)
    run_dir = workdir / "runs" / "chaos"
    plan = schedule(args.seed, args.kills, args.steps)
    started = time.monotonic()
    print(f"[chaos] {workdir}: {[dataclasses.astuple(k) for k in plan]}", file=sys.stderr, flush=True)
    kills = {t: 0 for t in TARGETS}
    restarts, exits, corrupted, cleaned, last_progress = 0, [], None, 0, time.monotonic()
    dying = False  # a kill since the driver started that ends the job (the trainer's or the driver's)
    last_step = 0
    job.start()
    try:
        while True:
            step = newest_step(run_dir / "trained")
            if step != last_step:
                last_step, last_progress = step, time.monotonic()
            if time.monotonic() - last_progress > args.hang_s:
                raise RuntimeError(f"no trained step for {args.hang_s:.0f} s at step {step}: a hang (logs: {workdir})")
            rc = job.proc.poll()
            if rc is not None:
                exits.append(rc)
                if rc == 0:
                    break
                if not dying:  # no kill of ours ended it: a failure to report, not to restart
                    raise RuntimeError(f"the driver exited {rc} on its own (log {job.logs[-1]}):\n{job.log_tail()}")
                if len(exits) > args.kills + 3:
                    raise RuntimeError(f"the driver keeps exiting ({exits}); logs: {workdir}")
                cleaned += job.clean_up()
                corrupted = corrupted or corrupt_newest_checkpoint(run_dir / "checkpoints")
                restarts += 1
                print(f"[chaos {time.monotonic() - started:6.1f}s] driver exited {rc}; restart {restarts}",
                      file=sys.stderr, flush=True)
                job.start()
                last_progress, dying = time.monotonic(), False
                continue
            if plan and step >= plan[0].at_step:
                kill = plan[0]
                time.sleep(kill.delay_s)
                if kill.target == "driver":
                    os.kill(job.proc.pid, signal.SIGKILL)
                    job.proc.wait()
                    kills["driver"] += 1
                    plan.pop(0)
                    dying = True
                    print(f"[chaos {time.monotonic() - started:6.1f}s] step {step}: SIGKILL driver", file=sys.stderr,
                          flush=True)
                    continue  # the exit above restarts it
                victim = job.actor(kill.target)
                if victim is not None:
                    try:
                        victim.kill()
                        kills[kill.target] += 1
                        plan.pop(0)
                        dying = dying or kill.target == "trainer"
                        print(f"[chaos {time.monotonic() - started:6.1f}s] step {step}: "
                              f"SIGKILL {kill.target} (pid {victim.pid})", file=sys.stderr, flush=True)
                    except psutil.Error:
                        pass
            time.sleep(0.2)
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
        job.clean_up()
        shutil.rmtree(job.ray_tmp, ignore_errors=True)
    left = len(job.processes())
    seconds = time.monotonic() - started
    trail = read_trail(str(run_dir / "trained"))
    counts = audit(trail, num_steps=args.steps, groups_per_step=config["groups_per_step"],
                   max_staleness=config["max_staleness"], max_uses=config.get("max_uses", 1))
    lin = lineage(trail)
    trainer_log = run_dir / "logs" / "trainer.log"  # the resumes' "does not load" warnings (checkpoints.py)
    skipped = trainer_log.read_text().count("does not load, trying the one before it") if trainer_log.exists() else 0
    final_eval = None
    for line in job.logs[-1].read_text().splitlines():
        m = EVAL_LINE.search(line)
        if m:
            final_eval = {"weight_step": int(m.group(1)), "reward_mean": float(m.group(2))}
    return {"kills": kills, "restarts": restarts, "steps": counts.steps, "groups_trained": counts.groups_trained,
            "groups_lost": counts.groups_lost, "groups_duplicated": counts.groups_duplicated,
            "max_stall_s": counts.max_stall_s, "final_eval": final_eval, "missing_steps": counts.missing_steps,
            "lineage": {"incarnations": len(trail), "chain": len(lin.chain), "resumes": sorted(lin.resumes),
                        "rolled_back_steps": len(lin.rolled_back), "broken": lin.broken},
            "corrupted": corrupted, "checkpoints_skipped_on_resume": skipped, "driver_exits": exits,
            "processes_cleaned_up": cleaned, "processes_left": left,
            "seconds": round(seconds, 1), "seed": args.seed, "machine": machine(), "workdir": str(workdir)}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kills", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint_every", type=int, default=10)
    p.add_argument("--hang_s", type=float, default=600.0, help="give up after this long without a trained step")
    p.add_argument("--override", type=json.loads, default={},
                   help="JSON of job config fields over the quickstart's (e.g. '{\"groups_per_step\": 8}')")
    p.add_argument("--workdir", help="where the run and the logs go (default: a new /tmp/chaos-*)")
    p.add_argument("--keep", action="store_true", help="keep the workdir (kept anyway when something failed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    result = soak(args)
    print(json.dumps(result), flush=True)
    ok = result["groups_lost"] == 0 and result["groups_duplicated"] == 0 and result["steps"] == args.steps
    if ok and not args.keep and not args.workdir:
        shutil.rmtree(result["workdir"], ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
