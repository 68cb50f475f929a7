"""A job started from a Hugging Face checkpoint written by transformers: trainer and rollout worker read
it once per process, sharded over their meshes and outside jit, so their programs hold no weight-sized
constants; the job trains and resumes from its own checkpoint."""

from __future__ import annotations

import dataclasses
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_job import job_config

from marinrl.config.model import ModelConfig
from marinrl.job.rl_job import RLJob
from marinrl.models.hf_checkpoints import hf_reads, load_hf_checkpoint
from marinrl.models.policy_model import abstract_model, build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.program_audit import AUDIT_ENV, constant_bytes, sampler_constant_bytes

pytestmark = pytest.mark.timeout(1200)  # whole jobs: twice the suite's default (pyproject.toml), for a loaded machine

VOCAB = 512


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    byte_tokenizer(VOCAB).save_pretrained(path)
    return path


def _param_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def test_the_audit_sees_weights_a_program_closes_over(hf_path):
    """The failure the loader avoids, shown to the audit: a program that captures the weights (as a
    `model_init` traced under Levanter's jit did) holds all of them as constants; the sampler, which takes
    them as arguments, holds a few small tables."""
    model = load_hf_checkpoint(hf_path)
    params = _param_bytes(model)
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    closed_over = constant_bytes(jax.jit(lambda x: x + sum(jnp.sum(w) for w in leaves)), jnp.zeros(()))
    assert closed_over >= params
    assert sampler_constant_bytes(model) <= 0.01 * params


def test_abstract_model_plans_from_the_config_file_alone(hf_path):
    before = hf_reads()
    shape = abstract_model(ModelConfig(hf_checkpoint=hf_path), dtype="bfloat16")
    assert hf_reads() == before  # config.json only
    built = build_model(ModelConfig(hf_checkpoint=hf_path), dtype="bfloat16")
    assert hf_reads() == before + 1
    a = [x for x in jax.tree.leaves(shape) if isinstance(x, jax.ShapeDtypeStruct)]
    b = jax.tree.leaves(eqx.filter(built, eqx.is_array))
    assert [(x.shape, x.dtype) for x in a] == [(x.shape, x.dtype) for x in b]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(eqx.filter(built, eqx.is_inexact_array)))


def test_a_job_from_an_hf_checkpoint_reads_it_once_per_process_trains_and_resumes(tmp_path, hf_path, ray_session,
                                                                                   monkeypatch):
    monkeypatch.setenv(AUDIT_ENV, "1")  # actors measure their programs' constants (passed to them by the job)
    params = _param_bytes(load_hf_checkpoint(hf_path))
    cfg = job_config(tmp_path, model=ModelConfig(hf_checkpoint=hf_path), num_train_steps=2, checkpoint_every=2,
                     max_staleness=0, eval_every=0)
    first = RLJob(cfg).run()
    train = first.train
    assert train["final_step"] == 2 and all(np.isfinite(h["loss"]) for h in train["history"])
    processes = [train["process"], *(r["process"] for r in first.rollouts)]
    file_bytes = os.path.getsize(os.path.join(hf_path, "model.safetensors"))
    for p in processes:
        assert p["hf_reads"] == 1, p  # the trainer's policy and reference from one read; each rollout worker one
        assert p["hf_read_bytes"] == file_bytes, p  # one process holds all its mesh's devices: every byte, once
        assert p["jit_constant_bytes"] is not None and p["jit_constant_bytes"] <= 0.01 * params, p

    resumed = RLJob(dataclasses.replace(cfg, num_train_steps=3)).run()
    train = resumed.train
    assert train["first_step"] == 2 and train["final_step"] == 3 and train["resumed_from"]
    # the policy comes from the trainer's checkpoint: the source is read only for the KL reference, if any
    assert train["process"]["hf_reads"] == (1 if cfg.loss.uses_reference else 0)
    assert all(r["process"]["hf_reads"] == 1 for r in resumed.rollouts)


def test_a_rollout_model_is_read_straight_onto_its_tensor_parallel_mesh(hf_path):
    """Each weight arrives with the rollout sharding (split over the model axis where the mapping says so)
    and in the requested dtype; the server then serves those very buffers, placing nothing again."""
    from marinrl.config.server import InferenceServerConfig
    from marinrl.inference import sharding
    from marinrl.inference.served_model import load_served_model
    from marinrl.inference.server import InferenceServer

    config = InferenceServerConfig(model_axis_size=2)
    model = load_served_model(ModelConfig(hf_checkpoint=hf_path), config, dtype="bfloat16")
    where = sharding.rollout_mesh(model, 2)
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    targets = jax.tree.leaves(sharding.target_shardings(model, where))
    assert len(arrays) == len(targets)
    for x, s in zip(arrays, targets):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
    split = [x for x in arrays if max(sh.data.size for sh in x.addressable_shards) < x.size]
    assert len(split) >= 2 * 4  # per layer at least q/k/v/o and the MLP's gate/up/down are split
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    server = InferenceServer(config, model, byte_tokenizer(VOCAB))
    served = jax.tree.leaves(eqx.filter(server.model, eqx.is_array))
    assert all(a is b for a, b in zip(arrays, served))


def test_a_bf16_checkpoint_loads_in_the_dtype_asked_for(tmp_path):
    """Levanter's reader keeps bf16 tensors in bf16 whatever dtype it is given: a float32 trainer (or
    rollout worker) loading a bf16 checkpoint must still get float32 weights, equal to the bf16 values."""
    path = str(tmp_path / "bf16")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    as_bf16 = load_hf_checkpoint(path, dtype=jnp.bfloat16)
    as_f32 = load_hf_checkpoint(path, dtype=jnp.float32)
    pairs = list(zip(jax.tree.leaves(eqx.filter(as_bf16, eqx.is_inexact_array)),
                     jax.tree.leaves(eqx.filter(as_f32, eqx.is_inexact_array)), strict=True))
    assert all(b.dtype == jnp.bfloat16 and f.dtype == jnp.float32 for b, f in pairs)
    for b, f in pairs:  # bf16 -> f32 is exact
        np.testing.assert_array_equal(np.asarray(b.astype(jnp.float32)), np.asarray(f))
