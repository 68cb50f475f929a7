"""The fleet planner as a user meets it (`marinrl plan`): nonsense flags refused in one line, the accelerators
taken from the config and every figure it assumed printed, a remark where the hosts outnumber the step's groups,
no heavy import; and the arithmetic a wrong sign or rounding would break (a host's share of groups, a version's
bytes tied or untied, the relay's rounds). The model checked against the fleet bench: tests/test_fleet.py."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from marinrl.cli import main
from marinrl.dry_run.fleet import FleetShape, plan_fleet, remarks
from marinrl.dry_run.fleet_inputs import ACCELERATORS, job_inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
HEAVY = ("jax", "ray", "torch", "transformers", "levanter", "equinox", "haliax")

JOB = """\
run_id: plan
run_root: {root}
model:
  model: {{type: llama, seq_len: 64, hidden_dim: 64, intermediate_dim: 256, num_layers: 2, num_heads: 4,
          num_kv_heads: 4}}
  vocab_size: 512
curriculum:
  lessons: [{{lesson_id: echo, env: {{name: echo}}, max_tokens: 8}}]
groups_per_step: 32
n_generations: 16
ray:
  trainer: {trainer}
  rollout: {rollout}
"""


def _config(tmp_path, trainer: str = "{}", rollout: str = "{}", name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(JOB.format(root=tmp_path / "runs", trainer=trainer, rollout=rollout))
    return str(path)


def _plan(capsys, *argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `marinrl plan ARGV`."""
    try:
        code = main(["plan", *map(str, argv)])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_marinrl_plan_imports_no_jax_ray_torch_transformers_or_levanter(tmp_path):
    """What docs/planning.md promises: the plan answers in about a second because it loads none of them. Run in a
    fresh interpreter (this one imported everything long ago), for a CPU config, a GPU one and a TPU one."""
    gpu = _config(tmp_path, "{num_gpus: 8, accelerator_type: H100}", "{num_gpus: 1, accelerator_type: H200}")
    tpu = _config(tmp_path, "{tpu: v5p-64}", "{tpu: v5litepod-8}", name="tpu.yaml")
    script = textwrap.dedent(f"""
        import json, sys
        from marinrl.cli import main
        codes = [main(["plan", config, "--rollout_hosts", "1", "8"])
                 for config in ({str(QUICKSTART)!r}, {gpu!r}, {tpu!r})]
        print(json.dumps(dict(codes=codes, loaded=[m for m in {HEAVY!r} if m in sys.modules])))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"codes": [0, 0, 0], "loaded": []}, out.stdout[-3000:]
    assert out.stdout.count("rollout hosts: a step every") == 6 and "8 x h100 (ray.trainer: num_gpus=8)" in out.stdout


@pytest.mark.parametrize("flag, value", [
    ("--rollout_hosts", "0"), ("--rollout_hosts", "-1"), ("--rollout_hosts", str(10**16)), ("--trainer_chips", "0"),
    ("--host_tokens_per_s", "0"), ("--host_tokens_per_s", "nan"), ("--params", "-1"), ("--params", "inf"),
    ("--prompt_tokens", "0"), ("--response_tokens", "-5"), ("--latency_ms", "-1"), ("--stream_mb_s", "0"),
    ("--weight_streams", "0"), ("--pod_storage_gb_s", "-1"), ("--relay_gb_s", "nan"), ("--accelerator", "tpu"),
])
def test_a_nonsense_flag_is_one_line_naming_it_and_exit_status_2(capsys, flag, value):
    code, out, err = _plan(capsys, QUICKSTART, flag, value)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"marinrl plan: {flag}: ") and "Traceback" not in err


def test_the_accelerators_come_from_the_config_and_plan_as_the_same_flags_would(capsys, tmp_path):
    """8 H100s to the trainer and an H200 a rollout host, named in the config, plan exactly as the flags that say
    the same; the assumptions name where each figure came from."""
    gpu = _config(tmp_path, "{num_gpus: 8, accelerator_type: H100}", "{num_gpus: 1, accelerator_type: H200}")
    code, from_config, _ = _plan(capsys, gpu, "--rollout_hosts", 1, 8)
    assert code == 0
    h200 = ACCELERATORS["h200"].host_tokens_per_s
    code, from_flags, _ = _plan(capsys, gpu, "--rollout_hosts", 1, 8, "--accelerator", "h100", "--trainer_chips", 8,
                                "--host_tokens_per_s", h200)
    assert code == 0
    plans = from_config[from_config.index("1 rollout hosts"):]
    assert plans == from_flags[from_flags.index("1 rollout hosts"):]
    assert "trainer: 8 x h100 (ray.trainer: num_gpus=8)" in from_config
    assert "MFU 0.21 (measured on one H100" in from_config
    assert f"a rollout host: h200 (ray.rollout: num_gpus=1): {h200:,.0f} tokens/s (measured on one H200" in from_config
    for assumed in ("a step: 32 groups x 16", "max_staleness 1", "8 response tokens (", "storage: 30 ms a request",
                    "fan-out: auto", "a version 4 bytes a parameter"):
        assert assumed in from_config


def test_a_tpu_slice_is_its_chips_and_an_unknown_kind_is_refused_as_train_refuses_it(capsys, tmp_path):
    code, out, _ = _plan(capsys, _config(tmp_path, "{tpu: v5p-64}", "{tpu: v5p-8}"), "--rollout_hosts", 4)
    assert code == 0 and "trainer: 32 x v5p (ray.trainer: tpu=v5p-64)" in out
    assert "a rollout host: v5p (ray.rollout: tpu=v5p-8): 30,000 tokens/s (assumed)" in out
    bad = _config(tmp_path, "{tpu: v9z-8}", name="v9z.yaml")
    code, out, err = _plan(capsys, bad, "--rollout_hosts", 4)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"marinrl plan: {bad}:12:") and "'v9z-8' is not a TPU slice type Ray knows" in err
    with pytest.raises(SystemExit):  # train's own answer: the same line
        main(["train", bad])
    assert capsys.readouterr().err.split(": ", 1)[1] == err.split(": ", 1)[1]


def test_a_placement_the_planner_has_no_figures_for_is_refused_naming_the_field(capsys, tmp_path):
    unnamed = _config(tmp_path, "{num_gpus: 8}")
    code, _, err = _plan(capsys, unnamed)
    assert code == 2 and err.count("\n") == 1
    assert "ray.trainer: num_gpus=8 is a GPU of no named kind" in err and "ray.trainer.accelerator_type" in err
    code, out, _ = _plan(capsys, unnamed, "--accelerator", "h100", "--rollout_hosts", 2)
    assert code == 0 and "trainer: 8 x h100 (--accelerator; chips: ray.trainer: num_gpus=8)" in out


def test_hosts_beyond_the_groups_they_can_be_given_get_a_remark(capsys):
    code, out, _ = _plan(capsys, QUICKSTART, "--rollout_hosts", 32, 24, 10**12)
    assert code == 0
    assert out.count("remark:") == 2
    assert "groups_per_step 32 keeps 16 of the 24 hosts busy (2 groups each), the other 8 idle" in out
    assert f"groups_per_step 32 keeps 32 of the {10**12} hosts busy (1 group each), the other {10**12 - 32} idle" in out
    uneven = FleetShape(groups_per_step=10)
    assert remarks(plan_fleet(uneven, 4), uneven) == [
        "groups_per_step 10 does not divide among 4 hosts (marinrl train refuses n_rollout_workers=4): planned as "
        "3 groups a host"]


def test_a_hosts_share_of_the_groups_is_rounded_up():
    """32 groups on 20 hosts: 2 a host (16 hosts busy), as on 16 hosts; twice a host's share on 32; 64 hosts give
    each 1 group, never 0."""
    shape = FleetShape(groups_per_step=32, jitter=0.0)
    generate = {n: plan_fleet(shape, n).parts_s["generate"] for n in (16, 20, 32, 64)}
    assert generate[20] == generate[16] == 2 * generate[32] > 0
    assert generate[64] == generate[32]
    assert [(plan_fleet(shape, n).groups_per_host, plan_fleet(shape, n).busy_hosts) for n in (20, 64)] == [
        (2, 16), (1, 32)]


def test_the_relays_copies_double_each_round():
    """The relay holds a version, then every round each holder gives a copy: N hosts hold it after
    ceil(log2(N + 1)) rounds (1 host: 1, 2-3: 2, 4-7: 3, 8: 4), each round one version over a host's link."""
    shape = FleetShape(fanout="relay", weight_bytes=1e9, relay_bytes_per_s=1e9)
    rounds = [plan_fleet(shape, n).parts_s["host_fetch"] for n in range(1, 9)]
    assert rounds == pytest.approx([1, 2, 2, 3, 3, 3, 3, 4])


@pytest.mark.parametrize("tied", [False, True])
def test_a_version_is_the_models_parameters_tied_or_untied(tied):
    """The planner's parameters are what a real (abstract) Levanter model of the config holds, less its norms; a
    version is that in the rollout dtype."""
    import jax.numpy as jnp

    from marinrl.config.errors import load_job_config
    from marinrl.config.job import RLJobConfig
    from marinrl.dry_run.shapes import abstract_model, count

    job = load_job_config(RLJobConfig, str(QUICKSTART), [])
    arch = dataclasses.replace(job.model.model, tie_word_embeddings=tied)
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, model=arch, vocab_size=300))
    inputs = job_inputs(job)
    norms = arch.num_layers * 2 * arch.hidden_dim + arch.hidden_dim
    assert inputs.params + norms == count(abstract_model(arch, 300, jnp.float32))
    assert inputs.shape().weight_bytes == inputs.params * 4  # the quickstart samples in float32


