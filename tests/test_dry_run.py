"""The dry run's numbers without lowering anything (seconds): each role's memory plan from shapes and
shardings, and the FLOPs rule, checked against closed forms written out here and against the parameters
of a real (abstract) Levanter model. The recipes' full dry runs are in tests/test_recipes.py."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import runpy

import jax.numpy as jnp
import pytest

from marinrl.dry_run import flops, predicted_memory
from marinrl.dry_run.shapes import GiB, abstract_model, count

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _recipe(name: str = "grpo_math_qwen3_0p6b"):
    from marinrl.recipe import parse_recipe

    return parse_recipe(runpy.run_path(str(ROOT / "experiments" / f"{name}.py"), run_name="recipe")["RECIPE"], [])


def _with_model(job, **changes):
    return dataclasses.replace(job, model=dataclasses.replace(job.model, model=dataclasses.replace(
        job.model.model, **changes)))


def _with(job, section: str, **changes):
    return dataclasses.replace(job, **{section: dataclasses.replace(getattr(job, section), **changes)})


TINY = dict(hidden_dim=64, intermediate_dim=160, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32)
"""A Qwen3-shaped model small enough to count by hand (head_dim × heads = 128 ≠ hidden, as in Qwen3)."""


@pytest.mark.parametrize("name", ["grpo_math_qwen3_0p6b", "grpo_math_llama3_8b_v5p"])
def test_matmul_params_are_the_models_parameters_less_norms_and_lookup(name):
    """ModelDims counts what a real Levanter model of that config holds: every parameter is a matmul
    weight, a norm scale, or (untied) the embedding table."""
    job = _recipe(name)
    fields = {f.name for f in dataclasses.fields(job.model.model)}
    tiny = dataclasses.replace(job.model.model, **{k: v for k, v in TINY.items() if k in fields})
    dims = flops.ModelDims.of(tiny, 300)
    model = abstract_model(tiny, 300, jnp.float32)
    qk_norms = 2 * dims.head_dim if "Qwen" in type(model).__name__ else 0
    norms = dims.layers * (2 * dims.hidden + qk_norms) + dims.hidden
    lookup = 0 if dims.tied_embeddings else dims.vocab * dims.hidden
    assert count(model) == dims.matmul_params + norms + lookup


def test_generation_flops_are_every_prefill_and_every_decode_step():
    dims = flops.ModelDims(hidden=64, intermediate=160, layers=3, heads=4, kv_heads=2, head_dim=32, vocab=300,
                           tied_embeddings=True)
    n = dims.layers * (64 * (128 + 2 * 64) + 128 * 64 + 3 * 64 * 160) + 64 * 300  # written out
    assert dims.matmul_params == n
    per_key = 4 * dims.layers * 128
    prompts, samples, prompt = 3, 5, 7
    for response in (1, 2, 9, 40):
        g = flops.generation_flops(dims, prompts, samples, prompt, response)
        # prefill: each position i (1-based) attends to i keys; decode: the token at position prompt + k - 1
        # (k = 1 .. response - 1) attends to prompt + k keys
        prefill = prompts * sum(2 * n + per_key * i for i in range(1, prompt + 1))
        decode = prompts * samples * sum(2 * n + per_key * (prompt + k) for k in range(1, response))
        assert g.prefill == prefill and g.decode == decode and g.total == prefill + decode
        assert g.decode_tokens == prompts * samples * (response - 1)
    # one more token per row costs one more decode step of every row, at the longer context
    a, b = flops.generation_flops(dims, prompts, samples, prompt, 40), flops.generation_flops(dims, prompts, samples,
                                                                                              prompt, 41)
    assert b.total - a.total == prompts * samples * (2 * n + per_key * (prompt + 40))


def test_executed_train_flops_add_exactly_the_recompute_of_checkpointed_layers():
    job = _recipe()
    dims = flops.ModelDims.of(job.model.model, job.model.vocab_size)
    rows, length = 512, 1024
    on, off = (flops.train_flops(dims, rows, length, flops.recomputed_forward_passes(policy))
               for policy in (True, False))
    layer_forward = 2 * dims.layers * dims.layer_matmul_params * rows * length + \
        4 * dims.layers * dims.q_dim * rows * length * (length + 1) // 2
    assert on.model == off.model == 3 * (2 * dims.matmul_params * rows * length +
                                         4 * dims.layers * dims.q_dim * rows * length * (length + 1) // 2)
    assert on.executed - on.model == on.recompute == layer_forward
    assert off.executed == off.model and off.recompute == 0
    assert flops.recomputed_forward_passes("nested") == 2 and flops.recomputed_forward_passes("offload") == 1
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        flops.recomputed_forward_passes("sometimes")


def test_the_dry_run_counts_the_configs_checkpointing():
    from marinrl.dry_run.report import DryRunShapes, step_flops

    job = _recipe()
    on = step_flops(_with_model(job, gradient_checkpointing=True), DryRunShapes())[0]
    off = step_flops(_with_model(job, gradient_checkpointing=False), DryRunShapes())[0]
    assert on.model == off.model and off.executed == off.model and on.executed > on.model


ONE_H100 = ("--ray.trainer.tpu", "null", "--ray.trainer.num_gpus", "1", "--ray.trainer.accelerator_type", "H100",
            "--trainer.per_device_parallelism", "16")
"""The 0.6B recipe's update on one H100 (16-row microbatches of 1,024 tokens): the device check's shape."""


def _one_h100():
    from marinrl.recipe import parse_recipe

    text = runpy.run_path(str(ROOT / "experiments" / "grpo_math_qwen3_0p6b.py"), run_name="recipe")["RECIPE"]
    return parse_recipe(text, list(ONE_H100))


def test_auto_checkpointing_is_off_where_the_update_fits_the_device_and_on_where_it_does_not():
    from marinrl.dry_run.engine_cache import DEVICE_MEMORY_GIB, GPU_MEMORY_FRACTION, trainer_device_bytes
    from marinrl.dry_run.memory import CHECKPOINTING_FIT_SHARE, choose_update_memory
    from marinrl.dry_run.shapes import GiB

    job = _one_h100()
    assert (job.model.model.gradient_checkpointing, job.model.model.attn_backend) == ("auto", "auto")
    h100 = trainer_device_bytes(job)
    # `auto` attention on this GPU (no Transformer Engine here) is a flash attention: without recomputation
    # the layers keep no scores (~44 GiB), so the update fits the H100 without recomputing
    flash = choose_update_memory(job, h100)
    assert not flash.on and flash.peak_without_bytes < CHECKPOINTING_FIT_SHARE * h100
    job = _with_model(job, attn_backend="vanilla")  # the scores of every layer kept, as Levanter's GPU fallback
    assert h100 == DEVICE_MEMORY_GIB["H100"] * GPU_MEMORY_FRACTION * GiB  # the 59.4 GiB JAX has on one H100
    without = predicted_memory(_with_model(job, gradient_checkpointing=False), "trainer", 1,
                               prompt_tokens=job.batching.max_length).peak_bytes_per_device
    with_it = predicted_memory(_with_model(job, gradient_checkpointing=True), "trainer", 1,
                               prompt_tokens=job.batching.max_length).peak_bytes_per_device
    # ~22 and ~85 GiB: without it, every layer's float32 attention scores too (an H200 measured a 74.8 GiB peak)
    assert with_it < CHECKPOINTING_FIT_SHARE * h100 < without
    on = choose_update_memory(job, h100)
    assert (on.on, on.peak_without_bytes, on.device_bytes) == (True, without, h100)
    assert on.line() == (f"gradient checkpointing on (auto): predicted peak without it {without / GiB:.2f} GiB "
                         f"exceeds 90% of {h100 / GiB:.2f} GiB")
    h200 = 104.85 * GiB  # the H200's bytes_limit at JAX's default fraction
    fits = choose_update_memory(job, h200)
    assert (fits.on, fits.peak_without_bytes, fits.device_bytes) == (False, without, h200)
    assert fits.line() == (f"gradient checkpointing off (auto): predicted peak {without / GiB:.2f} GiB of "
                           f"{h200 / GiB:.2f} GiB")
    # the boundary is the share of the device, not the whole device
    assert not choose_update_memory(job, without / CHECKPOINTING_FIT_SHARE).on
    assert choose_update_memory(job, without / CHECKPOINTING_FIT_SHARE * 0.99).on
    assert choose_update_memory(job, without * 1.01).on
    # memory unknown (a CPU, a GPU the placement does not name): on, nothing predicted
    for unknown in (None, 0):
        choice = choose_update_memory(job, unknown)
        assert choice.on and choice.peak_without_bytes is None
        assert choice.line() == "gradient checkpointing on (auto): the trainer device's memory is unknown"
    assert trainer_device_bytes(_with(job, "ray", trainer=dataclasses.replace(job.ray.trainer,
                                                                              accelerator_type=None))) is None
    assert trainer_device_bytes(job, cpu=True) is None


def test_the_dry_runs_counts_see_auto_resolved():
    """Memory, FLOPs and the report take `auto` as the trainer placement's device resolves it, never the string."""
    from marinrl.dry_run.memory import resolve_update_memory
    from marinrl.dry_run.report import DryRunShapes, step_flops

    job = _with(_one_h100(), "ray", trainer=dataclasses.replace(_one_h100().ray.trainer, accelerator_type="H200"))
    off, on = (_with_model(job, gradient_checkpointing=v) for v in (False, True))
    assert predicted_memory(job, "trainer").bytes_per_device == predicted_memory(off, "trainer").bytes_per_device
    assert step_flops(job, DryRunShapes())[0].recompute == 0 < step_flops(on, DryRunShapes())[0].recompute
    on_a_cpu = predicted_memory(job, "trainer", cpu=True).bytes_per_device  # fake CPU devices: memory unknown
    assert on_a_cpu["activations"] == predicted_memory(on, "trainer", cpu=True).bytes_per_device["activations"]
    # a setting other than auto is the config's, untouched
    for setting in (True, False, "offload"):
        job_set = _with_model(job, gradient_checkpointing=setting)
        assert resolve_update_memory(job_set, 1e15) == (job_set, None)
    resolved, choice = resolve_update_memory(job, 1e6)
    assert resolved.model.model.gradient_checkpointing is True and choice.on


