"""What a trainer of K adapters on one base (`train/adapter_slots.py`) reads and writes per adapter, behind the
interfaces the TrainWorker's loop already uses for one model: a replay buffer and a weight server.

- `AdapterReplays`: one `ReplayBuffer` per adapter, each over its own policy model's rollout files, with its
  own staleness window, filters and cursor; a step's sample is every adapter's batch of `groups_per_step`
  groups (it waits for each, as separate trainers would each wait for theirs), packed into one batch with an
  `adapter` axis. The checkpoint's sidecar holds each buffer's state under its adapter's name.
- `AdapterWeightServers`: one weight server per adapter's stream; a publish sends slot k's adapter (the axis
  taken out) to stream k, so each rollout worker receives exactly what a one-adapter trainer would publish.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional, Sequence

import haliax as hax
import jax
import numpy as np

from marinrl.config.batching import BatchingConfig
from marinrl.models.adapter_stack import ADAPTER, slot_adapters
from marinrl.train.batching import TrainingBatch
from marinrl.train.replay.groups import ReplaySample


@dataclasses.dataclass(frozen=True)
class AdapterSample:
    """One step's samples, one per adapter, in slot order."""

    names: tuple[str, ...]
    samples: tuple[ReplaySample, ...]

    @property
    def groups(self):
        return tuple(g for s in self.samples for g in s.groups)

    def training_batch(self, *, batch_size: int, config: BatchingConfig, row_multiple: int = 1,
                       microbatch_rows: Optional[int] = None) -> TrainingBatch:
        """Each adapter's batch as `ReplaySample.training_batch` packs it, padded to one (rows, positions): the
        longest row length any of them needs, then the most rows any needs at that length, stacked on the
        `adapter` axis."""
        def pack(s: ReplaySample, shape: tuple[int, int]) -> dict[str, np.ndarray]:
            return s.packed(batch_size=batch_size, config=config, row_multiple=row_multiple,
                            microbatch_rows=microbatch_rows, min_shape=shape)

        length = max(pack(s, (0, 0))["input_ids"].shape[1] for s in self.samples)
        rows = max(pack(s, (0, length))["input_ids"].shape[0] for s in self.samples)
        packed = [pack(s, (rows, length)) for s in self.samples]
        stacked = jax.device_put({name: np.stack([p[name] for p in packed]) for name in packed[0]})
        return TrainingBatch(**{name: hax.named(stacked[name], (ADAPTER, *TrainingBatch.field_axes(name)))
                                for name in TrainingBatch.field_names()})

    def metrics(self) -> dict[str, float]:
        """Each adapter's batch metrics under `policy_model/<name>/`, and the step's own over every group."""
        out = ReplaySample(self.samples[0].step, self.groups).metrics()
        for name, s in zip(self.names, self.samples):
            out.update({f"policy_model/{name}/{k}": v for k, v in s.metrics().items()})
        return out


class AdapterReplays:
    """The replay buffers of K adapters, as the TrainWorker's loop uses one (`ReplayBuffer`)."""

    def __init__(self, names: Sequence[str], buffers: Sequence):
        self.names = tuple(names)
        self.buffers = tuple(buffers)

    def start(self) -> AdapterReplays:
        for b in self.buffers:
            b.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        errors = []
        for b in self.buffers:  # every buffer's threads are stopped even when one fails to
            try:
                b.stop(timeout_s)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]

    def sample(self, step: int, n_groups: int, timeout_s: Optional[float] = None,
               stop: Optional[threading.Event] = None) -> Optional[AdapterSample]:
        """Every adapter's `n_groups` groups for update `step`; None when asked to stop while waiting."""
        samples = []
        for b in self.buffers:
            s = b.sample(step, n_groups, timeout_s=timeout_s, stop=stop)
            if s is None:
                return None
            samples.append(s)
        return AdapterSample(self.names, tuple(samples))

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, b in zip(self.names, self.buffers):
            own = b.metrics()
            out.update({f"policy_model/{name}/{k}": v for k, v in own.items()})
            for k, v in own.items():  # counters summed over the adapters; the step they sample is one
                out[k] = v if k == "replay/step" else out.get(k, 0.0) + v
        return out

    def state_dict(self, next_step: Optional[int] = None) -> dict:
        return {name: b.state_dict(next_step=next_step) for name, b in zip(self.names, self.buffers)}

    def load_state_dict(self, state: dict) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise ValueError(f"the checkpoint's replay state has no entry for adapters {missing} (it has "
                             f"{sorted(state)}): it was written by a trainer of other adapters")
        for name, b in zip(self.names, self.buffers):
            b.load_state_dict(state[name])


class AdapterWeightServers:
    """The weight servers of K adapters' streams, as the loop uses one (`WeightTransferServer`)."""

    def __init__(self, servers: Sequence):
        self.servers = tuple(servers)

    def publish(self, adapters, weight_step: int) -> None:
        """Slot k of `adapters` (an adapter tree with the `adapter` axis) to stream k."""
        for k, server in enumerate(self.servers):
            server.publish(slot_adapters(adapters, k), weight_step)

    @property
    def metrics(self) -> dict[str, float]:
        each = [s.metrics for s in self.servers]
        return {"publish_s": sum(m["publish_s"] for m in each), "bytes": sum(m["bytes"] for m in each),
                "versions_published": min(m["versions_published"] for m in each)}

    def close(self) -> None:
        for s in self.servers:
            s.close()
