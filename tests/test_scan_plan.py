"""The scan sampler's call plan (`inference/scan_plan.py`) and its two-part cache: how a batch is split into
device calls (per-device budget, `auto`), the decode phases, and that a long decode over the grouped cache
samples exactly what a full forward pass of the model gives."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask
from levanter.models.llama import LlamaConfig

from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.inference import sampler as scan_sampler
from marinrl.inference import scan_plan
from marinrl.inference.served_model import scan_cache_budget
from marinrl.models.policy_model import build_model

QWEN3_0P6B_KV = dict(layers=28, kv_heads=8, head_size=128, itemsize=2)  # 112 KiB of KV a token in bfloat16
GiB = 2**30


def test_the_recipe_batch_is_one_call_on_an_h100_and_sixteen_under_the_old_budget():
    per_prompt = scan_plan.kv_bytes_per_prompt(**QWEN3_0P6B_KV, p_len=256, t_len=768, n=16)
    assert per_prompt == 2 * 28 * 8 * 128 * 2 * (256 + 16 * 768)
    h100 = scan_plan.auto_cache_budget(59.38 * GiB, 1.2 * GiB)  # JAX's 75% of the card, the served weights
    plan = scan_plan.plan_calls(prompts=16, n=16, per_prompt_bytes=per_prompt, budget_bytes=h100, kv_heads=8)
    assert (plan.calls, plan.rows_per_call) == (1, 256)
    old = scan_plan.plan_calls(prompts=16, n=16, per_prompt_bytes=per_prompt, budget_bytes=GiB, kv_heads=8)
    assert (old.calls, old.rows_per_call, old.prompts_per_call) == (16, 16, 1)


def test_the_budget_is_compared_per_device():
    per_prompt = 100
    one = scan_plan.plan_calls(prompts=8, n=4, per_prompt_bytes=per_prompt, budget_bytes=250, kv_heads=8)
    assert one.prompts_per_call == 2 and one.calls == 4
    # rows over 2 data devices and heads over 2 model devices: each device holds a quarter of the cache
    four = scan_plan.plan_calls(prompts=8, n=4, per_prompt_bytes=per_prompt, budget_bytes=250, kv_heads=8,
                                data=2, model=2)
    assert four.prompts_per_call == 8 and four.calls == 1 and four.per_device_cache_bytes == 200
    # heads the model axis cannot split stay whole on every device
    odd = scan_plan.plan_calls(prompts=8, n=4, per_prompt_bytes=per_prompt, budget_bytes=250, kv_heads=3, model=2)
    assert odd.prompts_per_call == 2


def test_a_call_holds_at_least_one_prompt_and_pads_to_a_bucket():
    plan = scan_plan.plan_calls(prompts=5, n=2, per_prompt_bytes=10**12, budget_bytes=1)
    assert (plan.prompts_per_call, plan.calls) == (1, 5)
    plan = scan_plan.plan_calls(prompts=5, n=2, per_prompt_bytes=1, budget_bytes=10**9, min_prompts=8)
    assert (plan.prompts_per_call, plan.calls) == (8, 1)
    plan = scan_plan.plan_calls(prompts=100, n=1, per_prompt_bytes=1, budget_bytes=10**9)
    assert (plan.prompts_per_call, plan.calls) == (128, 1)


def test_auto_budget():
    assert scan_plan.auto_cache_budget(None, 0) == scan_plan.CPU_CACHE_BYTES
    assert scan_plan.auto_cache_budget(10 * GiB, 2 * GiB) == int(scan_plan.AUTO_CACHE_SHARE * 8 * GiB)
    assert scan_cache_budget(12345, None) == 12345
    # JAX's CPU devices report no allocator limit: the CPU default
    stats = jax.local_devices()[0].memory_stats()
    expected = scan_plan.CPU_CACHE_BYTES if not (stats or {}).get("bytes_limit") else None
    if expected is not None:
        assert scan_cache_budget("auto", None) == expected


def test_the_config_takes_auto_or_a_positive_integer():
    assert InferenceServerConfig().scan_max_cache_bytes == "auto"
    assert InferenceServerConfig(scan_max_cache_bytes=4096).scan_max_cache_bytes == 4096
    for bad in (0, -1, "lots"):
        with pytest.raises(ValueError, match="inference.scan_max_cache_bytes"):
            InferenceServerConfig(scan_max_cache_bytes=bad)


@pytest.mark.parametrize("t_len", [16, 64, 256, 320, 768, 1024])
def test_decode_windows_cover_every_step(t_len):
    windows = scan_plan.decode_windows(t_len)
    assert windows[-1] == t_len and list(windows) == sorted(set(windows))
    assert len(windows) == (1 if t_len <= scan_plan.PHASE_MIN_TOKENS else scan_plan.MAX_PHASES)
    assert all(w % 16 == 0 for w in windows)
    # the blocks tile the generated cache; step t writes slot t - 1, which lies in the block its phase reads last
    blocks = scan_plan.decode_blocks(t_len)
    assert [start for start, _ in blocks] == [0, *windows[:-1]] and sum(size for _, size in blocks) == t_len
    for t in range(1, t_len):
        start, size = next(b for b in blocks if b[0] <= t - 1 < b[0] + b[1])
        assert start + size == next(w for w in windows if t <= w)
    if len(windows) > 1:  # the phases read well under the whole cache at every step
        assert scan_plan.generated_slots_read(t_len, t_len) < 0.7 * t_len * (t_len - 1)


# ---------------------------------------------------------------------- a long decode over the grouped cache

ARCH = LlamaConfig(seq_len=512, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   gradient_checkpointing=False)
VOCAB = 300
FWD_LEN = 384


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=3, init_std=0.3))


@jax.jit
def _forward_logits(model, ids):
    return model(hax.named(ids, ("batch", "position")), attn_mask=AttentionMask.causal()).array


def _reference(model, prompt, tokens, temperature):
    seq = list(prompt) + [int(t) for t in tokens]
    ids = np.zeros((1, FWD_LEN), np.int32)
    ids[0, :len(seq)] = seq
    logits = np.asarray(_forward_logits(model, jnp.asarray(ids)), np.float64)[0][len(prompt) - 1:len(seq) - 1]
    scaled = logits / (temperature or 1.0)
    logp = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) - scaled.max(
        -1, keepdims=True)
    return logp[np.arange(len(tokens)), np.asarray(tokens)], np.argmax(logits, -1)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_long_decode_in_phases_equals_a_full_forward_pass(model, temperature):
    """300 new tokens (4 decode phases) for prompts of different lengths (left padding), 3 samples each, with
    a stop token that ends some rows early: every logprob is the full forward pass's, and greedy tokens are
    its argmax."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, k).tolist() for k in (3, 17, 40)]
    assert len(scan_plan.decode_windows(scan_plan.bucket(300, 16))) == scan_plan.MAX_PHASES
    out = scan_sampler.sample(model, prompts, n=3, temperature=temperature, max_tokens=300,
                              stop_sequences=[(7,)], seed=11)
    lengths = out.lengths.tolist()
    assert max(lengths) > scan_plan.decode_windows(scan_plan.bucket(300, 16))[1]  # reached the third phase
    for r, length in enumerate(lengths):
        tokens = out.tokens[r, :length]
        assert out.stopped[r] == (tokens[-1] == 7) and (length == 300 or out.stopped[r])
        ref, argmax = _reference(model, prompts[r // 3], tokens, temperature)
        np.testing.assert_allclose(out.logprobs[r, :length], ref, atol=1e-4, rtol=0)
        if temperature == 0:
            np.testing.assert_array_equal(tokens, argmax)
    if temperature:
        assert len({tuple(out.tokens[r, :lengths[r]]) for r in range(3)}) == 3  # a prompt's samples differ


# ------------------------------------------------------------------------------ data-parallel sampling


def test_a_model_one_device_holds_is_sampled_data_parallel():
    from marinrl.inference.sharding import DATA_PARALLEL_WEIGHT_SHARE, choose_model_axis_size

    h100 = 59.38 * GiB
    # Qwen3-0.6B in bfloat16 (1.2 GB) on 2 H100s: each samples its own rows
    assert choose_model_axis_size(2, 8, 16, 3072, 1.2e9, h100) == 1
    # an 8B model (16 GB) on 2 H100s: tensor parallel, the KV cache gets the room
    assert choose_model_axis_size(2, 8, 32, 14336, 16e9, h100) == 2
    assert choose_model_axis_size(8, 8, 32, 14336, DATA_PARALLEL_WEIGHT_SHARE * h100 + 1, h100) == 8
    # unknown memory: tensor parallel over the largest divisor that splits the heads
    assert choose_model_axis_size(4, 2, 8, 128, 1.0, None) == 2


def test_the_dry_run_chooses_the_same_axis():
    import runpy

    from marinrl.dry_run.engine_cache import RolloutDevice
    from marinrl.dry_run.meshes import rollout_model_axis_size
    from marinrl.recipe import parse_recipe

    recipe = runpy.run_path("experiments/grpo_math_qwen3_0p6b_one_gpu_node.py", run_name="recipe")["RECIPE"]
    job = parse_recipe(recipe, ["--model.hf_checkpoint=null"])
    assert rollout_model_axis_size(job, 2, RolloutDevice("gpu", "H100", 59.38 * GiB)) == 1
    assert rollout_model_axis_size(job, 2, RolloutDevice("gpu", "tiny", 2 * GiB)) == 2
    assert rollout_model_axis_size(job, 2, RolloutDevice("gpu")) == 2  # memory unknown


def test_the_generation_bench_plans_the_recipe_on_an_h100_as_one_call_of_256_rows():
    import json
    import pathlib
    import subprocess
    import sys

    bench = pathlib.Path(__file__).resolve().parents[1] / "bench" / "generation.py"
    out = subprocess.run([sys.executable, str(bench), "--plan", "h100", "--shape", "recipe"], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert (plan["calls"], plan["rows_per_call"], plan["device"]) == (1, 256, "NVIDIA H100")
    # the roofline of the bytes a step reads: about 54k tokens/s at 3.35 TB/s (docs/inference.md)
    assert 15e9 < plan["bytes_per_step"] < 16.5e9
    assert plan["roofline_tokens_per_s"] == pytest.approx(256 * 3.35e12 / plan["bytes_per_step"])
    bad = subprocess.run([sys.executable, str(bench), "--plan", "h900"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "h900" in bad.stderr
