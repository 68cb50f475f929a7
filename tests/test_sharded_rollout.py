"""A rollout model sharded over the 4 fake CPU devices (tensor parallel over "model", generation rows
over "data") samples what one device samples: the same tokens, and logprobs equal to float32
rounding; weights from the weight transfer arrive on its shardings; reload recompiles nothing; a
model axis that cannot split the devices or the model is one clear error.

The logprob bound follows from float32, not from this machine's results. Sharding reassociates the
sums of the attention output and MLP down projections (partial sums per device, then an all-reduce),
and a sum of n float32 terms computed in two orders differs by at most n · eps32 · Σ|terms|. The
longest such sum has n = intermediate_dim terms; the terms feeding a logit are of order one (RMS-
normalised hidden states times weights of std 0.02 over 64 inputs), and a logprob's error is at most
twice its logits' error (the token's logit and the log-sum-exp), so n · eps32 · max(1, |logprob|)
covers it with room; a factor 4 covers the two layers and second-order terms. Tokens must match
exactly: a rounding-level change moves a sampled token only when its uniform draw falls within
~1e-6 of a CDF boundary, which these few hundred draws do not.
"""

from __future__ import annotations

import uuid

import equinox as eqx
import jax
import numpy as np
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.model import ModelConfig
from marinrl.config.server import EngineConfig, InferenceServerConfig
from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.inference import sampler as scan_sampler
from marinrl.inference.context import SamplingParams
from marinrl.inference.server import InferenceServer
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.transfer.endpoints import build_client, build_server

# 8 query heads over 4 KV heads (grouped-query attention, 2 per group): 4 devices hold one KV head each
ARCH = LlamaConfig(seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=8, num_kv_heads=4,
                   gradient_checkpointing=False)
VOCAB = 512
EPS32 = float(np.finfo(np.float32).eps)


def _model(seed: int):
    return build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=seed))


def logprob_bound(logprobs) -> float:
    scale = max(1.0, float(np.max(np.abs(np.concatenate(logprobs)))))
    return 4 * EPS32 * ARCH.intermediate_dim * scale


@pytest.fixture(scope="module")
def model():
    return _model(0)


def _server(model, **kw):
    return InferenceServer(InferenceServerConfig(**kw), model, byte_tokenizer(VOCAB)).start()


@pytest.fixture(scope="module")
def one_device(model):
    srv = _server(model)  # the CPU default: no mesh, one device
    assert srv.mesh is None
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module", params=[4, 2, 1], ids=["model4", "data2_x_model2", "data4"])
def sharded(request, model):
    srv = _server(model, model_axis_size=request.param)
    yield srv
    srv.shutdown()


def _prompts(seed, k=6):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, rng.integers(2, 14)).tolist() for _ in range(k)]


def _flat(gens):
    return [g for row in gens for g in row]


def test_the_weights_are_split_over_the_devices(sharded):
    mesh = sharded.mesh
    assert len(jax.devices()) == 4 and mesh.mesh.devices.size == 4
    m = mesh.model_axis_size
    attn, mlp = sharded.model.transformer.layers.stacked.self_attn, sharded.model.transformer.layers.stacked.mlp
    q = attn.q_proj.weight.array  # (layer, kv_head, q_heads_per_group, head_size, embed)
    assert {s.data.shape[1] for s in q.addressable_shards} == {ARCH.num_kv_heads // m}
    assert {s.data.shape[1] for s in mlp.gate_proj.weight.array.addressable_shards} == {ARCH.intermediate_dim // m}
    assert {s.data.shape[0] for s in sharded.model.lm_head.weight.array.addressable_shards} == {VOCAB // m}


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["T1", "T0.7", "greedy"])
def test_sharded_generation_equals_one_device(one_device, sharded, temperature):
    prompts = _prompts(1)
    sp = SamplingParams(temperature=temperature, max_tokens=20)
    want = _flat(one_device.generate(prompts, n=3, sampling=sp, seed=7))
    got = _flat(sharded.generate(prompts, n=3, sampling=sp, seed=7))
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.tokens, w.tokens)
    bound = logprob_bound([w.logprobs for w in want])
    diff = max(float(np.max(np.abs(g.logprobs - w.logprobs))) for g, w in zip(got, want))
    assert diff <= bound, (diff, bound)
    if temperature > 0:  # the samples are random draws, not one repeated sequence
        assert len({tuple(w.tokens) for w in want}) == len(want)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["T1", "greedy"])
