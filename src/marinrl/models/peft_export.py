"""A `lora` policy's adapters in PEFT's layout: `adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, DIR)` loads onto the Hugging Face model of the same base.

What a trainer checkpoint of a LoRA policy holds is the adapter arrays alone (`model/…/lora/lora_A/weight`, the
base is rebuilt from `model` on resume: docs/policies.md), so an export reads only those: the model's shapes
come from its config (`abstract_model`: no base weight is read), the adapters from the checkpoint.

The mapping, for the families whose modules carry Hugging Face's names (Llama, Mistral, Qwen2, Qwen3, Gemma,
OLMo 2: separate q/k/v/o and gate/up/down projections, as in `transformers`), is Levanter's own state-dict
export, the one its Hugging Face converter writes the base with, so the adapters land on the rows their base
weights land on:

- a `LoraLinear` at `transformer.layers.stacked.self_attn.q_proj` (scan layers: one module, a `layer` axis)
  becomes `base_model.model.model.layers.{i}.self_attn.q_proj.lora_{A,B}.weight`, one pair per layer
  (`model.layers` is Hugging Face's name for Levanter's `transformer.layers`); `lm_head` stays `lm_head`;
- A (`LORA_R` × In) is `[r, in]`, B (Out × `LORA_R`) is `[out, r]`, each named axis group flattened in its
  order: q_proj's Out (`kv_head`, `q_heads_per_group`, `head_size`) is HF's `num_heads · head_dim` rows,
  kv-head major, as `repeat_kv` reads them;
- `lora_alpha` and `r` are the policy's, so PEFT's scale alpha / r is ours; `target_modules` are the adapted
  modules' Hugging Face names (`q_proj`, …, `lm_head`), or their full paths when a name is adapted in some
  layers only.

Families whose Hugging Face modules differ from Levanter's (GPT-2's fused `c_attn` Conv1D, Mixtral's experts)
are refused. tests/test_peft_export.py checks Llama and Qwen3 against `transformers` + `peft`: the logits of
the exported adapters on the Hugging Face base equal ours with the adapters applied.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Optional

import equinox as eqx
import fsspec
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax.state_dict import to_torch_compatible_state_dict
from levanter.models.lm_model import LmConfig

from marinrl.config.lora import LoraRLConfig
from marinrl.config.model import ModelConfig
from marinrl.models.adapter_stack import ADAPTER, slot_adapters
from marinrl.models.lora import adapter_only, add_adapters
from marinrl.models.policy_model import model_architecture

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PREFIX", "AdapterLoadError", "PeftExport", "abstract_adapted",
           "export_peft", "peft_config", "peft_state_dict", "read_adapters", "target_modules", "write_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model"
"""What PEFT's `PeftModelForCausalLM` puts before the Hugging Face model's own state-dict keys."""

REFUSED_FAMILIES = {
    "gpt2": "its attention is one fused `c_attn` Conv1D in Hugging Face (PEFT's fan_in_fan_out), not checked here",
    "mixtral": "its experts are not Linear modules in Levanter, and its router's names are not checked here",
}
"""Levanter families (LmConfig registry names) whose adapters are not exported: what differs."""

_LAYER = re.compile(r"\.layers\.(\d+)\.")


class AdapterLoadError(ValueError):
    """The checkpoint does not hold the adapters the policy's `lora` describes (another rank or target set,
    or a full model's checkpoint): the message names the checkpoint and the first array that differs."""


@dataclasses.dataclass(frozen=True)
class PeftExport:
    """What `write_peft` wrote."""

    path: str
    config: dict
    tensors: int
    """Arrays in adapter_model.safetensors (an A and a B per adapted module per layer)."""
    nbytes: int
    """Bytes of the arrays (float32)."""


def _family(lm_config: LmConfig) -> Optional[str]:
    for name, cls in LmConfig.get_known_choices().items():
        if type(lm_config) is cls:
            return name
    return None


def check_family(lm_config: LmConfig) -> None:
    """ValueError for a family whose adapters would not land on Hugging Face's modules."""
    family = _family(lm_config)
    if family in REFUSED_FAMILIES:
        raise ValueError(f"a {family} model's adapters are not exported in PEFT's layout: "
                         f"{REFUSED_FAMILIES[family]}")


