"""What the driver tells a user about a trainer that died or stopped: what it died of, and what to do (fix an
input, free memory or disk, or run the same config again to resume from the checkpoint named)."""

from __future__ import annotations

import os
import re
from typing import Optional

import ray

from marinrl.job.trainer_group import TrainerGroupDied


def stopped_line(result: dict) -> str:
    """What a trainer stopped by Ctrl-C left: the checkpoint a rerun resumes from."""
    if result.get("checkpoint"):
        return (f"stopped at step {result['final_step']}; checkpoint {result['checkpoint']}; run the same config "
                "again to resume")
    if result.get("resumed_from"):  # stopped before its first step: the checkpoint it started from still holds
        return (f"stopped at step {result['final_step']} before training a step (nothing new to checkpoint); run "
                f"the same config again to resume from {result['resumed_from']}")
    return (f"stopped at step {result['final_step']} before training a step: no checkpoint yet, running the config "
            "again starts from step 0")


# Errors a rerun with the same config repeats: the config or an input it names must change first.
_INPUT_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, NotADirectoryError, PermissionError)


def trainer_death_message(error: Exception, checkpoints: str) -> str:
    """What the trainer died of and what to do: fix an input error; resume from a checkpoint that
    exists (named); or know that a rerun starts from step 0."""
    cause = getattr(error, "cause", None)  # RayTaskError: the trainer's own exception
    if isinstance(error, TrainerGroupDied):  # which process died, and what the others said (several lines)
        what = str(error)
    else:
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(error)
        what = what.strip().splitlines()[0] if what.strip() else type(error).__name__
    latest = _latest_checkpoint(checkpoints)
    after_resume = re.search(r"after resuming from (\S+?):", what)
    if killed_for_memory(error):
        what = memory_kill_line(error)
        advice = memory_advice(error) + (f"; then run the same config again (it resumes from {latest})" if latest
                                         else "")
    elif after_resume:  # a rerun would load the same state and fail the same way
        advice = (f"move {after_resume.group(1)} out of {checkpoints} and run the same config again (it resumes "
                  "from the checkpoint before it); if the loss is still NaN, lower optimizer.learning_rate")
    elif "Loss is NaN" in what or "Loss is Inf" in what:
        advice = ("the loss diverged: lower optimizer.learning_rate (or check the loss settings), then run the "
                  "config again" + (f" (it resumes from {latest})" if latest else ""))
    elif "superseded" in what:  # a newer trainer publishes to this run's weights: a rerun would fight it
        advice = ("another job's trainer publishes to this run now: do not run this config again while it runs "
                  "(`marinrl lock show <run_dir>` names the job holding the run)")
    elif _is_disk_full(cause if isinstance(cause, BaseException) else error, what):
        advice = (f"no space left on the device of {checkpoints}: free space there (or move run_root), then run "
                  "the same config again" + (f" (it resumes from {latest})" if latest else ""))
    elif isinstance(cause, _INPUT_ERRORS):
        advice = ("this is a config or input error: fix it, then run the config again"
                  + (f" (it resumes from {latest})" if latest else ""))
    elif latest:
        advice = f"run the same config again to resume from its last checkpoint, {latest}"
    else:
        advice = (f"no checkpoint was written under {checkpoints} (checkpoint_every sets how often): "
                  "running the config again starts from step 0")
    return f"the trainer died: {what}\n{advice}"


MEMORY_ADVICE = ("give the trainer and rollout workers more memory, or ask less of it: a smaller "
                 "trainer.per_device_parallelism (fewer rows per device at once: the same update, accumulated), a "
                 "smaller batching.max_length, fewer groups_per_step or n_generations (a step's batch is "
                 "groups_per_step × n_generations rows), fewer n_rollout_workers per node, a smaller model, or a "
                 "machine with more memory")
"""What to change when Ray's memory monitor killed a process: only fields a job config sets (the trainer's batch
size is derived, `config/job.DERIVED_FIELDS`). `memory_advice` adds the threshold Ray killed at when it is low."""

