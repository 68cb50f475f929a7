"""One trainer, one base, K adapters (`train/adapter_slots.py`, `train/adapter_streams.py`): each adapter trains
exactly as a trainer of that adapter alone would, on its own rollouts only, and a resume restores every one."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import optax
import pytest
from test_train_worker import (
    GROUPS,
    TINY,
    assert_same_state,
    checkpoint_arrays,
    make_rollout_batch,
    model_arrays,
    worker_config,
)

from marinrl.config.lora import LoraRLConfig
from marinrl.config.loss import LossConfig
from marinrl.config.replay import OffPolicyConfig
from marinrl.config.train_worker import AdapterSlotConfig, TrainWorkerConfig
from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.job.plan import build_trainer
from marinrl.models.adapter_stack import slot_adapters, stacked_adapters
from marinrl.models.lora import adapter_only, add_adapters, trainable_filter, without_adapters
from marinrl.models.policy_model import build_model
from marinrl.storage.rollouts import RolloutWriter
from marinrl.train.adapter_slots import per_slot
from marinrl.train.worker import TrainWorker
from marinrl.transfer.packed import read_packed

NAMES = ("left", "right")
LOSS = LossConfig.preset("grpo", kl_beta=0.04)  # a KL term: the reference (the base) is computed per adapter


def _lora(k: int) -> LoraRLConfig:
    return LoraRLConfig(rank=4, alpha=8.0, seed=k)


def _write_rollouts(root: pathlib.Path, seed: int, batches: int = 2) -> None:
    """`batches` × GROUPS groups sampled at weight step 0, usable for the first `staleness` + 1 updates."""
    rng = np.random.default_rng(seed)
    writer = RolloutWriter(str(root))
    for _ in range(batches):
        writer.write(make_rollout_batch(0, rng))


def _solo(tmp: pathlib.Path, k: int, steps: int) -> TrainWorkerConfig:
    cfg = worker_config(tmp / f"solo-{k}", steps=steps, sampling=OffPolicyConfig(staleness=2), run_id=f"solo-{k}",
                        loss=LOSS)
    return dataclasses.replace(cfg, rollout_root=str(tmp / f"rollouts-{k}"), lora=_lora(k))


def _shared(tmp: pathlib.Path, steps: int, checkpoint_every: int = 0, run: str = "shared") -> TrainWorkerConfig:
    cfg = worker_config(tmp / run, steps=steps, sampling=OffPolicyConfig(staleness=2), run_id=run,
                        loss=LOSS, checkpoint_every=checkpoint_every)
    slots = tuple(AdapterSlotConfig(name, str(tmp / f"rollouts-{k}"),
                                    FilesystemTransferConfig(root=str(tmp / run / f"weights-{name}")),
                                    ("policy",), _lora(k)) for k, name in enumerate(NAMES))
    return dataclasses.replace(cfg, lora=_lora(0), adapters=slots)


def _run(cfg: TrainWorkerConfig):
    worker = TrainWorker(cfg, build_trainer(cfg))
    return worker, worker.run()


def _published(weights_root: pathlib.Path) -> tuple[int, list[np.ndarray]]:
    pointer = json.loads((weights_root / "latest.json").read_text())
    names, arrays = read_packed((weights_root / pointer["version"] / "weights.bin").read_bytes(), "latest")
    assert names and all(".lora." in n for n in names), names
    return pointer["weight_step"], [np.asarray(a) for a in arrays]


def _close(got: list[np.ndarray], want: list[np.ndarray], start: list[np.ndarray], what: str) -> None:
    """Equal up to a small fraction of how far training moved each array from `start`. The slot's program is the
    solo one's under a vmap (another fusion), so gradients round differently by a few eps32 of their terms, and
    Adam's update g/(√v + ε) turns a gradient's error e into up to e/ε of the learning rate: no bound in eps32 of
    the values holds. A wrong slot, another adapter's rows or a step too many or too few move them by O(1) of
    the movement."""
    assert len(got) == len(want) == len(start), what
    for g, w, s in zip(got, want, start):
        g, w, s = (np.asarray(x, np.float64) for x in (g, w, s))
        moved = float(np.max(np.abs(w - s)))
        assert g.shape == w.shape and moved > 0, what
        err = float(np.max(np.abs(g - w)))
        assert err <= 1e-3 * moved, f"{what}: differs by {err:.3g}, {err / moved:.2g} of its movement {moved:.3g}"


def test_each_adapter_trains_as_its_own_trainer_would_and_resumes_exactly(tmp_path):
    """Two adapters on one base, 2 updates (the second after a resume from the first's checkpoint), against two
    one-adapter trainers of 2 updates on the same rollout files: every adapter, and what each stream published,
    equal to rounding; the base bit-identical; the trainer holds one base and K adapters."""
    for k in range(len(NAMES)):
        _write_rollouts(tmp_path / f"rollouts-{k}", seed=10 + k)
    solos = [_run(_solo(tmp_path, k, steps=2))[0].model for k in range(len(NAMES))]

    straight = _run(_shared(tmp_path, steps=2, run="straight"))[1]
    first, r1 = _run(_shared(tmp_path, steps=1, checkpoint_every=1))
    assert (r1.first_step, r1.final_step) == (0, 1)
    resumed, r2 = _run(_shared(tmp_path, steps=2))
    assert (r2.first_step, r2.final_step) == (1, 2) and r2.resumed_from is not None
    # each step trained GROUPS of each adapter's own groups, none twice across the resume
    trained = [g for step in r1.trained_groups + r2.trained_groups for g in step]
    assert len(trained) == 2 * GROUPS * len(NAMES) == len(set(trained))

    # the resumed run's state (both adapters, both optimizer states) is the uninterrupted run's
    assert_same_state(checkpoint_arrays(r2.checkpoint), checkpoint_arrays(straight.checkpoint), "resumed vs straight")
    model = resumed.model
    base = build_model(TINY)
    for got, want in zip(model_arrays(without_adapters(model)), model_arrays(base), strict=True):
        np.testing.assert_array_equal(got, want)  # one base, never trained
    adapters = adapter_only(model)
    for k, (name, solo) in enumerate(zip(NAMES, solos)):
        mine = model_arrays(slot_adapters(adapters, k))
        start = model_arrays(adapter_only(add_adapters(base, _lora(k))))
        _close(mine, model_arrays(adapter_only(solo)), start, f"adapter {name}")
        other = model_arrays(adapter_only(solos[1 - k]))  # the other adapter's trainer: O(1) of the movement away
        with pytest.raises(AssertionError):
            _close(mine, other, start, "the other adapter")
        step, published = _published(tmp_path / "shared" / f"weights-{name}")
        assert step == 2  # what stream k carries is slot k, exactly
        for got, want in zip(published, mine, strict=True):
            np.testing.assert_array_equal(got, want)
    # one copy of the base, K adapters
    n_base = sum(a.size for a in model_arrays(base))
    assert sum(a.size for a in model_arrays(model)) == n_base + sum(
        a.size for k in range(len(NAMES)) for a in model_arrays(adapter_only(add_adapters(base, _lora(k)))))


def test_an_adapters_update_does_not_depend_on_another_adapters_rollouts():
    """The loss's gradient and the optimizer's update of slot 0 are bit-identical whatever slot 1's rows are,
    including a global-norm clip that binds (each slot clips by its own norm)."""
    from marinrl.train.adapter_slots import per_adapter_loss
    from marinrl.train.batching import TrainingBatch
    from marinrl.train.losses import rl_loss

    model = stacked_adapters(build_model(TINY), [_lora(0), _lora(1)])
    rng = np.random.default_rng(0)

    def batch(scale: float) -> TrainingBatch:
        return TrainingBatch.one_sequence_per_row(
            input_ids=rng.integers(1, 64, (4, 16)), target_ids=rng.integers(1, 64, (4, 16)),
            loss_mask=np.ones((4, 16)), sampler_logprobs=np.full((4, 16), -4.0),
            advantages=scale * rng.normal(size=(4, 16)), temperature=np.ones(4))

    def stack(*bs):
        return jax.tree.map(lambda *xs: hax.stack("adapter", xs), *bs, is_leaf=hax.is_named_array)

    loss = per_adapter_loss(lambda m, b, key=None: rl_loss(m, b, config=LossConfig()), NAMES)
    trainable, frozen = eqx.partition(model, trainable_filter(model))
    trainable = eqx.filter(trainable, eqx.is_inexact_array)

    @eqx.filter_jit
    def grads(b):
        return eqx.filter_grad(lambda t, i: loss(eqx.combine(t, frozen), i)[0])(trainable, b)

    own = batch(1.0)
    g1, g2 = grads(stack(own, batch(1.0))), grads(stack(own, batch(1e3)))
    optimizer = per_slot(optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2)), len(NAMES))
    state = optimizer.init(trainable)
    u1, _ = optimizer.update(g1, state, trainable)
    u2, _ = optimizer.update(g2, state, trainable)
    for tree1, tree2 in ((g1, g2), (u1, u2)):
        for a, b in zip(jax.tree.leaves(slot_adapters(tree1, 0)), jax.tree.leaves(slot_adapters(tree2, 0))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert any(not np.array_equal(np.asarray(a), np.asarray(b))  # slot 1 saw other rows
                   for a, b in zip(jax.tree.leaves(slot_adapters(tree1, 1)), jax.tree.leaves(slot_adapters(tree2, 1))))


def test_adapters_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="rank, alpha and target_modules"):
        stacked_adapters(build_model(TINY), [_lora(0), LoraRLConfig(rank=8, alpha=8.0)])
