"""A `lora` policy's adapters exported in PEFT's layout (`marinrl.models.peft_export`, `marinrl export-peft`),
checked against `transformers` + `peft` themselves: tiny random Hugging Face checkpoints written by transformers
(Llama 3 with an untied head, Qwen3 with q/k norms, head_dim != hidden / heads and tied embeddings), random
non-zero adapters on our model of the same checkpoint saved as Levanter's trainer saves a LoRA policy (its
`saveable_state`: the adapter arrays only), exported, then loaded with `peft.PeftModel.from_pretrained` on
transformers' model of the same base: its logits must equal ours with the adapters applied.

Bounds, as tests/test_hf_families.py: both sides compute the same float32 function with different summation
orders; each logit is a sum over hidden = 64 products after layers whose norms keep activations O(1), so
64 · eps32 · max|logits| covers any reordering, while a misplaced adapter row (a transposed A, heads flattened
in another order, a scale of alpha instead of alpha / r) moves logits by O(their scale): the base-only export
below shows the adapters' own effect is thousands of bounds."""

from __future__ import annotations

import json
import pathlib

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from levanter.checkpoint import save_checkpoint
from levanter.layers.attention import AttentionMask
from levanter.lora import LowRankLinear
from levanter.trainer_state import TrainerState

torch = pytest.importorskip("torch",
                            reason="torch (CPU) is in the dev extra: pip install -c constraints.txt -e '.[dev]'")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="peft is in the dev extra: pip install -c constraints.txt -e '.[dev]'")

from test_hf_families import FAMILIES, IDS, _write_checkpoint  # noqa: E402

from marinrl.cli import main  # noqa: E402
from marinrl.config.lora import LoraRLConfig  # noqa: E402
from marinrl.config.model import ModelConfig  # noqa: E402
from marinrl.config.policies import policy_models  # noqa: E402
from marinrl.models.hf_checkpoints import default_mesh, save_hf_checkpoint  # noqa: E402
from marinrl.models.lora import add_adapters, trainable_filter  # noqa: E402
from marinrl.models.peft_export import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterLoadError,
    export_peft,
    read_adapters,
    write_peft,
)
from marinrl.models.policy_model import build_model, build_tokenizer, save_levanter_checkpoint  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
ULPS = 64  # = hidden size: see the module docstring
LORA = LoraRLConfig(rank=4, alpha=8.0)
POLICY_MODELS = (pathlib.Path(__file__).parents[1] / "experiments" / "policy_models.yaml").read_text()


def _with_random_adapters(base, lora: LoraRLConfig, seed: int = 1):
    """`base` with adapters whose A (Levanter's init) and B (N(0, 0.1²), not zero as a fresh policy's) are both
    random: an adapted row in the wrong place shows in the logits."""
    adapted = add_adapters(base, lora)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 1000))

    def randomize(node):
        if not isinstance(node, LowRankLinear):
            return node
        b = node.lora_B.weight
        return eqx.tree_at(lambda n: n.lora_B.weight, node, hax.random.normal(next(keys), b.axes) * 0.1)

    return jax.tree.map(randomize, adapted, is_leaf=lambda x: isinstance(x, LowRankLinear))


def _trainer_checkpoint(adapted, folder: str, step: int = 3) -> str:
    """What Levanter's Checkpointer writes for a LoRA policy's trainer: its state's `saveable_state` (the
    adapters, the optimizer's moments, the step)."""
    state = TrainerState.init(optax.adam(1e-3), adapted, key=jax.random.PRNGKey(0),
                              is_trainable=trainable_filter(adapted))
    with default_mesh():
        save_checkpoint(state.saveable_state, step, folder)
    return folder


def _logits(model) -> np.ndarray:
    out = model(hax.named(jnp.asarray(IDS), "position"), attn_mask=AttentionMask.causal())
    return np.asarray(out.array, dtype=np.float32)


