"""The model's projections as 2-D matmuls on the CPU: the tokens' leading axes merged into one.

A Levanter projection contracts `[batch, position, embed] · [out, embed]`. Its weight gradient then
contracts over two axes (batch and position), and XLA:CPU lowers that by first copying the activation
gradient into a transposed `[out, batch·position]` buffer: four such copies per step were a quarter of
the update's compute at the reference shape (docs/performance.md, "The update"). With the token axes
merged first (a free reshape of a row-major array), the gradient contracts one axis and XLA:CPU's dot
reads it in place.

`flat_token_dots(model)` swaps every `Linear`'s `dot_general` (haliax's hook for it, a module without
arrays) for `TokenFlatDot`, inside the traced loss only: the model the trainer holds, checkpoints and
sends keeps Levanter's structure. On other backends it returns the model unchanged (not measured there,
and a merged axis could change how a sharded batch is laid out).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
from haliax.quantization import DefaultDotGeneralOp


class TokenFlatDot(eqx.Module):
    """`jax.lax.dot_general` with the left operand's leading free axes merged into one when that is a
    reshape (no batch dimensions, free axes before the contracted ones); otherwise the plain call."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        free = [d for d in range(lhs.ndim) if d not in tuple(lhs_contract)]
        if lhs_batch or rhs_batch or len(free) < 2 or free != list(range(len(free))):
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
        lead = lhs.shape[: len(free)]
        flat = lhs.reshape((math.prod(lead),) + lhs.shape[len(free):])
        contract = tuple(d - len(free) + 1 for d in lhs_contract)
        out = jax.lax.dot_general(flat, rhs, ((contract, tuple(rhs_contract)), ((), ())), precision,
                                  preferred_element_type)
        return out.reshape(lead + out.shape[1:])


def _is_default_dot(x) -> bool:
    return isinstance(x, DefaultDotGeneralOp)


def flat_token_dots(model):
    """`model` with its projections' default dots replaced by `TokenFlatDot` on the CPU backend."""
    if jax.default_backend() != "cpu":
        return model
    return jax.tree_util.tree_map(lambda x: TokenFlatDot() if _is_default_dot(x) else x, model,
                                  is_leaf=_is_default_dot)


class PlainDot(eqx.Module):
    """`jax.lax.dot_general` as haliax's default op calls it, under a type `flat_token_dots` leaves alone."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def levanter_dots(model):
    """`model` whose projections keep Levanter's 3-D dots even inside `policy_forward`: the baseline that
    `bench/train_step.py --modes kl_0.04+levanter_dots` and the tests compare the flat dots against."""
    return jax.tree_util.tree_map(lambda x: PlainDot() if _is_default_dot(x) else x, model, is_leaf=_is_default_dot)
