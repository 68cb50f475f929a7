"""Policy models: build one from scratch with a seed, load one from a Levanter checkpoint (local or
gs://) or from a Hugging Face checkpoint directory, save both formats.

Loading never reaches a hub: every path is checked first and a missing one raises
FileNotFoundError naming it. Levanter checkpoints use Levanter's own layout (the model under the
`model/` subpath of a `step-N` directory, as the Trainer writes it); the ones written here also
carry `model_config.json`, so they load without being told the architecture.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import os
from typing import Optional

import draccus
import equinox as eqx
import fsspec
import haliax as hax
import jax
import jax.numpy as jnp
from levanter.checkpoint import discover_latest_checkpoint, load_checkpoint, save_checkpoint
from levanter.models.lm_model import LmConfig, LmHeadModel
from transformers import PreTrainedTokenizerBase

from marinrl.config.model import ModelConfig
from marinrl.levanter_configs import attention_backend, gradient_checkpointing_policy, to_levanter
from marinrl.models.hf_checkpoints import default_mesh as _default_mesh
from marinrl.models.hf_checkpoints import has_tokenizer as _has_tokenizer
from marinrl.models.hf_checkpoints import load_hf_checkpoint
from marinrl.models.tokenizers import byte_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


def _not_an_unknown_leaf(record: logging.LogRecord) -> bool:
    """Levanter warns "Unknown leaf type" for every leaf of a loading template that is not an array (a
    model's static parts): 16 lines per `marinrl eval` that say nothing is wrong."""
    return not record.getMessage().startswith("Unknown leaf type")


logging.getLogger("levanter.tensorstore_serialization").addFilter(_not_an_unknown_leaf)

MODEL_CONFIG_FILE = "model_config.json"


def build_model(config: ModelConfig, *, axis_mapping=None, mesh=None, dtype=None) -> LmHeadModel:
    """The model `config` describes: loaded from its checkpoint, or initialized from its seed, in `dtype`
    (default `config.dtype`). Eager, never under a caller's jit: a checkpoint is read straight onto `mesh`
    with `axis_mapping`, tensor by tensor, and an initialization runs as one program whose outputs are
    laid out by `axis_mapping`; no device ever holds the whole model unless the mesh has one device
    (defaults: the mesh and mapping in context, else one device)."""
    dtype = jnp.dtype(dtype or config.dtype)
    if config.hf_checkpoint:
        return load_hf_checkpoint(config.hf_checkpoint, dtype=dtype, axis_mapping=axis_mapping, mesh=mesh,
                                  overrides=_levanter_knobs(config))
    if config.levanter_checkpoint:
        return load_levanter_checkpoint(
            config.levanter_checkpoint, model_config=None, vocab_size=None, dtype=dtype, fallback=config,
            axis_mapping=axis_mapping, mesh=mesh,
        )
    if mesh is None and axis_mapping is None:
        return init_model(to_levanter(config.model), config.vocab_size, seed=config.seed, init_std=config.init_std,
                          dtype=dtype)
    with _default_mesh(mesh):
        return hax.named_jit(
            lambda: init_model(to_levanter(config.model), config.vocab_size, seed=config.seed,
                               init_std=config.init_std, dtype=dtype),
            out_axis_resources=axis_mapping)()


def model_architecture(config: ModelConfig) -> tuple[LmConfig, int]:
    """(Levanter config, vocabulary size) of the model `build_model(config)` returns, from the checkpoint's
    config file alone (no weights are read): what a mesh is planned from before the load."""
    if config.hf_checkpoint:
        from marinrl.models.hf_checkpoints import levanter_config, read_hf_config

        hf_config = read_hf_config(config.hf_checkpoint)
        lev = levanter_config(hf_config, config.hf_checkpoint)
        knobs = {k: v for k, v in _levanter_knobs(config).items() if hasattr(lev, k)}
        return dataclasses.replace(lev, **knobs), int(hf_config.vocab_size)
    if config.levanter_checkpoint:
        step_dir = discover_latest_checkpoint(config.levanter_checkpoint)
        saved = _read_model_config(step_dir) if step_dir else None
        if saved:
            return saved
    return to_levanter(config.model), config.vocab_size


def _levanter_knobs(config: ModelConfig) -> dict:
    """The Levanter-only knobs an HF checkpoint's model takes from `config.model` (its gradient checkpointing and
    attention backend, as Levanter takes them); a knob `config.model` lacks keeps the checkpoint family's own."""
    knobs = {}
    if getattr(config.model, "gradient_checkpointing", None) is not None:
        knobs["gradient_checkpointing"] = gradient_checkpointing_policy(config.model.gradient_checkpointing)
    if isinstance(getattr(config.model, "attn_backend", None), str):
        knobs["attn_backend"] = attention_backend(config.model.attn_backend)
    return knobs


def abstract_model(config: ModelConfig, dtype=None) -> LmHeadModel:
    """`build_model(config)`'s structure, shapes and dtypes (`jax.ShapeDtypeStruct` leaves), without
    reading a weight or running an initializer."""
    lev, vocab = model_architecture(config)
    dtype = jnp.dtype(dtype or config.dtype)
    shape = eqx.filter_eval_shape(lev.model_type.init, hax.Axis("vocab", vocab), lev, key=jax.random.PRNGKey(0))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        shape)