def _peft(base_path: str, adapter_dir: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """transformers' model of `base_path` with PEFT's load of `adapter_dir`: its logits of IDS, and the
    adapter arrays PEFT holds (its own state-dict names)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, local_files_only=True)
    model = peft.PeftModel.from_pretrained(hf, adapter_dir)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(np.asarray(IDS))[None]).logits[0].numpy()
    held = peft.get_peft_model_state_dict(model, save_embedding_layers=False)  # adapters only, not the head's base
    held = {k: v.detach().numpy() for k, v in held.items()}
    return logits, held


def _hf_logits(base_path: str) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(IDS))[None]).logits[0].numpy()


def _bound(expected: np.ndarray) -> float:
    return ULPS * EPS32 * float(np.abs(expected).max())


def _assert_close(actual, expected):
    err, bound = float(np.abs(actual - expected).max()), _bound(expected)
    assert err <= bound, f"max |Δ| {err:.3g} > {bound:.3g} ({ULPS} ulps of the largest value)"
    print(f"max |Δ| {err:.3g} <= {bound:.3g} ({ULPS} ulps of the largest value)")


def _exported(out: str) -> tuple[dict, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    return json.loads((pathlib.Path(out) / ADAPTER_CONFIG).read_text()), load_file(f"{out}/{ADAPTER_WEIGHTS}")


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def family(request, tmp_path_factory):
    """(name, transformers' config, HF checkpoint path, its ModelConfig, our model of it)."""
    name = request.param
    path = str(tmp_path_factory.mktemp(name) / "hf")
    cfg = FAMILIES[name]()
    _write_checkpoint(cfg, path)
    model = ModelConfig(hf_checkpoint=path)
    return name, cfg, path, model, build_model(model)


def test_exported_adapters_on_the_hf_base_give_our_logits(family, tmp_path):
    """Random adapters on every linear module, from a trainer-style checkpoint: PEFT's logits on transformers'
    base equal ours with the adapters applied, PEFT holds every exported array as written, and the files are
    PEFT's layout (keys, [r, in] and [out, r] shapes, heads × head_dim flattened, the config's fields)."""
    name, cfg, path, model, base = family
    adapted = _with_random_adapters(base, LORA)
    checkpoint = _trainer_checkpoint(adapted, str(tmp_path / "checkpoints" / "step-3"))
    result = export_peft(checkpoint, model, LORA, str(tmp_path / "peft"))

    config, tensors = _exported(str(tmp_path / "peft"))
    head = [] if cfg.tie_word_embeddings else ["lm_head"]  # a tied head is the embedding: no Linear to adapt
    assert config == {**config, "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
                      "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": path,
                      "target_modules": sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj", *head])}
    n_layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    assert len(tensors) == result.tensors == 2 * (7 * n_layers + len(head))
    q_rows = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads)
    prefix = f"base_model.model.model.layers.{n_layers - 1}"
    assert tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"].shape == (4, hidden)
    assert tensors[f"{prefix}.self_attn.q_proj.lora_B.weight"].shape == (q_rows, 4)
    assert tensors[f"{prefix}.self_attn.o_proj.lora_A.weight"].shape == (4, q_rows)
    assert tensors[f"{prefix}.mlp.down_proj.lora_A.weight"].shape == (4, cfg.intermediate_size)
    assert all(np.any(a != 0) for a in tensors.values())

    theirs, held = _peft(path, str(tmp_path / "peft"))
    assert sorted(held) == sorted(tensors)  # PEFT placed every exported array, and holds no other adapter
    for key, array in tensors.items():
        np.testing.assert_array_equal(held[key], array, err_msg=key)
    _assert_close(theirs, _logits(adapted))


def test_a_base_only_export_gives_the_base_and_differs_from_the_adapted_one(family, tmp_path):
    """Adapters as a LoRA policy starts them (B zero: weight step 0): PEFT gives the base's logits, which differ
    from the randomly adapted model's by thousands of the bound the test above holds (it can fail)."""
    name, cfg, path, model, base = family
    checkpoint = _trainer_checkpoint(add_adapters(base, LORA), str(tmp_path / "step-0"), step=0)
    export_peft(checkpoint, model, LORA, str(tmp_path / "peft"))
    theirs, _ = _peft(path, str(tmp_path / "peft"))
    _assert_close(theirs, _hf_logits(path))
    adapted = _logits(_with_random_adapters(base, LORA))
    assert float(np.abs(theirs - adapted).max()) > 1000 * _bound(adapted)


def test_some_modules_at_another_rank_and_scale(family, tmp_path):
    """`target_modules: q_proj|v_proj`, alpha 5 at rank 2 (scale 2.5), a base named by the caller: PEFT's
    config names those two modules, and its logits are ours."""
    name, cfg, path, model, base = family
    lora = LoraRLConfig(rank=2, alpha=5.0, target_modules="q_proj|v_proj")
    adapted = _with_random_adapters(base, lora, seed=2)
    checkpoint = _trainer_checkpoint(adapted, str(tmp_path / "step-3"))
    export_peft(checkpoint, model, lora, str(tmp_path / "peft"), base_model_name_or_path="org/tiny")
    config, tensors = _exported(str(tmp_path / "peft"))
    assert (config["target_modules"], config["r"], config["lora_alpha"]) == (["q_proj", "v_proj"], 2, 5)
    assert config["base_model_name_or_path"] == "org/tiny"
    assert len(tensors) == 2 * 2 * cfg.num_hidden_layers
    theirs, _ = _peft(path, str(tmp_path / "peft"))
    _assert_close(theirs, _logits(adapted))


def test_a_checkpoint_of_other_adapters_is_one_error_naming_the_array(family, tmp_path):
    """Rank 4 adapters read as rank 8, q/v-only adapters read as every module, a full model's checkpoint: each
    an AdapterLoadError naming the checkpoint, the array and what to check, before any array is read."""
    name, cfg, path, model, base = family
    checkpoint = _trainer_checkpoint(_with_random_adapters(base, LORA), str(tmp_path / "step-3"))
    with pytest.raises(AdapterLoadError, match=r"step-3: model/transformer/layers/stacked/self_attn/q_proj/lora/"
                                               r"lora_A/weight is \[2, 4, \d+\], the policy's lora \(rank 8, "
                                               r"target_modules None\) makes it \[2, 8, \d+\]"):
        read_adapters(checkpoint, model, LoraRLConfig(rank=8, alpha=8.0))
    q_v = _trainer_checkpoint(_with_random_adapters(base, LoraRLConfig(rank=4, target_modules="q_proj|v_proj")),
                              str(tmp_path / "q_v" / "step-3"))
    with pytest.raises(AdapterLoadError, match=r"no adapter array model/.*k_proj/lora/lora_A/weight .*another set"):
        read_adapters(q_v, model, LORA)
    full = save_levanter_checkpoint(base, str(tmp_path / "full" / "step-1"), step=1)
    with pytest.raises(AdapterLoadError, match="holds no adapters: is it a `lora` policy's checkpoint"):
        read_adapters(full, model, LORA)


def test_a_module_adapted_in_some_layers_is_named_by_its_path(tmp_path):
    """Without scan layers a regex can adapt one layer's module (`blocks.1.self_attn.q_proj`): PEFT's
    `target_modules` names that path, not `q_proj` (which would adapt every layer's), so PEFT wraps exactly the
    modules exported; written from the adapted model in memory (`write_peft`) onto a seed-built base exported
    as a Hugging Face checkpoint; the logits are ours."""
    from levanter.models.llama import LlamaConfig

    model = ModelConfig(model=LlamaConfig(seq_len=64, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4,
                                          num_kv_heads=2, scan_layers=False), vocab_size=512, seed=3)
    base = build_model(model)
    lora = LoraRLConfig(rank=3, alpha=4.5, target_modules=r"blocks\.1\.self_attn\.q_proj|lm_head")
    adapted = _with_random_adapters(base, lora, seed=4)
    out = str(tmp_path / "peft")
    write_peft(adapted, lora, out, num_layers=2)
    config, tensors = _exported(out)
    assert config["target_modules"] == ["lm_head", "model.layers.1.self_attn.q_proj"]
    assert config["lora_alpha"] == 4.5 and config["base_model_name_or_path"] is None
    hf_base = save_hf_checkpoint(base, str(tmp_path / "hf_base"), tokenizer=build_tokenizer(model))
    theirs, held = _peft(hf_base, out)
    assert sorted(held) == sorted(tensors) == [f"base_model.model.{m}.lora_{ab}.weight" for m in
                                               ("lm_head", "model.layers.1.self_attn.q_proj") for ab in "AB"]
    _assert_close(theirs, _logits(adapted))


# ------------------------------------------------------------------------------------------ the CLI


def _job(tmp_path, text: str = POLICY_MODELS) -> tuple[str, object]:
    """experiments/policy_models.yaml under tmp_path: `policy` full, `other` a rank-4 lora policy on a base
    built from a seed (no scan layers: one module per layer)."""
    from marinrl.config.errors import load_job_config
    from marinrl.config.job import RLJobConfig

    path = tmp_path / "job.yaml"
    path.write_text(text.replace("run_root: runs", f"run_root: {tmp_path}/runs"))
    job = load_job_config(RLJobConfig, str(path), [])
    return str(path), {m.name: m for m in policy_models(job)}


def _fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_export_peft_command_writes_what_peft_loads_onto_the_base(tmp_path, capsys):
    """`marinrl export-peft job.yaml --policy other --out DIR`: the policy's newest checkpoint under its own
    run folder, its unstacked layers (`transformer.layers.blocks.{i}`) as `model.layers.{i}`; transformers'
    model of the same base (exported as a Hugging Face checkpoint) with PEFT's load gives our logits."""
    config, models = _job(tmp_path)
    other = models["other"]
    base = build_model(other.model)
    adapted = _with_random_adapters(base, other.lora)
    _trainer_checkpoint(adapted, f"{other.run_dir}/checkpoints/step-2", step=2)
    newest = _trainer_checkpoint(adapted, f"{other.run_dir}/checkpoints/step-5", step=5)
    out = str(tmp_path / "peft")
    assert main(["export-peft", config, "--policy", "other", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert f"policy 'other', {newest} (weight step 5): 30 adapter arrays" in printed
    assert "--base-model NAME sets it" in printed  # a base built from a seed: adapter_config.json names none

    hf_base = save_hf_checkpoint(base, str(tmp_path / "hf_base"), tokenizer=build_tokenizer(other.model))
    theirs, held = _peft(hf_base, out)
    config_json, tensors = _exported(out)
    assert config_json["base_model_name_or_path"] is None and len(config_json["target_modules"]) == 8
    assert sorted(held) == sorted(tensors) and "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight" in held
    _assert_close(theirs, _logits(adapted))

    # the only lora policy is the default; an occupied --out is refused, --overwrite replaces it
    err = _fails(["export-peft", config, "--out", out], capsys)
    assert err == f"marinrl export-peft: --out {out} already holds {ADAPTER_CONFIG}: choose another folder, or " \
                  "--overwrite"
    assert main(["export-peft", config, "--out", out, "--overwrite"]) == 0


def test_export_peft_names_what_is_wrong_before_reading_adapters(tmp_path, capsys):
    config, models = _job(tmp_path)
    out = str(tmp_path / "peft")
    err = _fails(["export-peft", config, "--policy", "policy", "--out", out], capsys)
    assert err == ("marinrl export-peft: --policy 'policy' is not a lora policy (policies.policy.specialization: "
                   "full): its checkpoints hold every weight, not adapters")
    err = _fails(["export-peft", config, "--policy", "critic", "--out", out], capsys)
    assert err == ("marinrl export-peft: --policy 'critic': the job defines no such policy (it has 'policy', "
                   "'other')")
    err = _fails(["export-peft", config, "--out", out], capsys)  # no checkpoint written yet
    assert err.startswith(f"marinrl export-peft: policy 'other': checkpoint not found: {models['other'].run_dir}"
                          "/checkpoints")
    err = _fails(["export-peft", config, "--checkpoint", str(tmp_path / "nowhere"), "--out", out], capsys)
    assert err == f"marinrl export-peft: --checkpoint: checkpoint not found: {tmp_path / 'nowhere'}"
    full = save_levanter_checkpoint(build_model(models["policy"].model), str(tmp_path / "full" / "step-1"), step=1)
    err = _fails(["export-peft", config, "--checkpoint", full, "--out", out], capsys)
    assert "holds no adapters: is it a `lora` policy's checkpoint?" in err and full in err
    quickstart = (pathlib.Path(__file__).parents[1] / "experiments" / "quickstart.yaml").read_text()
    (tmp_path / "plain").mkdir()
    plain, _ = _job(tmp_path / "plain", quickstart)
    err = _fails(["export-peft", plain, "--out", out], capsys)
    assert err.startswith("marinrl export-peft: the job trains no LoRA adapters")
    err = _fails(["export-peft", str(tmp_path / "no.yaml"), "--out", out], capsys)
    assert err == f"marinrl export-peft: {tmp_path / 'no.yaml'}: config file not found"
    assert not pathlib.Path(out).exists()  # nothing written by a refused export
