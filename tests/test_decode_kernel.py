"""The decode kernel (`inference/decode_kernel.py`) in Pallas's interpret mode against the XLA attention
(`decoder.GroupedDecodeAttention`): one decode step over random prompt lengths (left padding), several groups, GQA
head ratios, rows that finished early and every phase's block; then the scan sampler and the server with
`attention: gpu_kernel` against `xla`."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.errors import ConfigError
from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.inference import decode_kernel
from marinrl.inference import sampler as scan_sampler
from marinrl.inference.context import SamplingParams
from marinrl.inference.decode_kernel import INTERPRET, INTERPRET_ENV, KernelDecodeAttention, resolve_attention
from marinrl.inference.decoder import GroupedDecodeAttention
from marinrl.inference.inflight import WeightSwaps
from marinrl.inference.scan_plan import bucket, decode_blocks
from marinrl.inference.server import InferenceServer
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer

EPS = float(np.finfo(np.float32).eps)


def _bound(q, kp, k_gen, v_all, scale, slots):
    """How far two float32 computations of one softmax attention may differ. Each score is a dot product of D
    terms: in any summation order it is within D·eps·Σ|q_i k_i| of the exact one, so the two paths' scores differ
    by at most δ = 2·D·eps·scale·max Σ|q_i k_i|; scores off by δ move the weights of the convex combination of
    values by a factor within e^{±2δ}, so the output by at most ~2·(2δ)·max|v|. The sums of up to `slots`
    exponentials and weighted values (each path adds them in its own order, then divides) add at most
    2·slots·eps·max|v| per path. Mutants (a slot too many or too few, a wrong prompt, a lost part) move the output by
    a share of a value, orders of magnitude more."""
    d = q.shape[-1]
    qa = np.abs(np.asarray(q, np.float64))[..., 0, :]  # [R, KV, G, D]
    k_max = max(np.abs(np.asarray(k)).max() for k in (kp, *k_gen))
    delta = 2 * d * EPS * scale * qa.sum(-1).max() * k_max
    v_max = max(np.abs(np.asarray(v)).max() for v in v_all)
    return v_max * (4 * delta + 4 * slots * EPS)


@functools.partial(jax.jit, static_argnames=("block", "starts", "scale", "soft_cap"))
def _kernel_step(q, k, v, cache, write_at, pad, reads, *, block, starts, scale, soft_cap):
    """The kernel's decode step in interpret mode, compiled once per phase (interpreted op by op it is slow)."""
    return KernelDecodeAttention(write_at, pad, reads, block, starts, interpret=True)(q, k, v, cache, scale, soft_cap)