def abstract_adapted(model: ModelConfig, lora: LoraRLConfig):
    """The adapted model's structure with float32 shapes (`jax.ShapeDtypeStruct` leaves): nothing is read
    or initialized. Adapters are float32 as the trainer keeps them (they are its parameters)."""
    lm_config, vocab = model_architecture(model)
    check_family(lm_config)
    Vocab = hax.Axis("vocab", vocab)
    shaped = eqx.filter_eval_shape(
        lambda: add_adapters(lm_config.model_type.init(Vocab, lm_config, key=jax.random.PRNGKey(0)), lora))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
        if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating) else x,
        shaped)


def read_adapters(step_dir: str, model: ModelConfig, lora: LoraRLConfig, slot: Optional[tuple[int, int]] = None):
    """The adapter arrays of a LoRA policy's trainer checkpoint (`step_dir`: one `step-N` folder), as the
    adapted model's tree with every base array None (`adapter_only`'s form). Only adapter files are read.
    `slot` (k, K): the checkpoint is of a trainer of K adapters on one base, the policy's is slot k.
    AdapterLoadError when the checkpoint holds other adapters, or none."""
    from levanter.checkpoint import load_checkpoint

    from marinrl.models.hf_checkpoints import default_mesh

    template = adapter_only(abstract_adapted(model, lora))
    if slot is not None:
        Slots = hax.Axis(ADAPTER, slot[1])
        template = jax.tree.map(lambda x: hax.NamedArray(jax.ShapeDtypeStruct((Slots.size, *x.array.shape),
                                                                              x.array.dtype), (Slots, *x.axes))
                                if isinstance(x, hax.NamedArray) else x, template, is_leaf=_is_named)
    _check_stored_shapes(step_dir, template, lora)
    with default_mesh():
        try:
            adapters = load_checkpoint(template, step_dir, subpath="model", discover_latest=False)
        except FileNotFoundError as e:  # checked above; a file removed since
            raise AdapterLoadError(f"{step_dir}: {e}") from e
    return adapters if slot is None else slot_adapters(adapters, slot[0])


def _is_named(x) -> bool:
    return isinstance(x, hax.NamedArray)


def _array_paths(template) -> list[tuple[str, tuple[int, ...]]]:
    """(path under the checkpoint's `model/`, shape) of each adapter array, as Levanter's checkpointer names them."""
    from levanter.utils.jax_utils import leaf_key_paths

    is_leaf = lambda x: x is None or isinstance(x, hax.NamedArray)  # noqa: E731
    paths = jax.tree.leaves(leaf_key_paths(template, is_leaf=is_leaf), is_leaf=is_leaf)
    leaves = jax.tree.leaves(template, is_leaf=is_leaf)
    return [(p.replace(".", "/"), tuple(leaf.array.shape))
            for p, leaf in zip(paths, leaves, strict=True) if isinstance(leaf, hax.NamedArray)]


def _check_stored_shapes(step_dir: str, template, lora: LoraRLConfig) -> None:
    """Every adapter array the policy's `lora` implies is in the checkpoint with its shape (each array's
    `.zarray` alone is read): a checkpoint of another rank, other targets or a full model is one message."""
    fs, plain = fsspec.core.url_to_fs(step_dir)
    plain = plain.rstrip("/")
    described = f"rank {lora.rank}, target_modules {lora.target_modules!r}"
    for path, shape in _array_paths(template):
        marker = f"{plain}/model/{path}/.zarray"
        if not fs.exists(marker):
            hint = ("it holds no adapters: is it a `lora` policy's checkpoint?" if not _has_adapters(fs, plain)
                    else "its adapters are another set: check the policy's lora.target_modules")
            raise AdapterLoadError(f"{step_dir}: no adapter array model/{path} for the policy's lora ({described}); "
                                   f"{hint}")
        stored = tuple(json.loads(fs.cat_file(marker))["shape"])
        if stored != shape:
            raise AdapterLoadError(f"{step_dir}: model/{path} is {list(stored)}, the policy's lora ({described}) "
                                   f"makes it {list(shape)}: check lora.rank and the model")


def _has_adapters(fs, plain: str) -> bool:
    return any("/lora_A/" in p or p.endswith("/lora_A") for p in fs.find(f"{plain}/model", withdirs=True))


