"""The model's Levanter-only knobs. `model.model.gradient_checkpointing`: true, false, Levanter's policies and
`auto`, which the trainer resolves once from its device's memory (job/plan.py `train_worker_config`, with
dry_run/memory.py's choice): the model it builds, and Levanter's config of it, carry the resolved bool.
`model.model.attn_backend`: `auto`, a backend per device kind, or one of Levanter's. A bad value of either is
refused naming the field; an HF checkpoint's model takes both from `model.model`. The choice's numbers at the
recipe's shape are in tests/test_dry_run.py; the flash attention's numbers against the vanilla one in
tests/test_packing.py."""

from __future__ import annotations

import pathlib

import pytest

from marinrl.config.errors import ConfigError, ConfigInputError, load_job_config
from marinrl.config.job import RLJobConfig
from marinrl.config.model import (
    ATTENTION_BACKENDS,
    CHECKPOINT_POLICIES,
    LlamaArchitecture,
    attention_backend_on,
)
from marinrl.job.plan import train_worker_config
from marinrl.levanter_configs import to_levanter

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "quickstart.yaml"
GiB = 2**30


def _quickstart(tmp_path, *flags: str) -> RLJobConfig:
    job = load_job_config(RLJobConfig, str(QUICKSTART), ["--run_root", str(tmp_path), *flags])
    job.validate()
    return job


def test_a_bad_value_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigInputError, match=r"ModelConfig\.model\.gradient_checkpointing: must be true, false, "
                                               r"auto or one of offload, recompute, full, nested, save_all, "
                                               r"got 'sometimes'$"):
        _quickstart(tmp_path, "--model.model.gradient_checkpointing", "sometimes")
    for value, parsed in (("auto", "auto"), ("offload", "offload"), ("true", True), ("false", False)):
        assert _quickstart(tmp_path, "--model.model.gradient_checkpointing", value).model.model.gradient_checkpointing \
            == parsed


def test_levanters_policies_convert_and_auto_outside_the_trainer_is_levanters_default():
    """Every policy name the config accepts is one haliax builds; `auto` that reaches Levanter unresolved (a
    rollout worker's or an evaluation's model: forward passes only) is True, never the string."""
    from haliax._src.scan import ScanCheckpointPolicy

    for policy in CHECKPOINT_POLICIES:
        assert to_levanter(LlamaArchitecture(gradient_checkpointing=policy)).gradient_checkpointing == policy
        ScanCheckpointPolicy.from_bool_or_str(policy)
    assert to_levanter(LlamaArchitecture(gradient_checkpointing="auto")).gradient_checkpointing is True
    assert to_levanter(LlamaArchitecture(gradient_checkpointing=False)).gradient_checkpointing is False


def test_the_trainer_resolves_auto_into_the_model_it_builds(tmp_path, capsys):
    """Off where the quickstart's update fits the device with room to spare, on where nothing fits and where the
    memory is unknown (this process's CPU); the resolved bool is what the model is built with, and the choice
    is printed with its numbers."""
    from marinrl.dry_run.memory import CHECKPOINTING_FIT_SHARE, predicted_memory, with_gradient_checkpointing
    from marinrl.models.policy_model import build_model

    job = _quickstart(tmp_path, "--model.model.gradient_checkpointing", "auto")
    peak = predicted_memory(with_gradient_checkpointing(job, False), "trainer",
                            prompt_tokens=job.batching.max_length).peak_bytes_per_device

    fits = train_worker_config(job, device_bytes=80 * GiB)
    assert fits.model.model.gradient_checkpointing is False
    assert to_levanter(fits.model.model).gradient_checkpointing is False
    assert build_model(fits.model).config.gradient_checkpointing is False
    assert f"[marinrl] gradient checkpointing off (auto): predicted peak {peak / GiB:.2f} GiB of 80.00 GiB" in \
        capsys.readouterr().out

    tight = train_worker_config(job, device_bytes=peak / CHECKPOINTING_FIT_SHARE * 0.99)
    assert tight.model.model.gradient_checkpointing is True
    assert "gradient checkpointing on (auto): predicted peak without it" in capsys.readouterr().out

    here = train_worker_config(job)  # this process's device: a CPU, whose memory JAX does not report
    assert here.model.model.gradient_checkpointing is True
    assert build_model(here.model).config.gradient_checkpointing is True
    assert "gradient checkpointing on (auto): the trainer device's memory is unknown" in capsys.readouterr().out

    # a setting other than auto is the config's, whatever the device
    explicit = _quickstart(tmp_path, "--model.model.gradient_checkpointing", "offload")
    assert train_worker_config(explicit, device_bytes=80 * GiB).model.model.gradient_checkpointing == "offload"
    assert "gradient checkpointing" not in capsys.readouterr().out