CASES = [  # prompts, samples, KV heads, queries per KV head, head size, slots a prompt holds, t_len, soft cap
    (3, 2, 2, 2, 8, 32, 48, None),
    (2, 4, 1, 4, 16, 16, 320, None),  # multi-query, four phases of blocks
    (1, 3, 4, 1, 8, 48, 16, 5.0),     # no grouping of heads, soft-capped scores
    (4, 1, 2, 3, 8, 16, 384, None),   # 3 queries per KV head (padded to 16 in the kernel), n = 1
]


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_equals_the_xla_attention_and_reads_only_slots_that_hold_tokens(case):
    """A decode step in every phase: the kernel's output equals the XLA path's for every row still generating,
    within float32 rounding, and the cache it returns is the XLA path's. The slots that hold no token (the prompts'
    left padding, generated slots past the one written, a finished row's generated slots) hold NaN for the kernel:
    a kernel that let one of them into its sums would return NaN."""
    p, n, kv, g, d, s_p, t_len, soft_cap = case
    rows, scale = p * n, 0.7
    rng = np.random.default_rng(sum(case[:7]))
    blocks = decode_blocks(t_len)
    starts = tuple(a for a, _ in blocks)
    lens = rng.integers(1, s_p + 1, p)
    lens[0] = s_p  # a prompt that fills its slots: no padding
    pad = np.repeat(s_p - lens, n)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    for block, (start, size) in enumerate(blocks):
        for write_at in sorted({start, start + size - 1, int(rng.integers(start, start + size))}):
            kp, vp = f32(p, kv, s_p, d), f32(p, kv, s_p, d)
            gen = [f32(rows, kv, s, d) for _, s in blocks for _ in (0, 1)]
            q, k, v = f32(rows, kv, g, 1, d), f32(rows, kv, 1, d), f32(rows, kv, 1, d)
            done = rng.random(rows) < 0.3
            done[rng.integers(rows)] = False
            xla_out, xla_cache = GroupedDecodeAttention(
                jnp.asarray(write_at), jnp.arange(s_p)[None, :] >= jnp.asarray(pad)[:, None], block, starts)(
                q, k, v, (kp, vp, *gen), scale, soft_cap)
            poisoned_p = [x.copy() for x in (kp, vp)]
            for i in range(p):
                for x in poisoned_p:
                    x[i, :, :s_p - lens[i]] = np.nan
            poisoned_gen = [x.copy() for x in gen]
            for i, (a, _) in enumerate(blocks):
                for x in poisoned_gen[2 * i:2 * i + 2]:
                    x[:, :, max(0, write_at - a):] = np.nan  # the step writes slot write_at itself
                    x[done] = np.nan
            out, cache = _kernel_step(q, k, v, (*poisoned_p, *poisoned_gen), jnp.asarray(write_at), jnp.asarray(pad),
                                      jnp.asarray(~done), block=block, starts=starts, scale=scale, soft_cap=soft_cap)
            out, xla_out = np.asarray(out), np.asarray(xla_out)
            assert np.isfinite(out).all()
            bound = _bound(q, kp, gen, [vp, *gen], scale, s_p + write_at + 1)
            np.testing.assert_allclose(out[~done], xla_out[~done], atol=bound, rtol=0)
            for i in range(2 * block, 2 * block + 2):  # the step's key and value, where the XLA path writes them
                np.testing.assert_array_equal(np.asarray(cache[2 + i])[~done, :, write_at - start],
                                              np.asarray(xla_cache[2 + i])[~done, :, write_at - start])


def test_a_tile_is_read_only_where_it_holds_a_slot_of_the_range():
    cases = {(0, 1, 16): (0, 1), (0, 16, 16): (0, 1), (0, 17, 16): (0, 2), (3, 20, 16): (0, 2),
             (16, 32, 16): (1, 2), (31, 33, 16): (1, 3), (5, 5, 16): (0, 0), (40, 0, 16): (2, 2)}
    for (start, end, block), want in cases.items():
        assert tuple(int(x) for x in decode_kernel.tile_range(jnp.asarray(start), jnp.asarray(end), block)) == want


def test_a_part_without_slots_adds_nothing_to_the_merge():
    rng = np.random.default_rng(0)
    m, l_sum, o = jnp.asarray(rng.normal(size=(2, 3))), jnp.asarray(rng.random((2, 3)) + 1), jnp.asarray(
        rng.normal(size=(2, 3, 4)))
    empty = (jnp.full((2, 3), -jnp.inf), jnp.zeros((2, 3)), jnp.zeros((2, 3, 4)))
    np.testing.assert_allclose(decode_kernel.merge_partials([(m, l_sum, o), empty]), o / l_sum[..., None], rtol=1e-6)


def test_gpu_kernel_runs_only_where_it_can_and_says_why_not(caplog, monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    assert resolve_attention("xla", "gpu", 128) == "xla"
    assert resolve_attention("gpu_kernel", "gpu", 128) == "gpu_kernel"
    for platform, head, devices, why in [("cpu", 64, 1, "GPU only"), ("gpu", 80, 1, "head size 80"),
                                         ("gpu", 8, 1, "head size 8"), ("gpu", 64, 2, "2 devices")]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=decode_kernel.__name__):
            assert resolve_attention("gpu_kernel", platform, head, devices) == "xla"
        assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()
    monkeypatch.setenv(INTERPRET_ENV, "1")
    assert resolve_attention("gpu_kernel", "cpu", 8) == INTERPRET


def test_the_config_names_the_field_of_an_unknown_attention():
    assert InferenceServerConfig().attention == "xla"
    with pytest.raises(ConfigError, match=r"inference\.attention: must be one of xla, gpu_kernel, got 'flash'"):
        InferenceServerConfig(attention="flash")


