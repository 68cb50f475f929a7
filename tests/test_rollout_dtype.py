"""The rollout dtype: `inference.dtype` puts the served weights (and the KV cache of the scan sampler and
of Levanter's engine) in bfloat16, a job derives it from the trainer's compute dtype, and the rollout
side serves the versions it receives as they arrive: a version in another dtype is refused, never cast."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.job import RLJobConfig
from marinrl.config.model import ModelConfig
from marinrl.config.server import EngineConfig, InferenceServerConfig
from marinrl.inference.context import SamplingParams
from marinrl.inference.server import InferenceServer
from marinrl.job.plan import train_worker_config
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer

ARCH = LlamaConfig(seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   gradient_checkpointing=False)
MODEL = ModelConfig(model=ARCH, vocab_size=512, seed=0)
BF16 = jnp.dtype("bfloat16")


def _dtypes(model) -> set:
    return {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))}


def test_a_bf16_server_samples_with_both_backends_and_refuses_an_f32_version():
    config = InferenceServerConfig(dtype="bfloat16", backend="scan", http_backend="engine", serve_http=True,
                                   engine=EngineConfig(max_seqs=4, max_seq_len=32, max_prefill_tokens=64, max_rounds=8))
    with InferenceServer(config, build_model(MODEL), byte_tokenizer(512)) as server:
        assert _dtypes(server.model) == {BF16}
        assert jnp.dtype(server._engine.engine_config.compute_dtype) == BF16  # follows inference.dtype
        sampling = SamplingParams(temperature=1.0, max_tokens=8)
        scan = server.generate([[1, 2, 3]], n=4, sampling=sampling, seed=0)
        engine = server.generate_requests([r for r in _requests(sampling)], backend="engine")
        for gen in [*scan[0], *engine[0]]:
            assert gen.tokens.size >= 1 and gen.logprobs.dtype == np.float32
            assert np.all(np.isfinite(gen.logprobs)) and np.all(gen.logprobs <= 0)
        with pytest.raises(ValueError, match="float32"):  # the receiving side never casts a version
            server.reload(build_model(MODEL), weight_step=1)


def _requests(sampling):
    from marinrl.inference.openai_api import TokenRequest

    return [TokenRequest([1, 2, 3], 2, sampling, 0, 0)]


def test_the_job_derives_the_rollout_and_publish_dtype_from_the_compute_dtype():
    cpu = RLJobConfig()
    assert cpu.rollout_dtype() == "float32" and train_worker_config(cpu).publish_dtype == "float32"
    import draccus

    scale = draccus.parse(RLJobConfig, args=["--trainer.mp", "p=f32,c=bfloat16"])
    assert scale.rollout_dtype() == "bfloat16" and train_worker_config(scale).publish_dtype == "bfloat16"
    pinned = draccus.parse(RLJobConfig, args=["--trainer.mp", "p=f32,c=bfloat16", "--inference.dtype", "float32"])
    assert pinned.rollout_dtype() == "float32"
    with pytest.raises(ValueError, match="inference.dtype"):
        InferenceServerConfig(dtype="int8")


def test_a_bad_publish_dtype_is_refused_naming_the_field():
    from marinrl.config.train_worker import TrainWorkerConfig

    with pytest.raises(ValueError, match="publish_dtype"):
        TrainWorkerConfig(publish_dtype="int8")
