"""`model.lm_head_float32`: the LM head in float32 on both sides of the sampler/trainer mismatch.

A bfloat16 model built so that the head is the only place the sampler and the trainer can differ: its one
layer's weights are zero (attention and MLP add nothing) and every embedding row is ±16, so the final RMS norm
makes the hidden state exactly ±1 in any program, whatever it fuses. Its logits are then h · W for a known
h ∈ {±1}^64, the products exact in float32, and a float64 reference gives every logprob. The head weights,
N(0, 1) in bfloat16, give logits of scale 8 (up to ~50), as peaked as a trained model's: bfloat16 logits
(8 significant bits) round each by up to 0.06 there.

What float32 rounding allows: a sum of E = 64 exact products is off by at most E · eps32 · A_t (A_t = Σ_k |W_kv|
at its largest over v, divided by T), the logprob z_o − logsumexp(z) by twice that, plus a few eps32 of its own
size. The float32 head (trainer, scan sampler, engine) must be within that bound of the reference on every token;
the bfloat16 head (the default) must be off by more, or this test could not tell them apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.models.llama import LlamaConfig, LlamaLMHeadModel

from marinrl.config.batching import BatchingConfig
from marinrl.config.errors import ConfigError
from marinrl.config.server import EngineConfig, InferenceServerConfig
from marinrl.inference.context import SamplingParams
from marinrl.inference.levanter_engine import Float32Head, with_float32_head
from marinrl.inference.server import InferenceServer
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.train.batching import make_training_batch
from marinrl.train.policy_forward import token_logprobs
from marinrl.types import Rollout, RolloutMetadata

EPS32 = float(np.finfo(np.float32).eps)
VOCAB, EMBED = 512, 64
ARCH = LlamaConfig(seq_len=128, hidden_dim=EMBED, intermediate_dim=128, num_layers=1, num_heads=4, num_kv_heads=2,
                   gradient_checkpointing=False)
PROMPTS = [[1, 70, 71, 72], [1, 80, 81], [1, 90, 91, 92, 93, 94]]
N, MAX_TOKENS = 2, 6
TESTS = pathlib.Path(__file__).resolve().parent


def head_only_model() -> LlamaLMHeadModel:
    """bfloat16; zero layer weights, ±16 embeddings, N(0, 1) head (module doc)."""
    model = eqx.filter_jit(LlamaLMHeadModel.init)(hax.Axis("vocab", VOCAB), ARCH, key=jax.random.PRNGKey(0))
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    model = eqx.tree_at(lambda m: m.transformer.layers, model,
                        jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_inexact_array(x) else x,
                                     model.transformer.layers))
    rng = np.random.default_rng(0)
    emb = model.embeddings.token_embeddings.weight
    signs = np.where(rng.random(emb.array.shape) < 0.5, -16.0, 16.0)
    model = eqx.tree_at(lambda m: m.embeddings.token_embeddings.weight.array, model,
                        jnp.asarray(signs, jnp.bfloat16))
    head = model.lm_head.weight
    model = eqx.tree_at(lambda m: m.lm_head.weight.array, model,
                        jnp.asarray(rng.standard_normal(head.array.shape), jnp.bfloat16))
    return model


def reference_logprobs(model, prev_tokens: np.ndarray, tokens: np.ndarray, temperature: float):
    """float64 log softmax((h · W) / T)[token] with h = sign(embedding of the token before), and the bound."""
    emb = np.asarray(model.embeddings.token_embeddings.weight.rearrange(("vocab", "embed")).array, np.float64)
    w = np.asarray(model.get_lm_head().rearrange(("embed", "vocab")).array, np.float64)
    h = np.sign(emb[prev_tokens])
    z = h @ w / temperature
    logz = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    logp = z[np.arange(len(tokens)), tokens] - logz
    scale = np.abs(w).sum(0).max() / temperature
    bound = 2 * EMBED * EPS32 * scale + 8 * EPS32 * (np.abs(logp) + np.log(VOCAB))
    return logp, bound


def _rollouts(prompts, generations, temperature):
    out = []
    for i, (prompt, gens) in enumerate(zip(prompts, generations)):
        for g in gens:
            n = len(g.tokens)
            out.append(Rollout(
                prompt_tokens=np.asarray(prompt), response_tokens=g.tokens, response_logprobs=g.logprobs,
                temperature=temperature, loss_mask=np.ones(n, np.float32), token_rewards=np.zeros(n, np.float32),
                episode_reward=0.0, finish_reason=g.finish_reason, env_name="t", lesson_id="t", group_id=str(i),
                metadata=RolloutMetadata(worker_id="w", weight_step=0, created_at=0.0)))
    return out


def _generate(model, backend: str, lm_head_float32: bool, temperature: float):
    config = InferenceServerConfig(backend=backend, lm_head_float32=lm_head_float32,
                                   engine=EngineConfig(max_seqs=8, max_seq_len=32, max_prefill_tokens=64,
                                                       compute_dtype="bfloat16"))
    with InferenceServer(config, model, byte_tokenizer(VOCAB)) as server:
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature)
        return server.generate(PROMPTS, N, sampling, seed=3)


def _sampler_errors(model, generations, temperature):
    """|sampler logprob − reference| per response token, and the bound there."""
    errors, bounds = [], []
    for prompt, gens in zip(PROMPTS, generations):
        for g in gens:
            prev = np.asarray([prompt[-1], *g.tokens[:-1]])
            ref, bound = reference_logprobs(model, prev, np.asarray(g.tokens), temperature)
            errors.append(np.abs(g.logprobs - ref))
            bounds.append(bound)
    return np.concatenate(errors), np.concatenate(bounds)


def _trainer_errors(model, temperature, lm_head_float32: bool):
    """|trainer logprob − reference| on the response tokens of a float32-head scan sampler's rollouts, and the bound."""
    generations = _generate(model, "scan", True, temperature)
    rows = len(PROMPTS) * N
    batch = make_training_batch(_rollouts(PROMPTS, generations, temperature), [0.0] * rows, batch_size=rows,
                                config=BatchingConfig(max_length=32, min_bucket=16))
    mask = np.asarray(batch.loss_mask.array) > 0
    inputs, targets = np.asarray(batch.input_ids.array), np.asarray(batch.target_ids.array)
    prev = np.take_along_axis(inputs, np.asarray(batch.source_positions.array), axis=1)[mask]
    ref, bound = reference_logprobs(model, prev, targets[mask], temperature)
    logp = np.asarray(eqx.filter_jit(token_logprobs)(model, batch, lm_head_float32=lm_head_float32).array)[mask]
    return np.abs(logp - ref), bound