def peft_state_dict(adapters) -> dict[str, np.ndarray]:
    """PEFT's keys → float32 `[r, in]` (lora_A) and `[out, r]` (lora_B) arrays of an adapted model (or its
    `adapter_only` tree): Levanter's state-dict export (stacked layers split into `layers.{i}`, named axes
    flattened in their order) under PEFT's prefix."""
    state = to_torch_compatible_state_dict(adapter_only(adapters), prefix=PREFIX)
    out = {}
    for key, value in state.items():
        if value is None:
            continue
        if not re.search(r"\.lora_[AB]\.weight$", key):
            raise ValueError(f"{key}: not an adapter array (a base array left in the adapters' tree)")
        array = np.asarray(jax.device_get(value), dtype=np.float32)
        if array.ndim != 2:
            raise ValueError(f"{key}: shape {array.shape}, expected a matrix")
        out[key] = array
    if not out:
        raise ValueError("the model holds no adapters")
    return dict(sorted(out.items()))


def target_modules(keys, num_layers: Optional[int]) -> list[str]:
    """PEFT's `target_modules` for the adapted modules named by `keys` (PEFT's state-dict keys): each module's
    short name (`q_proj`, `lm_head`) when it is adapted in every layer (or sits outside the layers), else the
    full Hugging Face paths of that name's adapted modules."""
    modules = sorted({k[len(PREFIX) + 1:].rsplit(".lora_", 1)[0] for k in keys})
    by_name: dict[str, list[str]] = {}
    for m in modules:
        by_name.setdefault(m.rsplit(".", 1)[-1], []).append(m)
    out = []
    for name, paths in sorted(by_name.items()):
        layers = [int(m.group(1)) for p in paths if (m := _LAYER.search(f".{p}."))]
        every_layer = bool(layers) and len(layers) == len(paths) == num_layers and set(layers) == set(range(num_layers))
        outside = not layers and len(paths) == 1  # lm_head
        out.extend([name] if every_layer or outside else paths)
    return out


def peft_config(lora: LoraRLConfig, keys, num_layers: Optional[int], base_model_name_or_path: Optional[str]) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields for adapters trained as ours (no dropout, no bias, plain
    alpha / r scaling)."""
    alpha = float(lora.alpha)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "target_modules": target_modules(keys, num_layers),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft(adapters, lora: LoraRLConfig, out: str, *, num_layers: Optional[int],
               base_model_name_or_path: Optional[str] = None) -> PeftExport:
    """Writes `out/adapter_config.json` and `out/adapter_model.safetensors` (any fsspec URL) for an adapted
    model (or its `adapter_only` tree) trained with `lora`; `num_layers` decides short target names."""
    from safetensors.numpy import save

    state = peft_state_dict(adapters)
    config = peft_config(lora, state, num_layers, base_model_name_or_path)
    fs, plain = fsspec.core.url_to_fs(out)
    plain = plain.rstrip("/")
    fs.makedirs(plain, exist_ok=True)
    fs.pipe_file(f"{plain}/{ADAPTER_WEIGHTS}", save(state, metadata={"format": "pt"}))
    fs.pipe_file(f"{plain}/{ADAPTER_CONFIG}", (json.dumps(config, indent=2) + "\n").encode())
    return PeftExport(out, config, len(state), int(sum(a.nbytes for a in state.values())))


def export_peft(step_dir: str, model: ModelConfig, lora: LoraRLConfig, out: str, *,
                base_model_name_or_path: Optional[str] = None, slot: Optional[tuple[int, int]] = None) -> PeftExport:
    """A LoRA policy's trainer checkpoint (`step_dir`, one `step-N` folder) → PEFT's layout in `out`. The base
    is named by `base_model_name_or_path`, else the model's `hf_checkpoint` (None for a model built from a seed
    or a Levanter checkpoint: PEFT then needs the base given when it loads). `slot`: as `read_adapters`."""
    adapters = read_adapters(step_dir, model, lora, slot)
    lm_config, _ = model_architecture(model)
    return write_peft(adapters, lora, out, num_layers=getattr(lm_config, "num_layers", None),
                      base_model_name_or_path=base_model_name_or_path or model.hf_checkpoint)
