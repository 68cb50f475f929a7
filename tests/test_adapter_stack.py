"""Many agents, one base: the scan sampler with K LoRA adapters stacked on one base (`models/adapter_stack.py`),
applied unmerged per row (`inference/adapter_rows.py`), on a tiny Llama (scan layers, GQA-free) and a tiny Qwen2
(biases on q/k/v, grouped queries, a list of layers).

Every sampling call here has the same shapes (`min_prompts` pads the smaller ones to the mixed batch's bucket),
so each family compiles the adapter program once and the plain one once.

The float32 bound (`_bound`): merged and unmerged compute the same sums in another order, x·(W + s·A·B) against
x·W + s·(x·A)·B. A dot of n float32 terms is off by at most n·eps times the sum of its terms' magnitudes (the
standard worst case); along the forward those errors add up layer by layer, each layer's dots of length at most
hidden + intermediate + 2·rank (its attention and MLP projections, with the adapter's two products), and reach the
logits scaled by their magnitude. Log-softmax is 1-Lipschitz per coordinate plus the shift, so a logprob moves by at
most twice the largest logit's error. The bound is therefore 2·eps·layers·(hidden + intermediate + 2·rank)·scale,
with scale the largest |logprob| (which bounds the logits' spread); measured differences are about 100 times smaller.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask
from levanter.models.qwen import QwenConfig
from test_inference import FWD_LEN
from test_train_worker import EPS32, TINY

from marinrl.config.lora import LoraRLConfig
from marinrl.config.model import ModelConfig
from marinrl.inference import sampler
from marinrl.models.adapter_stack import AdapterStack
from marinrl.models.lora import adapter_only, add_adapters, merge_adapters
from marinrl.models.policy_model import build_model

LORA = LoraRLConfig(rank=4, alpha=8.0)
QWEN2 = ModelConfig(model=QwenConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
                                     num_kv_heads=2, scan_layers=False, gradient_checkpointing=False),
                    vocab_size=TINY.vocab_size, seed=1)
PROMPTS = [[3, 17, 4], [9, 2, 11, 40, 5], [7, 7], [30, 1, 2, 3, 4, 5, 6], [12, 60, 8, 1], [44, 45, 46], [5], [21, 9]]
INDEX = [0, 1, 2, -1, 1, 0, -1, 1]  # slot 2 is empty: rows there run the base, as -1 does
SAMPLING = dict(n=2, temperature=1.0, max_tokens=10, stop_sequences=[], seed=5, min_prompts=len(PROMPTS))


@eqx.filter_jit  # a LoraLinear's dropout flag is a Python bool: static here, where jax.jit would trace it
def _forward_logits(model, ids):
    """Levanter's forward, its head called as a module (Qwen's `__call__` reads the head's weight alone, which
    would leave out a head's adapter)."""
    x = model.activations(hax.named(ids, ("batch", "position")), attn_mask=AttentionMask.causal())
    return model.lm_head(x).rearrange(("batch", "position", "vocab")).array


def reference_logprobs(model, prompt, tokens, temperature):
    """log softmax(logits / T) of `tokens` after `prompt` from one full forward pass of `model` (Levanter's own
    modules, its LoraLinear adapters unmerged): tests/test_inference.py's reference, for adapted models too."""
    seq = list(prompt) + [int(t) for t in tokens]
    ids = np.zeros((1, FWD_LEN), np.int32)
    ids[0, :len(seq)] = seq
    logits = np.asarray(_forward_logits(model, jnp.asarray(ids)), np.float64)[0, len(prompt) - 1:len(seq) - 1]
    scaled = logits / temperature
    top = scaled.max(-1, keepdims=True)
    logp = scaled - top - np.log(np.exp(scaled - top).sum(-1, keepdims=True))
    return logp[np.arange(len(tokens)), np.asarray(tokens)]


def random_adapter(base, seed: int):
    """An adapter of LORA on `base` whose A (Levanter's init) and B (here nonzero) are random: it moves the logprobs."""
    tree = adapter_only(add_adapters(base, dataclasses.replace(LORA, seed=seed)))
    leaves, treedef = jax.tree.flatten(tree)
    keys = iter(jax.random.split(jax.random.PRNGKey(100 + seed), len(leaves)))
    return jax.tree.unflatten(treedef, [jax.random.normal(next(keys), x.shape, x.dtype) * 0.3
                                        if eqx.is_inexact_array(x) else x for x in leaves])


