"""The dry run's LM-head terms (issue 31, "Memory"): blockwise logits predicted below full-vocabulary ones by
exactly the logits they do not hold, the bfloat16 terms only under a bfloat16 compute dtype, and
`bench/train_step.py --shape vocab150k` parsing into the jobs the dry run plans (no step runs: seconds)."""

from __future__ import annotations

import dataclasses
import pathlib
import runpy
import sys

import pytest

from marinrl.dry_run import predicted_memory
from marinrl.dry_run.working_set import LOGITS_BLOCKS_LIVE
from marinrl.train.policy_forward import VOCAB_BLOCK

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(hidden_dim=64, intermediate_dim=160, num_layers=2, num_heads=4, num_kv_heads=2)


def _job(vocab: int, block: int | None, mp: str = "f32", rows: int = 8, per_device: int = -1):
    from marinrl.recipe import parse_recipe

    recipe = runpy.run_path(str(ROOT / "experiments" / "grpo_math_qwen3_0p6b.py"), run_name="recipe")["RECIPE"]
    job = parse_recipe(recipe, ["--model.hf_checkpoint=null", f"--trainer.per_device_parallelism={per_device}",
                                "--groups_per_step=1", f"--n_generations={rows}"])
    from levanter.models.llama import LlamaConfig

    model = LlamaConfig(seq_len=512, **TINY, tie_word_embeddings=False, cross_entropy_block_size=block)
    return dataclasses.replace(job, model=dataclasses.replace(job.model, model=model, vocab_size=vocab),
                               trainer=dataclasses.replace(job.trainer, mp=mp))


def _plan(job, prompt: int = 128, response: int = 384):
    return predicted_memory(job, "trainer", 1, prompt_tokens=prompt, response_tokens=response, cpu=True)


def test_blockwise_logits_are_predicted_below_full_ones_by_the_logits_they_skip():
    vocab, block, rows, length = 8192, 2048, 8, 512
    blockwise = _plan(_job(vocab, block)).bytes_per_device
    full = _plan(_job(vocab, vocab)).bytes_per_device
    tokens = rows * length
    assert full["logits"] == LOGITS_BLOCKS_LIVE * tokens * vocab * 4  # three float32 [tokens, vocab] arrays
    assert blockwise["logits"] == LOGITS_BLOCKS_LIVE * tokens * block * 4  # a multiple of the block: no remainder
    assert {k: v for k, v in blockwise.items() if k != "logits"} == {k: v for k, v in full.items() if k != "logits"}
    assert sum(full.values()) - sum(blockwise.values()) == LOGITS_BLOCKS_LIVE * tokens * (vocab - block) * 4
    # the head's gradient is vocab × hidden whatever the block (float32 compute here)
    assert full["lm_head_gradient"] == vocab * TINY["hidden_dim"] * 4
    # the remainder block is counted beside the loop's: 8192 = 3 × 2500 + 692
    ragged = _plan(_job(vocab, 2500)).bytes_per_device["logits"]
    assert ragged == tokens * 4 * (LOGITS_BLOCKS_LIVE * 2500 + 692)


def test_the_default_block_at_qwen3s_vocabulary():
    plan = _plan(_job(151_936, None)).bytes_per_device
    tokens = 8 * 512
    assert plan["logits"] == tokens * 4 * (LOGITS_BLOCKS_LIVE * VOCAB_BLOCK + 151_936 - 4 * VOCAB_BLOCK)
    full = _plan(_job(151_936, 151_936))
    assert full.peak_bytes_per_device > 2 * _plan(_job(151_936, None)).peak_bytes_per_device


def test_bfloat16_compute_adds_its_logits_copy_and_parameter_copy_only():
    f32 = _plan(_job(8192, 2048)).bytes_per_device
    bf16 = _plan(_job(8192, 2048, mp="p=f32,c=bfloat16")).bytes_per_device
    assert "logits_compute_copy" not in f32 and "compute_parameters" not in f32
    assert bf16["logits_compute_copy"] == 8 * 512 * 2048 * 2
    assert bf16["compute_parameters"] == pytest.approx(bf16["parameters"] / 2, rel=1e-6)
    assert bf16["lm_head_gradient"] == f32["lm_head_gradient"] / 2
    assert bf16["logits"] == f32["logits"]  # float32 whatever the compute dtype
    # on fake FSDP devices XLA:CPU's whole gathered copy takes the sharded copy's place
    fsdp = predicted_memory(_job(8192, 2048, mp="p=f32,c=bfloat16", per_device=4), "trainer", 2, prompt_tokens=128,
                            response_tokens=384, cpu=True).bytes_per_device
    assert "compute_parameters" not in fsdp and fsdp["gathered_parameters"] > 0


def test_the_bench_vocab150k_shape_parses_into_what_the_dry_run_plans():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import train_step
    finally:
        sys.path.remove(str(ROOT / "bench"))
    args = train_step._parse_args(["--shape", "vocab150k"])
    assert args.modes == "kl_0+blockwise,kl_0+full" and args.processes
    prompts, samples, max_length, _ = train_step.SHAPES["vocab150k"]
    plans = {}
    for spec in args.modes.split(","):
        mode = train_step.Mode.parse(spec, args)
        assert mode.model.vocab_size == 151_936 and mode.batching.layout == "padded"
        job = train_step.mode_job(mode, prompts * samples, prompts)
        assert job.groups_per_step * job.n_generations == prompts * samples
        plans[mode.logits] = _plan(job, *train_step.FIXED_LENGTHS["vocab150k"])
    tokens = prompts * samples * max_length
    assert plans["full"].bytes_per_device["logits"] == LOGITS_BLOCKS_LIVE * tokens * 151_936 * 4
    assert 2 * plans["blockwise"].peak_bytes_per_device < plans["full"].peak_bytes_per_device
    assert not train_step._parse_args(["--shape", "reference"]).processes
    with pytest.raises(SystemExit):
        train_step.Mode.parse("kl_0+wide", args)