def test_trainer_plan_counts_gradients_as_float32_parameters():
    job = _recipe()
    plan = predicted_memory(job, "trainer", 8)
    b = plan.bytes_per_device
    n = count(abstract_model(job.model.model, job.model.vocab_size, jnp.float32))
    # FSDP over 8 devices: a float32 parameter's shard, up to leaves too small to split (norms)
    assert 4 * n / 8 <= b["parameters"] <= 4 * n / 8 * 1.01
    assert b["gradients"] == b["parameters"]
    assert b["gradient_accumulator"] == b["parameters"]  # 512 rows in microbatches of 4 × 8
    assert b["optimizer_state"] == pytest.approx(2 * b["parameters"], rel=1e-4)  # AdamW's two moments
    assert plan.peak_bytes_per_device == pytest.approx(sum(b.values()))
    assert list(b) == ["parameters", "gradients", "gradient_accumulator", "optimizer_state", "activations",
                       "logits", "logits_compute_copy", "lm_head_gradient", "compute_parameters"]
    assert plan.peak_bytes_per_process == plan.peak_bytes_per_device * 8
    whole = predicted_memory(_with(job, "trainer", per_device_parallelism=-1), "trainer", 8).bytes_per_device
    assert whole["gradient_accumulator"] == 0 and whole["gradients"] == b["gradients"]
    # half the devices: every sharded leaf twice as large
    assert predicted_memory(job, "trainer", 4).bytes_per_device["parameters"] == pytest.approx(
        2 * b["parameters"], rel=0.01)


