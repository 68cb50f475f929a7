"""No thread of ours outlives its owner: a process that builds and stops the package's thread owners (the
replay buffer with its ingestion thread and its reader's read threads, a trainer's wait for a batch, the run
lock's renewal, a verifiers bridge process's reader) exits by itself, and holds no non-daemon thread but its
main one once they are stopped. A thread left waiting would keep the interpreter from exiting after pytest's
summary: a hang no per-test timeout covers."""

from __future__ import annotations

import json
import subprocess
import sys
import time

SCRIPT = r'''
import json, sys, threading

import numpy as np

from marinrl.config.replay import ReplayConfig
from marinrl.envs.verifiers_process import BridgeProcess
from marinrl.job.run_lock import RunLock
from marinrl.storage.rollouts import RolloutReader, RolloutWriter
from marinrl.train.replay.buffer import ReplayBuffer
from marinrl.types import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata

root = sys.argv[1]


def batch(i):
    rollouts = tuple(Rollout(prompt_tokens=np.arange(1, 3), response_tokens=np.full(3, 7),
                             response_logprobs=np.full(3, -0.5), temperature=1.0, loss_mask=np.ones(3),
                             token_rewards=np.r_[0.0, 0.0, r], episode_reward=r, finish_reason="stop",
                             env_name="math", lesson_id="math", group_id=f"g{i}",
                             metadata=RolloutMetadata("w0", 0, 1000.0)) for r in (0.0, 1.0))
    return RolloutBatch((RolloutGroup(rollouts),), RolloutMetadata("w0", 0, 1000.0))


writer = RolloutWriter(f"{root}/rollouts")
for i in range(4):  # several files: the reader reads them on its pool of threads
    writer.write(batch(i))
buf = ReplayBuffer(ReplayConfig(poll_interval_s=0.01, timeout_s=3600), RolloutReader(f"{root}/rollouts"))
# no ingestion thread yet: this (non-daemon) thread reads the files itself, on the reader's pool, whose threads
# are then non-daemons too
assert len(buf.sample(0, 2).groups) == 2
buf.start()
stop = threading.Event()
# a trainer's wait for a batch that never comes (100 groups of 4 files), on a thread of its own like the trainer's
waiter = threading.Thread(target=buf.sample, args=(0, 100), kwargs={"stop": stop}, name="trainer-wait")
waiter.start()
lock = RunLock(f"{root}/run", "exit-test")
lock.acquire()
bridge = BridgeProcess([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"], {},
                       f"{root}/bridge.log", "test bridge")
assert bridge.first_line(60) == "ready"
started = sorted(t.name for t in threading.enumerate())
stop.set()
buf.stop()
lock.release()
bridge.stop()
waiter.join(30)
left = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
print(json.dumps({"started": started, "left": left}), flush=True)
'''


def test_a_process_that_stops_its_thread_owners_exits_with_no_thread_of_ours_left(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # generous: importing JAX on a loaded machine; a hang is never seen to end
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the process did not exit within 300 s of starting; it printed {out!r}, {err[-2000:]!r}")
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    report = json.loads(out.strip().splitlines()[-1])
    started = report["started"]
    assert "replay-ingest" in started and "trainer-wait" in started and "run-lock-exit-test" in started, started
    assert any(name.startswith("rollout-read") for name in started), started
    assert report["left"] == [], report
