"""The batch every process of a trainer trains at a step: process 0 samples its replay buffer and packs the
rows, the cohort shares them (marinrl/multihost.py), and each process places its own devices' slices of the
global arrays (docs/multihost.md). One process is a cohort of one: the same path, nothing shared."""

from __future__ import annotations

import threading

import haliax as hax
import jax
import numpy as np

from marinrl.multihost import Cohort
from marinrl.train.batching import TrainingBatch, pack_rollouts, row_alignment


def next_batch(cohort: Cohort, replay, step: int, config, stop: threading.Event, trainer):
    """(sample or None, global TrainingBatch, group ids) for `step` on every process, or None once process 0
    was asked to stop. Process 0 samples its replay buffer and broadcasts; the others pass `replay=None`."""
    sample, arrays, groups, stopping = None, None, [], False
    if cohort.is_leader:
        sample = None if stop.is_set() else replay.sample(step, config.groups_per_step, stop=stop)
        stopping = sample is None  # asked to stop, before or while waiting for rollouts
        if not stopping:
            groups = [g.group.group_id for g in sample.groups]
            arrays = pack_rollouts(sample.rollouts, sample.token_advantages(),
                                   batch_size=config.trainer.train_batch_size, config=config.batching,
                                   trainable=sample.trainable, **row_alignment(trainer.config))
    arrays, groups, stopping = cohort.share_batch(arrays, groups, stopping)
    if stopping:
        return None
    return sample, global_batch(arrays, trainer.compute_axis_mapping, trainer.device_mesh), groups


def global_batch(arrays: dict[str, np.ndarray], mapping, mesh):
    """A `TrainingBatch` of global arrays, sharded by `mapping` over `mesh`, from the same NumPy arrays on
    every process (each process places only its own devices' slices)."""
    def named(name, axes):
        a = arrays[name]
        axes = tuple(hax.Axis(n, s) for n, s in zip(axes, a.shape))
        sharding = hax.partitioning.sharding_for_axis(axes, mapping, mesh)
        return hax.named(jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx]), axes)

    return TrainingBatch(**{name: named(name, TrainingBatch.field_axes(name)) for name in TrainingBatch.field_names()})
