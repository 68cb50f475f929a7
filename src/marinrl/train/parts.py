"""What a TrainWorker trains with besides Levanter's `Trainer`, handed to it as a rollout host's parts are to
its RolloutWorker: the plan builds them from the worker's config (`marinrl.job.plan.build_trainer`) in the
process that runs the trainer, so the worker's `run()` is the loop and not the wiring. A part that needs what
only the loop has (JAX initialized by Levanter, the loaded state, the weight step a resume starts from) is a
function the loop calls once it has it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from levanter.trainer import Trainer

    from marinrl.train.audit import AuditTrail
    from marinrl.train.initial_weights import CheckpointWeights
    from marinrl.train.replay.buffer import ReplayBuffer
    from marinrl.train.saved_state import CheckpointWriter
    from marinrl.transfer.base import WeightTransferServer


@dataclasses.dataclass
class TrainerParts:
    trainer_id: str
    """This incarnation's name in the audit trail and in the sidecars of its checkpoints."""
    weight_server: Callable[[], WeightTransferServer]
    """Builds the weight server, once Levanter has initialized JAX; the loop publishes the start's weights."""
    replay: Optional[Callable[[int], ReplayBuffer]]
    """The replay buffer over the run's rollout files from a start step (a resume then loads its cursor);
    None on a process other than 0 of a multi-host trainer (process 0 reads and broadcasts each batch)."""
    audit: Optional[AuditTrail]
    """The group ids each step trained (docs/training.md, "The audit trail"); None: no `audit_root`, or
    not process 0."""
    reference: Optional[Callable[[CheckpointWeights, Trainer, Any, bool], Any]]
    """(checkpoint source, trainer, loaded state, resumed) → the frozen KL reference; None: the loss has no
    KL term, or with LoRA the policy's own frozen base is its reference."""
    checkpoints: CheckpointWriter
    """Writes each checkpoint: sidecar, Levanter's save, digest, retention."""