def test_an_hf_checkpoints_model_takes_the_setting_never_the_string(tmp_path):
    """An HF checkpoint's architecture is its config.json's, except the checkpointing, taken from `model.model`:
    the trainer's resolved bool, or Levanter's default for an unresolved `auto`."""
    import transformers

    from marinrl.config.model import ModelConfig
    from marinrl.models.policy_model import model_architecture

    path = tmp_path / "hf"
    transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=32).save_pretrained(path)
    for setting, levanter in (("auto", True), (False, False), (True, True), ("offload", "offload")):
        arch, _ = model_architecture(ModelConfig(hf_checkpoint=str(path),
                                                 model=LlamaArchitecture(gradient_checkpointing=setting)))
        assert arch.gradient_checkpointing == levanter and type(arch).__name__ == "Qwen3Config"
    from levanter.layers.attention import AttentionBackend

    for setting, levanter in (("auto", AttentionBackend.JAX_FLASH), ("vanilla", AttentionBackend.VANILLA),
                              ("default", AttentionBackend.DEFAULT)):  # `auto` on this process's CPU
        arch, _ = model_architecture(ModelConfig(hf_checkpoint=str(path),
                                                 model=LlamaArchitecture(attn_backend=setting)))
        assert arch.attn_backend == levanter


@pytest.mark.parametrize("platform, transformer_engine, want", [
    ("gpu", False, "jax_flash"),  # Levanter's default would fall back to the vanilla attention
    ("gpu", True, "nvte"),
    ("tpu", False, "splash"),
    ("cpu", False, "jax_flash"),
])
def test_auto_attention_is_a_flash_attention_on_every_device_kind(platform, transformer_engine, want):
    from marinrl.config.model import keeps_attention_scores

    assert attention_backend_on("auto", platform, transformer_engine) == want
    assert not keeps_attention_scores(want, platform, 1024)
    # below one block a CPU keeps Levanter's vanilla fallback (faster there); an accelerator never does
    assert keeps_attention_scores(want, platform, 768) == (platform == "cpu")
    assert keeps_attention_scores("vanilla", platform, 64)
    # Levanter's own default keeps the scores on a GPU without Transformer Engine; a named backend is itself
    assert attention_backend_on("default", "gpu", False) == "vanilla"
    assert attention_backend_on("vanilla", platform, transformer_engine) == "vanilla"


def test_the_attention_backend_reaches_the_model_and_a_bad_one_is_refused(tmp_path, capsys):
    from levanter.layers.attention import AttentionBackend

    from marinrl.models.policy_model import build_model

    for name in ATTENTION_BACKENDS[1:]:
        assert to_levanter(LlamaArchitecture(attn_backend=name)).attn_backend == AttentionBackend(name)
    job = _quickstart(tmp_path, "--model.model.attn_backend", "vanilla")
    assert build_model(job.model).config.attn_backend == AttentionBackend.VANILLA
    train_worker_config(_quickstart(tmp_path), device_bytes=80 * GiB)  # the trainer logs what `auto` runs here
    assert "[marinrl] attention jax_flash (auto on cpu)" in capsys.readouterr().out
    train_worker_config(job, device_bytes=80 * GiB)
    assert "attention" not in capsys.readouterr().out  # a backend the config names is not a choice
    assert build_model(_quickstart(tmp_path).model).config.attn_backend == AttentionBackend.JAX_FLASH  # auto, CPU
    with pytest.raises(ConfigInputError, match=r"ModelConfig\.model\.attn_backend: must be one of auto, default, "
                                               r"vanilla, jax_flash, nvte, splash, got 'fast'$"):
        _quickstart(tmp_path, "--model.model.attn_backend", "fast")


def test_the_trainer_resolves_an_auto_microbatch_into_levanters_trainer_config(tmp_path, capsys):
    """`trainer.per_device_parallelism: auto` reaches Levanter as the chosen rows (its microbatch: rows × the
    data-parallel devices); memory unknown (this CPU): the whole batch; a bad value is refused naming the field."""
    from marinrl.dry_run.memory import choose_update_memory

    job = _quickstart(tmp_path, "--trainer.per_device_parallelism", "auto",
                      "--model.model.gradient_checkpointing", "true")
    assert job.trainer.per_device_parallelism == "auto"
    rows = job.groups_per_step * job.n_generations
    device = choose_update_memory(job, 80 * GiB).peak_bytes * 3  # the whole batch fits with room
    fits = train_worker_config(job, device_bytes=device)
    assert fits.trainer.per_device_parallelism == -1  # Levanter fills in the whole batch when it initializes
    assert "[marinrl] microbatch -1 rows per device (auto): predicted peak" in capsys.readouterr().out
    whole = choose_update_memory(job, device).peak_bytes
    tight = train_worker_config(job, device_bytes=whole)  # the whole batch no longer fits 90% of it
    chosen = tight.trainer.per_device_parallelism
    assert 1 <= chosen < rows and rows % chosen == 0
    assert tight.trainer.microbatch_size == chosen * tight.trainer.data_axis_size
    assert f"[marinrl] microbatch {chosen} rows per device (auto)" in capsys.readouterr().out
    here = train_worker_config(job)  # this process's CPU: memory unknown
    assert here.trainer.per_device_parallelism == -1
    assert "microbatch: the whole batch (auto): the trainer device's memory is unknown" in \
        capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"RLJobConfig\.trainer\.per_device_parallelism: must be -1 \(the whole "
                                          r"batch at once\), auto or >= 1, got 'some'"):
        _quickstart(tmp_path, "--trainer.per_device_parallelism", "some")