def test_the_gpu_rows_are_the_device_checks_figures():
    """The H200 row is what docs/device_check.md measured; the H100's MFU its own measurement, its rollout tokens/s
    the H200's scaled by bandwidth (docs/planning.md)."""
    from marinrl.dry_run.flops import chip_memory_bandwidth

    session = json.loads((ROOT / "docs/device_checks/2026-11-28-h200-session.json").read_text())
    h100_check = json.loads((ROOT / "docs/device_checks/2026-11-26-h100.json").read_text())
    h200, h100 = ACCELERATORS["h200"], ACCELERATORS["h100"]
    assert h200.mfu == pytest.approx(session["sections"]["train_step_no_remat"]["mfu"], abs=5e-4)
    assert h100.mfu == pytest.approx(h100_check["sections"]["train_step"]["mfu"], abs=5e-3)
    assert f"**{h200.host_tokens_per_s:,.0f} tokens/s**" in (ROOT / "docs/device_check.md").read_text()
    scale = chip_memory_bandwidth("NVIDIA H100") / chip_memory_bandwidth("NVIDIA H200")
    assert h100.host_tokens_per_s == pytest.approx(h200.host_tokens_per_s * scale)


def test_a_checkpoint_named_model_is_planned_from_its_config_json_or_refused_without_params(tmp_path):
    """The config's `model.model` is not the model an HF checkpoint holds: the planner reads the checkpoint's own
    config.json (local), and asks for --params where it cannot."""
    from marinrl.config.errors import load_job_config
    from marinrl.config.job import RLJobConfig
    from marinrl.dry_run.flops import ModelDims

    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=300, tie_word_embeddings=True)))
    job = load_job_config(RLJobConfig, str(QUICKSTART), [])
    local = dataclasses.replace(job, model=dataclasses.replace(job.model, hf_checkpoint=str(tmp_path)))
    inputs = job_inputs(local)
    dims = ModelDims(hidden=64, intermediate=160, layers=3, heads=4, kv_heads=2, head_dim=32, vocab=300,
                     tied_embeddings=True)
    assert inputs.params == dims.matmul_params and inputs.model_from == f"{tmp_path}/config.json"
    remote = dataclasses.replace(job, model=dataclasses.replace(job.model, hf_checkpoint="gs://bucket/qwen3"))
    with pytest.raises(ValueError, match=r"^model.hf_checkpoint: .*pass --params"):
        job_inputs(remote)
    assert job_inputs(remote, params=6e8).params == 6e8