def test_rollout_weights_and_cache_take_half_the_bytes_in_bfloat16():
    job = _recipe()
    assert job.rollout_dtype() == "bfloat16"  # the recipes' mp: p=f32,c=bfloat16
    e = job.inference.engine  # a fixed page budget: on a TPU the engine would size it from free memory
    job = _with(job, "inference", engine=dataclasses.replace(e, max_pages=e.max_seqs * -(-e.max_seq_len // 128)),
                model_axis_size=4)  # by default one chip holds this model: data parallel (tests/test_scan_plan.py)
    bf16 = predicted_memory(job, "rollout", 4)
    f32 = predicted_memory(_with(job, "inference", dtype="float32"), "rollout", 4)
    assert bf16.bytes_per_device["weights"] * 2 == f32.bytes_per_device["weights"]
    n = count(abstract_model(job.model.model, job.model.vocab_size, jnp.float32))
    assert 2 * n / 4 <= bf16.bytes_per_device["weights"] <= 2 * n / 4 * 1.01  # tensor-parallel over 4
    # the page cache: max_seqs × ceil(max_seq_len / 128) pages of 128 tokens, K and V of every layer, KV heads
    # split over the model axis; the decode state beside it is small
    e, cfg = job.inference.engine, job.model.model
    pages = e.max_seqs * -(-e.max_seq_len // 128)
    kv = pages * 128 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2 / 4
    assert kv <= bf16.bytes_per_device["cache"] <= kv * 1.01
    assert f32.bytes_per_device["cache"] == pytest.approx(2 * bf16.bytes_per_device["cache"], rel=0.01)
    assert bf16.estimated == ("working_set",)


def _kv_bytes_per_page(job, page: int, model_axis: int, itemsize: int = 2) -> float:
    """K and V of every layer for one page of `page` tokens, KV heads split over the model axis: by hand."""
    cfg = job.model.model
    return page * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize / model_axis


def test_the_engine_cache_is_sized_as_the_engine_sizes_it_on_each_device_kind():
    """CPU: max_seqs full-length sequences in pages of 64 tokens (`resolved_engine_config`). TPU v5e (the recipe's
    `v5litepod-4`) and an H100: the most 128-token pages that fit hbm_utilization of the device's memory less
    the weights. A GPU the table does not know: max_seqs sequences, and a note that says so."""
    from marinrl.dry_run.engine_cache import DEVICE_MEMORY_GIB, GPU_MEMORY_FRACTION

    job = _recipe()
    e = job.inference.engine
    tpu = _with(job, "inference", model_axis_size=4)  # tensor parallel (by default one v5e chip holds this model)
    cpu = predicted_memory(tpu, "rollout", 4, cpu=True)
    kv_cpu = e.max_seqs * -(-e.max_seq_len // 64) * _kv_bytes_per_page(job, 64, 4)
    assert kv_cpu <= cpu.bytes_per_device["cache"] <= kv_cpu * 1.01
    assert "CPU" in cpu.notes[0] and "pages of 64 tokens" in cpu.notes[0]

    gpu = _with(job, "ray", rollout=dataclasses.replace(job.ray.rollout, tpu=None, num_gpus=1,
                                                        accelerator_type="H100"))
    for plan_job, limit, devices in ((tpu, DEVICE_MEMORY_GIB["v5litepod"] * 2**30, 4),
                                     (gpu, DEVICE_MEMORY_GIB["H100"] * GPU_MEMORY_FRACTION * 2**30, 1)):
        plan = predicted_memory(plan_job, "rollout", devices)
        per_page = _kv_bytes_per_page(job, 128, devices)
        budget = e.hbm_utilization * (limit - plan.bytes_per_device["weights"])
        pages = int(re.search(r"(\d+) pages of 128 tokens", plan.notes[0])[1])
        assert pages * per_page <= budget < (pages + 1) * per_page, (pages, per_page, budget)
        # the cache component: those pages plus the decode state (page tables, tokens: < 1% here)
        assert pages * per_page <= plan.bytes_per_device["cache"] <= pages * per_page * 1.01

    unknown = _with(gpu, "ray", rollout=dataclasses.replace(gpu.ray.rollout, accelerator_type=None))
    plan = predicted_memory(unknown, "rollout", 1)
    assert "unknown memory" in plan.notes[0] and "inference.engine.max_pages" in plan.notes[0]
    kv = e.max_seqs * -(-e.max_seq_len // 128) * _kv_bytes_per_page(job, 128, 1)
    assert kv <= plan.bytes_per_device["cache"] <= kv * 1.01


def test_a_shared_gpus_memory_fraction_is_the_limit_the_engines_pages_fill():
    """A rollout worker that shares its GPU (`memory_fraction`, the one-GPU mode) has that share of the GPU as its
    allocator's limit, and the engine's pages fill hbm_utilization of it, not of JAX's default 75%."""
    from marinrl.dry_run.engine_cache import DEVICE_MEMORY_GIB, rollout_device

    job = _recipe()
    gpu = dataclasses.replace(job.ray.rollout, tpu=None, num_gpus=1, accelerator_type="H100")
    shared = _with(job, "ray", rollout=dataclasses.replace(gpu, memory_fraction=0.3))
    assert rollout_device(shared).memory_bytes == DEVICE_MEMORY_GIB["H100"] * 0.3 * 2**30
    plans = [predicted_memory(j, "rollout", 1) for j in (shared, _with(job, "ray", rollout=gpu))]
    assert f"({DEVICE_MEMORY_GIB['H100'] * 0.3:.2f} GiB limit)" in plans[0].notes[0]
    pages = [int(re.search(r"(\d+) pages of 128 tokens", plan.notes[0])[1]) for plan in plans]
    assert pages[0] < pages[1] / 2  # 0.3 of the GPU against 0.75, less the same weights


def test_engine_pages_agree_with_levanters_own_sizing(monkeypatch):
    """Levanter's `_infer_max_pages_from_hbm`, given the budget the dry run derives (a TPU's free memory cannot
    be had on this machine: its budget function is the one stand-in), finds the same page count."""
    import haliax as hax
    from levanter.inference import engine as levanter_engine

    from marinrl.dry_run.engine_cache import DEVICE_MEMORY_GIB, RolloutDevice, engine_pages, engine_sizing
    from marinrl.dry_run.shapes import shard_bytes

    job = _recipe()
    e = job.inference.engine
    model = abstract_model(job.model.model, job.model.vocab_size, jnp.bfloat16)
    device = RolloutDevice("tpu", "v5litepod", DEVICE_MEMORY_GIB["v5litepod"] * 2**30)
    pages, page, _ = engine_pages(job, model, {}, {}, device)
    budget = int((device.memory_bytes - shard_bytes(model, {}, {})) * e.hbm_utilization)
    monkeypatch.setattr(levanter_engine, "_available_hbm_budget_bytes", lambda utilization: budget)
    config = dataclasses.replace(engine_sizing(job, page_size=page), max_pages=None)
    with hax.axis_mapping({}):  # one device: nothing sharded, as the plan above
        assert levanter_engine.InferenceEngine._infer_max_pages_from_hbm(model, config) == pages


def test_predicted_memory_refuses_bad_input_naming_it():
    job = _recipe()
    with pytest.raises(ValueError, match="role"):
        predicted_memory(job, "sampler")
    with pytest.raises(ValueError, match="n_devices"):
        predicted_memory(job, "trainer", 0)
    with pytest.raises(ValueError, match="inference.model_axis_size is 3"):
        predicted_memory(_with(job, "inference", model_axis_size=3), "rollout", 6)
    with pytest.raises(ValueError, match="trainer.model_axis_size"):
        predicted_memory(_with(job, "trainer", model_axis_size=3), "trainer", 8)


def _tiny_job(backend: str):
    """The 0.6B recipe at a tiny width on this session's 4 fake devices: a 4-GPU trainer, 2-GPU rollouts."""
    from marinrl.config.placement import PlacementConfig

    job = _with_model(_recipe(), **TINY)
    job = dataclasses.replace(job, groups_per_step=4, n_generations=2, n_rollout_workers=2,
                              model=dataclasses.replace(job.model, vocab_size=512))
    job = _with(job, "ray", trainer=PlacementConfig(num_gpus=4), rollout=PlacementConfig(num_gpus=2))
    job = _with(job, "trainer", per_device_parallelism=1)
    return _with(job, "inference", backend=backend, model_axis_size=2,
                 engine=dataclasses.replace(job.inference.engine, max_seqs=8, max_seq_len=64, max_prefill_tokens=64))


@pytest.mark.parametrize("backend", ["engine", "scan"])
def test_dry_run_compiles_the_backend_the_job_runs(backend):
    import json

    from marinrl.dry_run import DryRunShapes, dry_run

    report = dry_run(_tiny_job(backend), DryRunShapes(prompt_tokens=16, response_tokens=16, layers=1))
    assert report.backend == backend
    names = [p.name for p in report.programs]
    rollout = ["engine prefill", "engine decode loop"] if backend == "engine" else ["scan sampler"]
    assert names == ["train step", *rollout]
    for p in report.programs[1:]:
        assert p.compiled and p.devices == 2 and p.mesh == {"data": 1, "model": 2} and p.layers == 1
        assert p.cpu_temp_bytes_per_device >= 0
    assert report.trainer.devices == 4 and report.rollout.devices == 2
    # the engine's cache is its pages; the scan sampler's one call's rows × (prompt + response) slots
    assert report.rollout.bytes_per_device["cache"] > 0
    text = "\n".join(report.lines())
    assert f"rollout backend: {backend}" in text and "gradients" in text and "executed" in text
    # GPUs the placement does not name: `auto` keeps checkpointing, and the report says why
    assert "[dry run] trainer gradient checkpointing on (auto): the trainer device's memory is unknown" in text
    assert json.loads(json.dumps(report.as_dict()))["rollout"]["peak_bytes_per_device"] == \
        report.rollout.peak_bytes_per_device


def test_the_cpu_plan_adds_what_xla_cpu_holds_on_fake_devices():
    """`cpu=True` (the rehearsal's prediction): per FSDP device the whole weights in the compute dtype and
    the whole float32 gradients; per rollout device a float32 copy of the bf16 weights; per trainer process
    the XLA:CPU runtime, shared out over its devices. A received version beside the served one is counted on any
    platform."""
    from marinrl.dry_run.memory import CPU_PROCESS_RUNTIME_BYTES

    job = _with_model(_recipe(), gradient_checkpointing=True)  # as `auto` resolves on a CPU, whose memory is unknown
    job = _with(job, "trainer", per_device_parallelism=4)  # `auto` resolves by what each plan knows of the memory
    n = count(abstract_model(job.model.model, job.model.vocab_size, jnp.float32))
    plain = predicted_memory(job, "trainer", 2).bytes_per_device
    cpu_plan = predicted_memory(job, "trainer", 2, cpu=True)
    cpu = cpu_plan.bytes_per_device
    # the whole gathered bf16 copy takes the place of the sharded one an accelerator holds
    assert "compute_parameters" not in cpu and plain["compute_parameters"] == pytest.approx(n, rel=0.01)
    assert {k: cpu[k] for k in plain if k != "compute_parameters"} == \
        {k: v for k, v in plain.items() if k != "compute_parameters"}
    assert cpu["gathered_parameters"] == pytest.approx(2 * n, rel=1e-6)  # bf16 compute (mp c=bfloat16)
    assert cpu["gradients"] + cpu["unsharded_gradients"] == pytest.approx(4 * n, rel=1e-6)
    rollout_plan = predicted_memory(job, "rollout", 2, cpu=True)
    rollout = rollout_plan.bytes_per_device
    assert rollout["incoming_version"] == rollout["weights"]
    assert rollout["cpu_float32_weights"] == pytest.approx(2 * rollout["weights"])
    plain_rollout = predicted_memory(job, "rollout", 2)
    assert "cpu_float32_weights" not in plain_rollout.bytes_per_device
    # the trainer process's runtime: one CPU_PROCESS_RUNTIME_BYTES a process, its share on each of its devices
    assert cpu_plan.devices_per_process == 2 and "cpu_runtime" in cpu_plan.estimated
    assert cpu["cpu_runtime"] == CPU_PROCESS_RUNTIME_BYTES / cpu_plan.devices_per_process
    assert cpu["cpu_runtime"] * cpu_plan.devices_per_process == pytest.approx(CPU_PROCESS_RUNTIME_BYTES)
    assert "cpu_runtime" not in plain and "cpu_runtime" not in rollout  # measured in the trainer only


def test_a_local_checkpoints_architecture_is_the_one_planned(tmp_path):
    """The run builds what config.json says, whatever `model.model` holds: the plan follows it."""
    import transformers

    path = tmp_path / "hf"
    transformers.Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=32).save_pretrained(path)
    job = _recipe()
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, hf_checkpoint=str(path)))
    small = predicted_memory(job, "trainer", 2).bytes_per_device["parameters"]
    assert small < 4 * 200_000  # ~133k parameters (0.6B in the recipe's model.model)


def test_train_activation_bytes_by_hand():
    """The trainer's activations per device for a tiny Qwen3 (hidden 64, MLP 160, 3 layers, vocabulary 300),
    4 rows of 128 tokens in bfloat16, counted by hand: each term, so that one left out is seen."""
    from marinrl.dry_run.working_set import train_activation_bytes, trainer_attention

    job = _recipe()
    fields = {f.name for f in dataclasses.fields(job.model.model)}
    tiny = {k: v for k, v in TINY.items() if k in fields}
    job = dataclasses.replace(job, model=dataclasses.replace(
        job.model, vocab_size=300, model=dataclasses.replace(job.model.model, **tiny, gradient_checkpointing=True,
                                                             **({"cross_entropy_block_size": None}
                                                                if "cross_entropy_block_size" in fields else {}))))
    job = _with(job, "trainer", per_device_parallelism=4, mp="p=f32,c=bfloat16")
    mesh = {"data": 1, "replica": 1, "model": 1}
    kept = 4 * 128 * 64 * 2 * 3           # each layer's input, bfloat16, 3 layers
    working = 16 * 4 * 128 * 80 * 2       # one layer's working set: 16 × rows × length × max(64, 160 / 2)
    assert train_activation_bytes(job, mesh, 128) == kept + working
    # the LM head's share, apart: float32 logits blocks live at once (one block: the vocabulary of 300), the
    # bfloat16 copy of a block, the head's gradient in bfloat16
    from marinrl.dry_run.working_set import LOGITS_BLOCKS_LIVE, train_logits_bytes

    assert train_logits_bytes(job, mesh, 128) == {"logits": LOGITS_BLOCKS_LIVE * 4 * 128 * 300 * 4,
                                                  "logits_compute_copy": 4 * 128 * 300 * 2,
                                                  "lm_head_gradient": 300 * 64 * 2}
    job = _with_model(job, gradient_checkpointing=False)  # every layer keeps its working set; a flash attention
    scores = 4 * 4 * 128 * 128 * (4 + 2)  # rows × heads × length² of float32 scores and bfloat16 probabilities
    # (`auto`: Splash on this recipe's TPU, Levanter's JAX flash on a CPU) holds one layer's scores, in blocks
    # of 1,024 keys: all 128 here
    assert (trainer_attention(job), trainer_attention(job, cpu=True)) == ("splash", "jax_flash")
    assert train_activation_bytes(job, mesh, 128) == 3 * working + working + scores
    # on a CPU a row shorter than 1,024 keeps Levanter's vanilla fallback, and every layer its scores
    assert train_activation_bytes(job, mesh, 128, cpu=True) == 3 * (working + scores) + working
    vanilla = _with_model(job, attn_backend="vanilla")  # every layer keeps its scores too
    assert train_activation_bytes(vanilla, mesh, 128) == 3 * (working + scores) + working
    assert train_activation_bytes(vanilla, {**mesh, "model": 2}, 128) == (3 * (working + scores) + working) / 2


def test_auto_microbatch_is_the_largest_that_fits_preferring_no_recompute():
    """`trainer.per_device_parallelism: auto` on the recipe's H100 (the batch: 512 rows a device): the chosen
    microbatch's predicted peak fits 90% of the device and the next larger one's does not; with checkpointing
    `auto` too, recomputation is dropped by a smaller microbatch while it keeps `MIN_MICROBATCH_TOKENS`; memory
    unknown: the whole batch, checkpointing on."""
    from marinrl.dry_run.engine_cache import trainer_device_bytes
    from marinrl.dry_run.memory import (
        CHECKPOINTING_FIT_SHARE,
        MIN_MICROBATCH_TOKENS,
        choose_update_memory,
        resolve_update_memory,
        with_gradient_checkpointing,
        with_microbatch,
    )

    job = _with(_one_h100(), "trainer", per_device_parallelism="auto")
    h100 = trainer_device_bytes(job)
    limit, longest = CHECKPOINTING_FIT_SHARE * h100, job.batching.max_length

    def peak(j, policy, rows):
        j = with_microbatch(with_gradient_checkpointing(j, policy), rows)
        return predicted_memory(j, "trainer", 1, prompt_tokens=longest, response_tokens=longest).peak_bytes_per_device

    for attention in ("auto", "vanilla"):
        for policy in (True, False):
            j = _with_model(job, attn_backend=attention, gradient_checkpointing=policy)
            c = choose_update_memory(j, h100)
            assert c.on is None and peak(j, policy, c.microbatch_rows) == c.peak_bytes <= limit
            assert peak(j, policy, 2 * c.microbatch_rows) > limit, (attention, policy)
        both = _with_model(job, attn_backend=attention, gradient_checkpointing="auto")
        c = choose_update_memory(both, h100)
        off_rows = choose_update_memory(_with_model(both, gradient_checkpointing=False), h100).microbatch_rows
        if off_rows * longest >= MIN_MICROBATCH_TOKENS:
            assert (c.on, c.microbatch_rows) == (False, off_rows)
        else:
            assert c.on and c.microbatch_rows == choose_update_memory(
                _with_model(both, gradient_checkpointing=True), h100).microbatch_rows
        resolved, again = resolve_update_memory(both, h100)
        assert again == c and resolved.trainer.per_device_parallelism == c.microbatch_rows
        assert resolved.model.model.gradient_checkpointing is c.on
    # the flash attention keeps no scores: its microbatch without recomputation is larger than the vanilla one's
    flash, vanilla = (choose_update_memory(_with_model(job, attn_backend=a, gradient_checkpointing=False), h100)
                      for a in ("auto", "vanilla"))
    assert flash.microbatch_rows > vanilla.microbatch_rows
    assert flash.line() == (f"microbatch {flash.microbatch_rows} rows per device (auto): predicted peak "
                            f"{flash.peak_bytes / GiB:.2f} GiB of {h100 / GiB:.2f} GiB")
    # nothing fits a tiny device: the smallest microbatch, said so
    tiny = choose_update_memory(_with_model(job, gradient_checkpointing=True), 2 * GiB)
    assert tiny.microbatch_rows == 1 and tiny.line().endswith("over 90%: no smaller microbatch exists")
    # memory unknown on this GPU placement (the trainer reads its device's; a dry run may not know it): 4 rows of
    # 1,024 tokens; on a CPU the whole batch (tests/test_auto_checkpointing.py)
    unknown = choose_update_memory(_with_model(job, gradient_checkpointing="auto"), None)
    assert (unknown.on, unknown.microbatch_rows) == (True, MIN_MICROBATCH_TOKENS // longest)
    assert unknown.lines() == ["gradient checkpointing on (auto): the trainer device's memory is unknown",
                               "microbatch 4 rows per device (auto): the trainer device's memory is unknown, so at "
                               "most 4,096 tokens a device"]
