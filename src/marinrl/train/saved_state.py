"""A trainer's saved state: where a run starts (the newest checkpoint whose every part loads, else a fresh
init) and how the next checkpoint is written (our sidecar, then Levanter's save, whose commit marker covers
both, then the digest and retention). The folders themselves, the digest and retention:
`marinrl/train/checkpoints.py`."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import equinox as eqx
import fsspec
import jax

from marinrl import multihost
from marinrl.config.train_worker import TrainWorkerConfig
from marinrl.models import lora as lora_rl
from marinrl.train.checkpoints import (
    SIDECAR,
    StepFolder,
    apply_retention,
    load_newest,
    read_sidecar,
    remove_folder,
    write_digest,
)
from marinrl.train.initial_weights import CheckpointWeights, fresh_model_init, resume_model_init

if TYPE_CHECKING:
    from levanter.trainer import Trainer

    from marinrl.train.replay.buffer import ReplayBuffer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Start:
    """Where a run starts: Levanter's state, the replay buffer positioned to match it, and the checkpoint."""

    state: Any
    replay: Optional[ReplayBuffer]
    """None on processes other than 0 (process 0 reads and broadcasts)."""
    skipped: list[str]
    """`<folder>: <why>` for each newer checkpoint that did not load."""
    resumed_from: Optional[StepFolder] = None
    """None: a fresh start."""
    parent: Optional[str] = None
    """The trainer incarnation that wrote the checkpoint resumed from (its sidecar's `trainer`)."""


def initial_state(config: TrainWorkerConfig, trainer: Trainer, source: CheckpointWeights,
                  replay: Optional[Callable[[int], ReplayBuffer]], curriculum) -> Start:
    """From the newest checkpoint whose model, optimizer, sidecar and curriculum state all load — all from
    that one checkpoint, or the rollout stream would not match the weights — else freshly initialized
    (docs/models.md, "Loading"). `replay(start_step)` builds the buffer (None: not this process's to read)."""
    key = jax.random.PRNGKey(trainer.config.seed)

    def load(folder: StepFolder):
        sidecar = read_sidecar(folder.path)
        model_init = resume_model_init(source, config.trained_adapters)
        state = _load_state(trainer, folder.path, key, model_init, _trainable(config, model_init))
        if int(sidecar["step"]) != int(state.step):
            raise ValueError(f"{SIDECAR} is for step {sidecar['step']}, the saved state for step {int(state.step)}")
        buffer = replay(int(state.step)) if replay is not None else None
        if buffer is not None:
            buffer.load_state_dict(sidecar["replay"])
        if curriculum is not None and sidecar.get("curriculum"):
            curriculum.load(sidecar["curriculum"])
        return state, buffer, sidecar.get("trainer")

    resumed = load_newest(trainer.checkpoint_path, load) if trainer.config.load_checkpoint is not False else None
    if resumed is not None:
        for line in resumed.skipped:
            print(f"[marinrl] skipped checkpoint {line}", flush=True)
        if resumed.skipped:
            print(f"[marinrl] resumed from the previous checkpoint {resumed.folder.path}", flush=True)
        state, buffer, parent = resumed.loaded
        return Start(state, buffer, resumed.skipped, resumed.folder, parent)
    model_init = fresh_model_init(source, config.trained_adapters)
    # Levanter's rules: initialize_from, load_checkpoint
    state = trainer.initial_state(key, model_init=model_init, is_trainable=_trainable(config, model_init))
    source.release()  # the state's model took the loaded buffers over (donated)
    if int(state.step) > 0:
        loaded_from = trainer.config.initialize_from or trainer.checkpoint_path
        raise RuntimeError(f"the checkpoint Levanter loaded from {loaded_from} (step {int(state.step)}) has no "
                           f"{SIDECAR}: cannot resume the rollout stream exactly")
    return Start(state, replay(0) if replay is not None else None, [])