# ------------------------------------------------------------------------------------- the sampler, end to end

ARCH = LlamaConfig(seq_len=512, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   gradient_checkpointing=False)
VOCAB = 300


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=3, init_std=0.3))


@pytest.fixture
def kernel_steps(monkeypatch):
    """Records each decode step the kernel traces (the real kernel still runs): the two paths give the same
    samples, so this is what shows that a setting reached the sampler."""
    steps = []
    original = KernelDecodeAttention.__call__

    def traced(self, *args):
        steps.append(self.block)
        return original(self, *args)

    monkeypatch.setattr(KernelDecodeAttention, "__call__", traced)
    return steps


def test_the_sampler_with_the_kernel_samples_what_the_xla_attention_samples(model, kernel_steps):
    """Prompts of random lengths (left padding), 3 samples each, a stop token that ends rows early, 300 new tokens
    (every phase's block): the same tokens, and logprobs within float32 rounding (a logprob is a difference of
    logits of size ~10, each from attention outputs equal within a few ulps: 1e-5 is a few hundred ulps of it)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, k).tolist() for k in (3, 21, 40)]
    kwargs = dict(n=3, temperature=1.0, max_tokens=300, stop_sequences=[(7,)], seed=5)
    xla = scan_sampler.sample(model, prompts, **kwargs)
    assert not kernel_steps
    kernel = scan_sampler.sample(model, prompts, attention=INTERPRET, **kwargs)
    assert set(kernel_steps) == {0, 1, 2, 3}  # every phase's loop ran the kernel
    assert 1 < min(xla.lengths) < 300  # rows that stop early
    assert max(xla.lengths) > decode_blocks(bucket(300, 16))[2][0]  # and rows that reach the last phase
    np.testing.assert_array_equal(kernel.lengths, xla.lengths)
    np.testing.assert_array_equal(kernel.stopped, xla.stopped)
    for r, length in enumerate(xla.lengths):
        np.testing.assert_array_equal(kernel.tokens[r, :length], xla.tokens[r, :length])
        np.testing.assert_allclose(kernel.logprobs[r, :length], xla.logprobs[r, :length], atol=1e-5, rtol=0)


def test_in_flight_chunks_run_the_kernel_too(model, kernel_steps):
    """A call with in-flight weight swaps (decode in chunks, `inflight.py`) takes the kernel as well."""
    prompts, kwargs = [[3, 4, 5], [9] * 11], dict(n=2, temperature=1.0, max_tokens=12, stop_sequences=[], seed=2)
    xla = scan_sampler.sample(model, prompts, **kwargs)
    swaps = WeightSwaps(lambda: None, model, 0, every_tokens=5)
    kernel = scan_sampler.sample(model, prompts, swaps=swaps, attention=INTERPRET, **kwargs)
    assert kernel_steps
    np.testing.assert_array_equal(kernel.tokens, xla.tokens)
    np.testing.assert_allclose(kernel.logprobs, xla.logprobs, atol=1e-5, rtol=0)


def test_the_server_runs_the_kernel_its_config_asks_for(model, monkeypatch, kernel_steps):
    """`inference.attention: gpu_kernel` reaches the sampler: with the tests' switch, the kernel in interpret mode
    gives the XLA attention's samples (greedy and sampled)."""
    monkeypatch.setenv(INTERPRET_ENV, "1")
    servers = {a: InferenceServer(InferenceServerConfig(attention=a), model, byte_tokenizer(VOCAB)).start()
               for a in ("xla", "gpu_kernel")}
    assert servers["gpu_kernel"].attention == INTERPRET
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    for temperature in (0.0, 1.0):
        sampling = SamplingParams(temperature=temperature, max_tokens=24)
        xla = servers["xla"].generate(prompts, 2, sampling, seed=3)
        assert not kernel_steps
        kernel = servers["gpu_kernel"].generate(prompts, 2, sampling, seed=3)
        assert kernel_steps
        kernel_steps.clear()
        for row_x, row_k in zip(xla, kernel):
            for gx, gk in zip(row_x, row_k):
                np.testing.assert_array_equal(gk.tokens, gx.tokens)
                np.testing.assert_allclose(gk.logprobs, gx.logprobs, atol=1e-5, rtol=0)