def build_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer that goes with `build_model(config)`."""
    if config.tokenizer:
        return load_tokenizer(config.tokenizer)
    if config.hf_checkpoint and _has_tokenizer(config.hf_checkpoint):
        return load_tokenizer(config.hf_checkpoint)
    return byte_tokenizer(config.vocab_size)


def init_model(
    model_config: LmConfig,
    vocab_size: int,
    *,
    seed: int = 0,
    init_std: Optional[float] = None,
    dtype=jnp.float32,
) -> LmHeadModel:
    """A freshly initialized model. The jitted initializer is compiled once per configuration and
    process, so a second model of the same shape (the trainer's frozen reference) costs milliseconds."""
    dtype = jnp.dtype(dtype)
    try:
        init = _initializer(model_config, vocab_size, init_std, dtype.name)
    except TypeError:  # an unhashable custom config: compile for this call only
        init = _initializer.__wrapped__(model_config, vocab_size, init_std, dtype.name)
    return init(jax.random.PRNGKey(seed))


@functools.lru_cache(maxsize=16)
def _initializer(model_config: LmConfig, vocab_size: int, init_std: Optional[float], dtype_name: str):
    @eqx.filter_jit
    def _init(key):
        model = model_config.model_type.init(hax.Axis("vocab", vocab_size), model_config, key=key)
        if init_std is not None:
            model = _normal_init(model, init_std, jax.random.fold_in(key, 1))
        return _cast(model, jnp.dtype(dtype_name))

    return _init


def _normal_init(model, std: float, key):
    leaves, treedef = jax.tree_util.tree_flatten(model)
    keys = jax.random.split(key, len(leaves))
    new = [
        (std * jax.random.normal(k, x.shape, x.dtype) if eqx.is_inexact_array(x) and x.ndim >= 2 else x)
        for x, k in zip(leaves, keys)
    ]
    return jax.tree_util.tree_unflatten(treedef, new)


def _cast(model, dtype):
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)


# --------------------------------------------------------------------------- Levanter checkpoints


def save_levanter_checkpoint(model: LmHeadModel, path: str, step: int) -> str:
    """Write `model` as a Levanter checkpoint at `path` (local or gs://), the model under `model/` as the
    Trainer lays it out, plus `model_config.json`. `metadata.json`, which marks a checkpoint complete, is
    written last. Returns `path`."""
    fs, plain = fsspec.core.url_to_fs(path)
    fs.makedirs(plain, exist_ok=True)
    with fs.open(os.path.join(plain, MODEL_CONFIG_FILE), "w") as f:
        f.write(_encode_model_config(model.config, model.Vocab.size))
    save_checkpoint({"model": model}, step=step, checkpoint_path=path, is_temporary=False)
    return path


def load_levanter_checkpoint(
    path: str,
    model_config: Optional[LmConfig] = None,
    vocab_size: Optional[int] = None,
    *,
    dtype=jnp.float32,
    fallback: Optional[ModelConfig] = None,
    axis_mapping=None,
    mesh=None,
) -> LmHeadModel:
    """Load the model of a Levanter checkpoint: `path` is a `step-N` directory or a folder of them (the
    latest is taken). The architecture comes from `model_config`/`vocab_size` if given, else from the
    checkpoint's `model_config.json`, else from `fallback` (a ModelConfig's `model` and `vocab_size`)."""
    fs, plain = fsspec.core.url_to_fs(path)
    if not fs.exists(plain):
        raise FileNotFoundError(f"Levanter checkpoint not found: {path}")
    step_dir = discover_latest_checkpoint(path)
    if step_dir is None:
        raise FileNotFoundError(f"no Levanter checkpoint (a directory with metadata.json) under {path}")
    saved = _read_model_config(step_dir)
    if model_config is None:
        model_config = saved[0] if saved else (to_levanter(fallback.model) if fallback else None)
    if vocab_size is None:
        vocab_size = saved[1] if saved else (fallback.vocab_size if fallback else None)
    if model_config is None or vocab_size is None:
        raise ValueError(
            f"{step_dir} has no {MODEL_CONFIG_FILE}: pass model_config and vocab_size to load it"
        )
    Vocab = hax.Axis("vocab", vocab_size)
    template = eqx.filter_eval_shape(model_config.model_type.init, Vocab, model_config, key=jax.random.PRNGKey(0))
    with _default_mesh(mesh):
        model = load_checkpoint(
            template, step_dir, subpath="model", discover_latest=False, axis_mapping=axis_mapping, mesh=mesh
        )
    return _cast(model, dtype)


def _levanter_config_name(config: LmConfig) -> str:
    for name, cls in LmConfig.get_known_choices().items():
        if type(config) is cls:
            return name
    raise ValueError(f"{type(config).__name__} is not a registered Levanter LmConfig")


def _plain(x):
    """draccus.encode output with enums replaced by their values, so that it is plain JSON."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, enum.Enum):
        return x.value
    return x


def _encode_model_config(config: LmConfig, vocab_size: int) -> str:
    encoded = {"type": _levanter_config_name(config), **_plain(draccus.encode(config))}
    return json.dumps({"vocab_size": vocab_size, "model": encoded}, indent=1)


def _read_model_config(step_dir: str) -> Optional[tuple[LmConfig, int]]:
    fs, plain = fsspec.core.url_to_fs(step_dir)
    # a Trainer checkpoint's step dir has no config; ours may sit in the step dir or its parent
    for d in (plain, os.path.dirname(plain.rstrip("/"))):
        p = os.path.join(d, MODEL_CONFIG_FILE)
        if fs.exists(p):
            with fs.open(p, "r") as f:
                raw = json.load(f)
            return draccus.decode(LmConfig, raw["model"]), int(raw["vocab_size"])
    return None


def model_summary(model: LmHeadModel) -> dict:
    """Architecture and size in a JSON-friendly dict (for logs and run headers)."""
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array)))
    return {
        "type": _levanter_config_name(model.config),
        "vocab_size": model.Vocab.size,
        "n_params": int(n_params),
        "config": _plain(draccus.encode(model.config)),
    }