def strict_precision_errors() -> dict:
    """Every side's largest error and bound, float32 head and not: run under
    `--xla_allow_excess_precision=false` (`test_head_is_float32_with_the_switch`)."""
    model = head_only_model()
    out = {}
    for f32 in (True, False):
        for backend in ("scan", "engine"):
            errors, bound = _sampler_errors(model, _generate(model, backend, f32, 0.7), 0.7)
            out[f"{backend} f32={f32}"] = (float(errors.max()), float(bound.min()), float(bound.max()))
        for t in (1.0, 0.7):
            errors, bound = _trainer_errors(model, t, f32)
            out[f"trainer T={t} f32={f32}"] = (float(errors.max()), float(bound.min()), float(bound.max()))
    return out


def test_the_model_makes_the_head_the_only_difference():
    model = head_only_model()
    h = model.transformer.norm(model.embeddings.embed(hax.named(jnp.arange(VOCAB), "position")))
    assert np.all(np.abs(np.asarray(h.array, np.float64)) == 1.0)


def test_head_is_float32_with_the_switch():
    """Scan sampler, engine and trainer: with the switch every logprob is within float32 rounding of the float64
    reference; without it the largest error is more than 10x the bound. In a child process with XLA's
    `--xla_allow_excess_precision=false`: by default XLA:CPU computes a bfloat16 dot in float32 and drops the
    rounding of its output to bfloat16 before the cast to float32 (the bfloat16 head then measured as exact as
    the float32 one here), which no accelerator promises; with the flag each bfloat16 result is rounded as the
    program says."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_allow_excess_precision=false",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}
    code = "import json, test_lm_head_float32 as t; print(json.dumps(t.strict_precision_errors()))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for name, (error, bound_min, bound_max) in result.items():
        if name.endswith("f32=True"):
            assert error <= bound_min, (name, error, bound_min)
        else:
            assert error > 10 * bound_max, (name, error, bound_max)


def test_gradients_with_the_float32_head_equal_the_unblocked_float32_reference():
    """d Σ log π / d weights through the blockwise float32 head equal those of a plain full-vocabulary float32
    log softmax over the same bfloat16 hidden state and weights. Both chains cast the float32 gradients back
    to bfloat16 at the same points, so each element agrees up to one bfloat16 rounding (2^-8 relative) of the
    larger, plus float32 noise at the gradients' scale."""
    model = LlamaLMHeadModel.init(hax.Axis("vocab", VOCAB), ARCH, key=jax.random.PRNGKey(1))
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    rng = np.random.default_rng(1)
    rows, length = 4, 16
    ids = rng.integers(0, VOCAB, size=(rows, length + 1))
    rollouts = [Rollout(prompt_tokens=ids[r, :4], response_tokens=ids[r, 4:], temperature=0.8,
                        response_logprobs=np.zeros(length - 3, np.float32), loss_mask=np.ones(length - 3, np.float32),
                        token_rewards=np.zeros(length - 3, np.float32), episode_reward=0.0, finish_reason="length",
                        env_name="t", lesson_id="t", group_id=str(r),
                        metadata=RolloutMetadata(worker_id="w", weight_step=0, created_at=0.0))
                for r in range(rows)]
    batch = make_training_batch(rollouts, [0.0] * rows, batch_size=rows,
                                config=BatchingConfig(max_length=32, min_bucket=16))
    mask = batch.loss_mask.astype(jnp.float32)

    def blockwise(m):
        return hax.sum(token_logprobs(m, batch, lm_head_float32=True) * mask).scalar()

    def reference(m):
        from marinrl.train.policy_forward import _gather_positions, attention_mask

        out = m.activations(batch.input_ids, attention_mask(batch), key=None, pos_ids=batch.position_ids)
        out = _gather_positions(out, batch.source_positions)
        h = out.astype(jnp.float32) / batch.temperature
        z = hax.dot(h, m.get_lm_head().astype(jnp.float32), axis=m.Embed, precision=jax.lax.Precision.HIGHEST)
        logp = z - hax.nn.logsumexp(z, axis=m.Vocab)
        picked = hax.take(logp, m.Vocab, batch.target_ids)
        return hax.sum(picked * mask).scalar()

    got = eqx.filter_jit(eqx.filter_grad(blockwise))(model)
    want = eqx.filter_jit(eqx.filter_grad(reference))(model)
    leaves = zip(jax.tree.leaves(eqx.filter(got, eqx.is_inexact_array)),
                 jax.tree.leaves(eqx.filter(want, eqx.is_inexact_array)))
    checked = 0
    for g, w in leaves:
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(np.abs(w).max(), 1e-30)
        assert np.all(np.abs(g - w) <= 2.0 ** -8 * np.maximum(np.abs(g), np.abs(w)) + 64 * EPS32 * scale), (
            np.abs(g - w).max(), scale)
        checked += np.abs(w).max() > 0
    assert checked >= 5  # the head, the embeddings and the layer's projections all got gradients