def test_sharded_engine_equals_one_device(model, temperature):
    """Levanter's engine, built and run under the rollout mesh and axis mapping (its paged KV cache is
    split by KV head too)."""
    engine = EngineConfig(max_seqs=16, max_seq_len=96, max_prefill_tokens=256)
    prompts = _prompts(3, k=4)
    sp = SamplingParams(temperature=temperature, max_tokens=20)
    out = {}
    for size in (None, 4):
        srv = _server(model, backend="engine", engine=engine, model_axis_size=size)
        try:
            out[size] = _flat(srv.generate(prompts, n=3, sampling=sp, seed=7))
        finally:
            srv.shutdown()
    want, got = out[None], out[4]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.tokens, w.tokens)
    bound = logprob_bound([w.logprobs for w in want])
    assert max(float(np.max(np.abs(g.logprobs - w.logprobs))) for g, w in zip(got, want)) <= bound


def test_transfer_delivers_onto_the_shards_and_reload_recompiles_nothing(one_device, sharded, tmp_path):
    prompts = _prompts(2)
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    before = _flat(sharded.generate(prompts, 1, sp, 0))
    one_device.generate(prompts, 1, sp, 0)  # its compile too happens before the count
    compiled = scan_sampler.compiled_shapes()

    transfer = FilesystemTransferConfig(root=f"memory://sharded-{uuid.uuid4().hex[:10]}", format="packed")
    publisher = build_server(transfer)
    try:
        client = build_client(transfer, sharded.model)  # its skeleton: the served model's shardings
        new = _model(1)
        publisher.publish(new, 1)  # from one device, as a single-host trainer publishes
        update = client.poll()
    finally:
        publisher.close()
    arrived = jax.tree.leaves(eqx.filter(update.model, eqx.is_array))
    served = jax.tree.leaves(eqx.filter(sharded.model, eqx.is_array))
    assert all(a.sharding == s.sharding for a, s in zip(arrived, served))

    sharded.reload(update.model, weight_step=1)
    # already on the rollout shardings: served as delivered, not copied again
    assert all(a is s for a, s in zip(arrived, jax.tree.leaves(eqx.filter(sharded.model, eqx.is_array))))
    other = _flat(sharded.generate(prompts, 1, sp, 0))
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(before, other))
    one_device.reload(new, weight_step=1)
    try:
        for a, b in zip(other, _flat(one_device.generate(prompts, 1, sp, 0))):
            np.testing.assert_array_equal(a.tokens, b.tokens)
    finally:
        one_device.reload(_model(0), weight_step=0)

    sharded.reload(_model(0), weight_step=2)  # an unsharded model is put onto the shards
    assert all(x.sharding == s.sharding for x, s in zip(jax.tree.leaves(eqx.filter(sharded.model, eqx.is_array)),
                                                          served))
    for a, b in zip(before, _flat(sharded.generate(prompts, 1, sp, 0))):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    assert scan_sampler.compiled_shapes() == compiled  # neither reload compiled anything


@pytest.mark.parametrize("size, message", [
    (3, r"inference.model_axis_size is 3, which does not divide this host's 4 local devices"),
    (8, r"inference.model_axis_size is 8, which does not divide this host's 4 local devices"),
])
def test_a_model_axis_that_does_not_divide_the_devices_is_a_config_error(model, size, message):
    with pytest.raises(ValueError, match=message):
        InferenceServer(InferenceServerConfig(model_axis_size=size), model, byte_tokenizer(VOCAB))


def test_a_model_axis_that_does_not_divide_the_heads_is_a_config_error():
    two_kv_heads = build_model(ModelConfig(model=LlamaConfig(
        seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
        gradient_checkpointing=False), vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"model_axis_size is 4, which does not divide the model's num_kv_heads \(2\)"):
        InferenceServer(InferenceServerConfig(model_axis_size=4), two_kv_heads, byte_tokenizer(VOCAB))
    with pytest.raises(ValueError, match="model_axis_size must be >= 1"):
        InferenceServerConfig(model_axis_size=0)