def _trainable(config: TrainWorkerConfig, model_init):
    """Levanter's `is_trainable`: with LoRA only the adapters (and only they are checkpointed: the base is
    rebuilt from `model` on resume), else everything."""
    if config.lora is None:
        return True
    return lora_rl.trainable_filter(eqx.filter_eval_shape(model_init))


def _load_state(trainer: Trainer, folder: str, key, model_init, trainable):
    """Levanter's `initial_state` from one given checkpoint folder (it otherwise loads only the latest).
    `load_checkpoint=True` makes a missing checkpoint an error instead of a silent fresh start."""
    base = trainer.config
    trainer.config = dataclasses.replace(base, load_checkpoint=True, load_checkpoint_path=folder)
    try:
        return trainer.initial_state(key, model_init=model_init, is_trainable=trainable)
    finally:
        trainer.config = base


class CheckpointWriter:
    """Writes a trainer's checkpoints into Levanter's checkpointer's folders, each one resumable on its own."""

    def __init__(self, trainer_id: str, *, keep: int, keep_every: int):
        self.trainer_id = trainer_id
        """Written in each sidecar: which incarnation wrote the checkpoint (the audit trail's lineage)."""
        self._keep, self._keep_every = keep, keep_every
        self._levanter = None
        self._protect: list[str] = []
        self.deleted = 0
        """Checkpoints retention deleted in this run."""

    def open(self, levanter_checkpointer, resumed_from: Optional[str]) -> None:
        """The run's Levanter checkpointer; `resumed_from`, the checkpoint the run started from, is never
        deleted by retention."""
        self._levanter = levanter_checkpointer
        self._protect = [resumed_from] if resumed_from is not None else []

    def folder(self, info) -> str:
        """The folder the checkpoint after `info`'s update goes to."""
        return f"{self._levanter.base_path}/step-{info.step}"

    def write(self, info, replay, curriculum) -> str:
        """Sidecar first, then Levanter's tensorstore save, whose metadata.json commits both; then
        retention. A folder of that name left by an older lineage (a checkpoint skipped on resume, a save
        that never finished) is deleted first: written over, its stale commit marker and files would
        make a half-written folder look complete."""
        folder = self.folder(info)
        cohort = multihost.current_cohort()
        if cohort.is_leader:  # one author for the folder's reset and the sidecar; every process saves its shards
            fs, path = fsspec.core.url_to_fs(folder)
            if fs.exists(path):
                remove_folder(folder, "replaced by a new checkpoint of the same step")
            fs.makedirs(path, exist_ok=True)
            sidecar: dict[str, Any] = {"step": info.next_step, "replay": replay.state_dict(next_step=info.next_step),
                                       "trainer": self.trainer_id, "digest": True}
            if curriculum is not None:
                target = f"{folder}/curriculum.json"
                curriculum.save(target)
                sidecar["curriculum"] = target
            fs.pipe_file(f"{path}/{SIDECAR}", json.dumps(sidecar).encode())
        cohort.barrier(f"checkpoint-{info.step}")
        self._levanter.on_step(info, force=True)
        self._levanter.wait_until_finished()
        cohort.barrier(f"checkpoint-{info.step}-saved")  # every process's shards are in before they are summed
        if not cohort.is_leader:
            return folder
        write_digest(folder)
        logger.info("checkpoint at step %d: %s", info.next_step, folder)
        deleted = apply_retention(self._levanter.base_path, keep=self._keep, keep_every=self._keep_every,
                                  protect=self._protect)
        self.deleted += len(deleted)
        return folder

    def wait(self) -> None:
        """Until Levanter's saves in flight are written."""
        if self._levanter is not None:
            self._levanter.wait_until_finished()

    def metrics(self, skipped: list[str]) -> dict[str, float]:
        return {"checkpoint/skipped_on_resume": float(len(skipped)), "checkpoint/deleted": float(self.deleted)}