def fresh_stack(base, adapters) -> AdapterStack:
    """3 slots: the given adapters in slots 0 and 1, slot 2 empty (each test its own: updates donate the arrays)."""
    stack = AdapterStack.empty(base, LORA, 3)
    for k, adapter in enumerate(adapters):
        stack = stack.with_adapter(k, adapter)
    return stack


@dataclasses.dataclass
class Family:
    name: str
    base: object
    adapters: list
    stack: AdapterStack
    mixed: sampler.SampleOutput

    def model_of(self, slot: int):
        """The model a row of `slot` samples from: Levanter's LoraLinear forward, unmerged (the base for -1/2)."""
        return self.base if slot in (-1, 2) else self.stack.adapted(slot)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def family(request) -> Family:
    base = build_model(TINY if request.param == "llama" else QWEN2)
    adapters = [random_adapter(base, 1), random_adapter(base, 2)]
    stack = fresh_stack(base, adapters)
    mixed = sampler.sample(stack.base, PROMPTS, adapters=stack.adapters, adapter_index=INDEX, **SAMPLING)
    return Family(request.param, base, adapters, stack, mixed)


def _bound(base, logprobs) -> float:
    """The float32 bound of the module doc for logprobs of this magnitude."""
    cfg = base.config
    depth = cfg.num_layers * (cfg.hidden_dim + cfg.intermediate_dim + 2 * LORA.rank)
    return 2 * EPS32 * depth * max(1.0, float(np.max(np.abs(logprobs))))


def _rows(i: int) -> slice:
    n = SAMPLING["n"]
    return slice(i * n, (i + 1) * n)


def test_each_row_samples_from_the_base_with_its_own_adapter(family):
    """Every row's logprobs are a full forward pass's (Levanter's own LoraLinear modules) of the base with that
    row's adapter, to the 1e-4 of tests/test_inference.py; under another slot's model they are not."""
    out, checked, apart = family.mixed, 0, []
    for i, prompt in enumerate(PROMPTS):
        for r in range(_rows(i).start, _rows(i).stop):
            tokens = out.tokens[r, :out.lengths[r]]
            assert len(tokens) == SAMPLING["max_tokens"]
            ref = reference_logprobs(family.model_of(INDEX[i]), prompt, tokens, SAMPLING["temperature"])
            np.testing.assert_allclose(out.logprobs[r, :len(tokens)], ref, atol=1e-4, rtol=0)
            checked += len(tokens)
            other = 1 if INDEX[i] == 0 else 0  # the forward of a model this row is not routed to
            wrong = reference_logprobs(family.model_of(other), prompt, tokens, SAMPLING["temperature"])
            apart.append(float(np.max(np.abs(wrong - ref))))
    assert checked == len(PROMPTS) * SAMPLING["n"] * SAMPLING["max_tokens"]
    assert min(apart) > 0.05, apart  # the adapters matter: the routing is what the check above tells apart


def test_unmerged_rows_match_todays_merged_sampling(family):
    """Each slot's rows are what `merge_adapters` then the plain sampler give (the rollout side until now), and
    the base's rows (-1, the empty slot) what the plain sampler gives with the base: same tokens, logprobs within
    the float32 bound of the module doc."""
    worst = 0.0
    for slot in (0, 1, -1):
        model = family.base if slot == -1 else merge_adapters(family.stack.adapted(slot))
        plain = sampler.sample(model, PROMPTS, **SAMPLING)
        for i in [i for i, k in enumerate(INDEX) if k == slot or (slot == -1 and k == 2)]:
            rows = _rows(i)
            np.testing.assert_array_equal(family.mixed.tokens[rows], plain.tokens[rows])
            diff = np.max(np.abs(family.mixed.logprobs[rows] - plain.logprobs[rows]))
            assert diff <= _bound(family.base, plain.logprobs[rows]), (slot, i, diff)
            worst = max(worst, float(diff))
    print(f"{family.name}: merged vs unmerged, largest logprob difference {worst:.3g} "
          f"(bound {_bound(family.base, family.mixed.logprobs):.3g})")