def test_engine_head_wraps_tied_and_untied_weights_without_a_copy():
    model = head_only_model()
    wrapped = with_float32_head(model)
    assert isinstance(wrapped.lm_head, Float32Head) and wrapped.lm_head.weight.array is model.lm_head.weight.array
    tied = LlamaLMHeadModel.init(hax.Axis("vocab", VOCAB), dataclasses.replace(ARCH, tie_word_embeddings=True),
                                 key=jax.random.PRNGKey(2))
    assert tied.lm_head is None
    wrapped = with_float32_head(tied)
    assert wrapped.lm_head.weight.array is tied.embeddings.token_embeddings.weight.array


def test_a_job_sets_the_head_on_the_model_and_refuses_it_on_inference_alone(tmp_path):
    """One switch, `model.lm_head_float32`, reaches both the trainer's config and each rollout server's; set on
    `inference` alone a job is refused naming both fields (the trainer's head would stay bfloat16)."""
    import draccus
    import yaml

    from marinrl.job.plan import train_worker_config
    from marinrl.job.rl_job import RLJobConfig

    config = yaml.safe_load((TESTS.parent / "experiments" / "quickstart.yaml").read_text())
    config["run_root"] = str(tmp_path / "runs")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    bad = draccus.parse(RLJobConfig, config_path=str(path), args=["--inference.lm_head_float32", "true"])
    with pytest.raises(ConfigError, match=r"^RLJobConfig\.inference\.lm_head_float32: .*set model\.lm_head_float32"):
        bad.validate()
    good = draccus.parse(RLJobConfig, config_path=str(path), args=["--model.lm_head_float32", "true"])
    good.validate()
    assert train_worker_config(good).model.lm_head_float32
