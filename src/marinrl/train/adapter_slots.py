"""Many agents, one base, on the trainer: K LoRA adapters trained over one frozen base by one trainer.

The trained model is the base with Levanter's `LoraLinear` around each targeted `Linear`, as for one adapter
(`models/lora.py`), except that every adapter array carries a leading `adapter` axis: slot k's A and B are
`A[adapter=k]`, `B[adapter=k]` (the layout of the rollout side's `models/adapter_stack.py`). One copy of the
base, K adapters, one optimizer state per slot, one batch per slot:

- **The batch** has an `adapter` axis too ([adapter, batch, position]): slot k's rows are its own policy's
  rollouts (`train/adapter_streams.py`), padded to one shape.
- **The loss** is `Σ_k loss_k`, each `loss_k` the configured loss of slot k's model on slot k's rows,
  normalized over its own tokens and groups (`per_adapter_loss`: `hax.vmap` over the `adapter` axis; the
  base's arrays have no such axis and are read once for every slot). Slot k's arrays enter only `loss_k`, so
  the gradient of slot k is that of its own loss: an adapter's update never depends on another's rollouts.
- **The optimizer** runs once per slot (`per_slot`: the job's optax transformation under `hax.vmap` over
  the `adapter` axis), so each slot has its own moments, step count and global-norm clip: slot k moves
  exactly as a trainer of that adapter alone would.
- **A weight version** of slot k is its adapter tree with the axis taken out (`slot_adapters`): what a
  one-adapter trainer publishes, so the rollout side cannot tell the layouts apart.
"""

from __future__ import annotations

from typing import Callable, Sequence

import haliax as hax
import jax
import optax
from haliax.util import is_named_array

from marinrl.models.adapter_stack import ADAPTER

__all__ = ["per_adapter", "per_adapter_loss", "per_slot"]


def _unmapped(_):
    return None


def per_adapter(fn: Callable, slots: int) -> Callable:
    """`fn(model, inputs)` once per slot: slot k's model (a stacked model's slot, or an unadapted model whole) on
    slot k's inputs (named arrays with the `adapter` axis); outputs get the axis."""
    return hax.vmap(fn, hax.Axis(ADAPTER, slots), default=_unmapped)


def per_adapter_loss(loss_fn: Callable, names: Sequence[str]) -> Callable:
    """A loss `(model, inputs, key=) -> (loss, metrics)` over a stacked model and inputs with an `adapter` axis:
    `Σ_k loss_fn(slot k's model, slot k's inputs)`. Each metric (a scalar per slot) is reported per slot as
    `<name>/<metric>` and, under its own name, as the slots' mean."""
    Adapter = hax.Axis(ADAPTER, len(names))

    def loss(model, inputs, *, key=None):
        # a key is split, one per slot (named, so that it is mapped where the model's unnamed leaves are not)
        keys = None if key is None else hax.named(jax.random.split(key, Adapter.size), (Adapter, "key"))
        losses, metrics = per_adapter(lambda m, i, k: loss_fn(m, i, key=None if k is None else k.array),
                                      Adapter.size)(model, inputs, keys)
        out = {}
        for metric, values in metrics.items():
            values = values.array if is_named_array(values) else values
            out.update({f"{name}/{metric}": values[k] for k, name in enumerate(names)})
            out[metric] = values.mean()
        return (losses.array if is_named_array(losses) else losses).sum(), out

    return loss


def per_slot(optimizer: optax.GradientTransformation, slots: int) -> optax.GradientTransformationExtraArgs:
    """`optimizer` applied to each slot of the `adapter` axis on its own (its own moments, count and clip)."""
    Adapter = hax.Axis(ADAPTER, slots)

    def init(params):
        return _without_slot_axis_when_empty(hax.vmap(optimizer.init, Adapter)(params))

    def update(updates, state, params=None, **_):
        return _without_slot_axis_when_empty(
            hax.vmap(lambda u, s, p: optimizer.update(u, s, p), Adapter)(updates, state, params))

    return optax.GradientTransformationExtraArgs(init, update)


def _without_slot_axis_when_empty(tree):
    """`hax.vmap` names every output NamedArray with the mapped axis, the placeholders of frozen arrays (array
    None) too; those keep the frozen arrays' own axes, so that the tree matches the model's."""
    def fix(x):
        if is_named_array(x) and x.array is None:
            return hax.NamedArray(None, tuple(a for a in x.axes if a.name != ADAPTER))
        return x

    return jax.tree.map(fix, tree, is_leaf=is_named_array)
