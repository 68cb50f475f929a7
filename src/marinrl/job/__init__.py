"""A job on Ray: `RLJob` (`rl_job.py`) turns one `RLJobConfig` into a trainer, rollout workers and the
curriculum actor; `plan.py` builds each role's parts, `actors.py` holds the Ray actors, `placement.py` turns
placement configs into Ray requests and actor environments, `preflight.py` checks everything before Ray
starts, `run_lock.py` holds one job per run folder, `trainer_group.py` a trainer over several hosts.

`from marinrl.job import RLJob, RLJobConfig` is the public form; they load on first use, so that importing
a submodule (the run lock's command line) does not import Ray."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marinrl.config.job import RLJobConfig
    from marinrl.job.rl_job import RLJob

__all__ = ["RLJob", "RLJobConfig"]


def __getattr__(name: str):
    if name == "RLJob":
        from marinrl.job.rl_job import RLJob

        return RLJob
    if name == "RLJobConfig":
        from marinrl.config.job import RLJobConfig

        return RLJobConfig
    raise AttributeError(f"module 'marinrl.job' has no attribute {name!r}")