RAY_DEFAULT_MEMORY_THRESHOLD = 0.95
"""Ray's `RAY_memory_usage_threshold` when nothing sets it."""

_RAY_THRESHOLDS = (
    (re.compile(r"exceeded threshold of \d+B \((?P<value>\d+(?:\.\d+)?)% of"), 100.0),  # Ray 2.5x: "OOM kill reason"
    (re.compile(r"exceeds the memory usage threshold of (?P<value>\d+(?:\.\d+)?)"), 1.0),  # earlier Ray
)
_RAY_USAGE = re.compile(r"was (?P<used>\d+(?:\.\d+)?GB)(?: used)? / (?P<total>\d+(?:\.\d+)?GB)")


def _ray_texts(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    return f"{error}\n{cause}" if isinstance(cause, BaseException) else str(error)


def memory_threshold(error: BaseException) -> Optional[float]:
    """The fraction of the node's memory above which Ray killed: read from Ray's own message, which names it;
    else `RAY_memory_usage_threshold` of this driver's environment (a local Ray the job starts inherits it);
    None when neither says (Ray's default then: 0.95)."""
    text = _ray_texts(error)
    for pattern, per_unit in _RAY_THRESHOLDS:
        found = pattern.search(text)
        if found:
            return round(float(found.group("value")) / per_unit, 6)
    try:
        return float(os.environ["RAY_memory_usage_threshold"])
    except (KeyError, ValueError):
        return None


def memory_kill_line(error: BaseException) -> str:
    """What Ray's memory monitor did, with the node's use and the threshold Ray killed at when its message says."""
    usage = _RAY_USAGE.search(_ray_texts(error))
    threshold = memory_threshold(error)
    limit = (f"RAY_memory_usage_threshold={threshold:g}" if threshold is not None
             else f"RAY_memory_usage_threshold ({RAY_DEFAULT_MEMORY_THRESHOLD:g} unless set where Ray started)")
    if usage:
        return f"Ray killed it for memory: the node used {usage['used']} of {usage['total']}, over {limit}"
    return f"Ray killed it for memory: the node's memory use passed {limit}"


def memory_advice(error: BaseException) -> str:
    """MEMORY_ADVICE, first telling to raise Ray's threshold where it was set below Ray's default."""
    threshold = memory_threshold(error)
    if threshold is None or threshold >= RAY_DEFAULT_MEMORY_THRESHOLD:
        return MEMORY_ADVICE
    return (f"Ray kills at RAY_memory_usage_threshold={threshold:g}, below its default "
            f"{RAY_DEFAULT_MEMORY_THRESHOLD:g}: unless that is meant, raise it (or unset it) where Ray starts (this "
            f"shell for the job's local Ray, `ray start` on a cluster); else {MEMORY_ADVICE}")


def killed_for_memory(error: BaseException) -> bool:
    """Ray's memory monitor killed the process (an OutOfMemoryError, or an actor death that says so)."""
    return (isinstance(error, ray.exceptions.OutOfMemoryError)
            or isinstance(getattr(error, "cause", None), ray.exceptions.OutOfMemoryError)
            or "memory pressure" in str(error) or "killed due to memory" in str(error).lower())


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _is_disk_full(error: BaseException, what: str) -> bool:
    """ENOSPC anywhere in the exception's chain, or in the message of one that carries no errno
    (tensorstore reports a full disk as a ValueError naming the OS error)."""
    import errno

    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return "no space left on device" in what.lower()


def _latest_checkpoint(checkpoints: str) -> Optional[str]:
    """The checkpoint a rerun resumes from: the newest whose files match their digest (never a damaged one)."""
    from marinrl.train.checkpoints import newest_loadable

    try:
        newest = newest_loadable(checkpoints)
    except Exception:  # unreadable storage: say nothing rather than something wrong
        return None
    return newest.path if newest is not None else None