def test_swapping_one_slot_changes_only_the_rows_routed_to_it(family):
    """A new version in slot 1, with a scale of its own: its rows change (and follow the new adapter's full forward
    at that scale); every other row is bit-identical, and so are the base and the other slots' arrays."""
    stack = fresh_stack(family.base, family.adapters)
    before = [np.array(x, copy=True) for x in jax.tree.leaves(stack.adapters)]
    new = random_adapter(family.base, 3)
    old = jax.tree.leaves(stack.adapters)
    swapped = stack.with_adapter(1, new, scale=0.5)
    assert swapped.base is family.base  # the base: the same arrays, never copied
    assert all(x.is_deleted() for x in old)  # the stack's arrays were donated to the update: written in place
    after = [np.asarray(x) for x in jax.tree.leaves(swapped.adapters)]
    fresh = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(new, eqx.is_inexact_array))]
    for old, got, one in zip(before[:-1], after[:-1], fresh, strict=True):  # the A and B of each module; scales last
        np.testing.assert_array_equal(got[[0, 2]], old[[0, 2]])
        np.testing.assert_array_equal(got[1], one.astype(got.dtype))
    np.testing.assert_array_equal(after[-1], [LORA.scale, 0.5, 0.0])  # slot 0: alpha / r; slot 2: empty

    out = sampler.sample(swapped.base, PROMPTS, adapters=swapped.adapters, adapter_index=INDEX, **SAMPLING)
    for i, slot in enumerate(INDEX):
        rows = _rows(i)
        if slot == 1:
            assert np.max(np.abs(out.logprobs[rows] - family.mixed.logprobs[rows])) > 1e-3, i
        else:
            np.testing.assert_array_equal(out.tokens[rows], family.mixed.tokens[rows])
            np.testing.assert_array_equal(out.logprobs[rows], family.mixed.logprobs[rows])
    i = INDEX.index(1)
    r = _rows(i).start
    ref = reference_logprobs(swapped.adapted(1), PROMPTS[i], out.tokens[r], SAMPLING["temperature"])
    np.testing.assert_allclose(out.logprobs[r], ref, atol=1e-4, rtol=0)


def test_a_mixed_batch_equals_each_adapters_rows_alone(family):
    """The rows of each slot sampled in a call of their own (their own prompt keys, the same stack) are the
    mixed batch's: same tokens, logprobs within the float32 bound."""
    for slot in (0, 1, 2, -1):
        mine = [i for i, k in enumerate(INDEX) if k == slot]
        alone = sampler.sample(family.stack.base, [PROMPTS[i] for i in mine], adapters=family.stack.adapters,
                               adapter_index=[slot] * len(mine), prompt_keys=[(SAMPLING["seed"], i) for i in mine],
                               **SAMPLING)
        for j, i in enumerate(mine):
            np.testing.assert_array_equal(alone.tokens[_rows(j)], family.mixed.tokens[_rows(i)])
            diff = np.max(np.abs(alone.logprobs[_rows(j)] - family.mixed.logprobs[_rows(i)]))
            assert diff <= _bound(family.base, alone.logprobs[_rows(j)]), (slot, i, diff)


def test_bad_adapter_indices_and_adapters_are_refused(family):
    stack = family.stack
    kw = dict(SAMPLING, min_prompts=1)
    with pytest.raises(ValueError, match="go together"):
        sampler.sample(stack.base, PROMPTS[:2], adapters=stack.adapters, **kw)
    with pytest.raises(ValueError, match=r"-1 \(the base alone\) or a slot 0..2, got \[3\]"):
        sampler.sample(stack.base, PROMPTS[:2], adapters=stack.adapters, adapter_index=[0, 3], **kw)
    with pytest.raises(ValueError, match="rows of prompt 1 name different slots"):
        sampler.sample(stack.base, PROMPTS[:2], adapters=stack.adapters, adapter_index=[0, 0, 1, 0], **kw)
    with pytest.raises(ValueError, match="3 entries for 2 prompts"):
        sampler.sample(stack.base, PROMPTS[:2], adapters=stack.adapters, adapter_index=[0, 0, 1], **kw)
    with pytest.raises(IndexError, match="slot 3"):
        stack.adapter(3)
    other = adapter_only(add_adapters(family.base, dataclasses.replace(LORA, rank=2)))
    with pytest.raises(ValueError, match="does not have this stack's shapes"):
        fresh_stack(family.base, []).with_adapter(0, other)


def test_chunked_decoding_with_adapters_gives_the_one_call_samples(family):
    """`chunk_tokens` (the HTTP endpoint's rounds of device calls) carries the adapters through every chunk."""
    out = sampler.sample(family.stack.base, PROMPTS, adapters=family.stack.adapters, adapter_index=INDEX,
                         chunk_tokens=4, **SAMPLING)
    np.testing.assert_array_equal(out.tokens, family.mixed.tokens)
    np.testing.assert_allclose(out.logprobs, family.mixed.logprobs, rtol=0,
                               atol=_bound(family.base, family.mixed.logprobs))
