"""Hugging Face checkpoints: load one of the families Levanter implements straight onto a device mesh,
export a Levanter model as one.

Loading reads `config.json` first and refuses, with one message naming the file and the field, what
Levanter would convert wrongly or not at all (an unknown `model_type`, a head size Levanter's model of
that family cannot represent). The weights then stream from the path itself (local, `file://`, `gs://`
or any fsspec URL; no local copy of the shards), each tensor read already sharded over the mesh and
converted to the requested dtype, then laid out by the axis mapping: no device ever holds the whole
model unless the mesh has one device. Nothing reaches the Hugging Face hub.

tests/test_hf_families.py checks every family against transformers' own PyTorch model of the same
checkpoint (load, generate, one training step, export, reload); docs/models.md lists what is supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from typing import Optional

import fsspec
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.compat.hf_checkpoints import HFCheckpointConverter
from levanter.models.lm_model import LmConfig, LmHeadModel
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from marinrl.models.tokenizers import byte_tokenizer

logger = logging.getLogger(__name__)

_READS: dict[str, int] = {}
"""Checkpoint weight reads of this process, by path: a trainer or rollout worker reads its checkpoint
once (docs/models.md, "Loading"), and tests and bench/rehearsal.py check it with `hf_reads()`."""


def hf_reads() -> int:
    """How many times this process has read a Hugging Face checkpoint's weights (any path)."""
    return sum(_READS.values())

HF_TO_LEVANTER = {
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mixtral",
    "qwen2": "qwen",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "olmo2": "olmo2",
    "gpt2": "gpt2",
}
"""Hugging Face `model_type` -> name of the Levanter config in LmConfig's registry. Checked against
transformers' PyTorch models: llama (Llama 3 rope scaling included), qwen2, qwen3, gemma, mistral."""


@contextlib.contextmanager
def default_mesh(mesh: Optional[jax.sharding.Mesh] = None):
    """Levanter's checkpoint readers need a mesh. Use `mesh`, else the one in context, else a one-device
    mesh on the default device (where an unsharded jax array would live)."""
    if mesh is None and hax.partitioning._resolve_mesh() is not None:
        yield
        return
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with hax.partitioning.set_mesh(mesh):
        yield


def read_hf_config(path: str) -> PretrainedConfig:
    """The transformers config of the checkpoint at `path` (local or fsspec URL), read from its config.json."""
    fs, plain = fsspec.core.url_to_fs(path)
    if not fs.isdir(plain):
        raise FileNotFoundError(f"Hugging Face checkpoint directory not found: {path}")
    config_file = os.path.join(plain, "config.json")
    if not fs.exists(config_file):
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
    with fs.open(config_file, "r") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}/config.json is not valid JSON: {e}") from None
    model_type = raw.get("model_type")
    if model_type not in HF_TO_LEVANTER or HF_TO_LEVANTER[model_type] not in LmConfig.get_known_choices():
        known = sorted(t for t, name in HF_TO_LEVANTER.items() if name in LmConfig.get_known_choices())
        raise ValueError(f"{path}/config.json: model_type {model_type!r} has no Levanter model; "
                         f"supported: {', '.join(known)}")
    return AutoConfig.for_model(**raw)


def levanter_config(hf_config: PretrainedConfig, path: str = "<config>") -> LmConfig:
    """The Levanter config of `hf_config`, or a ValueError naming what Levanter cannot represent."""
    model_type = hf_config.model_type
    if model_type == "qwen2" and not hasattr(hf_config, "no_bias"):
        # Levanter's QwenConfig reads `no_bias` (its MLP bias), which transformers' Qwen2Config lacks:
        # Qwen2 has biases on q/k/v (Levanter always adds those) and none in the MLP.
        hf_config.no_bias = True
    config = LmConfig.get_choice_class(HF_TO_LEVANTER[model_type]).from_hf_config(hf_config)
    hf_head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if hasattr(config, "attention_config") and config.attention_config().head_size != hf_head:
        raise ValueError(
            f"{path}/config.json: head_dim is {hf_head}, but Levanter's {model_type} model uses hidden_size / "
            f"num_attention_heads = {config.attention_config().head_size}; this checkpoint cannot be converted")
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None:
        logger.warning("%s: Levanter's Mistral ignores sliding_window=%d; sequences longer than that attend past "
                       "the window (logits differ from transformers beyond %d tokens)", path, window, window)
    return config


def load_hf_checkpoint(
    path: str,
    *,
    dtype=jnp.float32,
    axis_mapping=None,
    mesh: Optional[jax.sharding.Mesh] = None,
    gradient_checkpointing: Optional[bool] = None,
) -> LmHeadModel:
    """Load a Hugging Face checkpoint directory (local or fsspec URL) through Levanter's converter.

    The architecture comes from its config.json; the vocabulary keeps the checkpoint's size. Weights are
    read in `dtype` onto `mesh` (default: the mesh in context, else one device) and sharded by
    `axis_mapping` (default: the mapping in context, else replicated). `gradient_checkpointing`, a
    Levanter-only knob, overrides the family's default when not None."""
    hf_config = read_hf_config(path)
    config = levanter_config(hf_config, path)
    if gradient_checkpointing is not None and hasattr(config, "gradient_checkpointing"):
        config = dataclasses.replace(config, gradient_checkpointing=gradient_checkpointing)
    # The converter wants a tokenizer to size the vocabulary; we keep the checkpoint's size instead.
    converter = HFCheckpointConverter(
        type(config), reference_checkpoint=path, HfConfigClass=type(hf_config), tokenizer=byte_tokenizer(512)
    )
    _READS[path] = _READS.get(path, 0) + 1
    dtype = jnp.dtype(dtype)
    with default_mesh(mesh):
        model = converter.load_pretrained(
            config.model_type,
            ref=path,
            config=config,
            axis_mapping=axis_mapping,
            resize_vocab_to_match_tokenizer=False,
            dtype=dtype,
        )
    return _in_dtype(model, dtype)


def _in_dtype(model, dtype):
    """`model` with every floating weight in `dtype`. Levanter's safetensors reader leaves bfloat16 tensors
    in bfloat16 whatever it is asked for (`np.issubdtype(bfloat16, np.floating)` is False for ml_dtypes),
    so a float32 load of a bf16 checkpoint needs this cast: one program, each output on its input's
    sharding, the inputs donated."""
    import equinox as eqx

    arrays, static = eqx.partition(model, eqx.is_inexact_array)
    if all(x.dtype == dtype for x in jax.tree.leaves(arrays)):
        return model
    shardings = jax.tree.map(lambda x: x.sharding, arrays)
    cast = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dtype), t), out_shardings=shardings, donate_argnums=0)
    return eqx.combine(cast(arrays), static)


def save_hf_checkpoint(model: LmHeadModel, path: str, *, tokenizer: PreTrainedTokenizerBase) -> str:
    """Export `model` as a Hugging Face checkpoint directory (config.json, safetensors, the tokenizer)."""
    hf_config = model.config.to_hf_config(vocab_size=model.Vocab.size)
    with tempfile.TemporaryDirectory() as ref:
        # Levanter's converter copies a few keys from a reference checkpoint's config: we give it our own
        # config, written locally, so nothing is fetched.
        hf_config.save_pretrained(ref)
        converter = HFCheckpointConverter(
            type(model.config), reference_checkpoint=ref, HfConfigClass=type(hf_config), tokenizer=tokenizer
        )
        with default_mesh():
            converter.save_pretrained(model, path, save_reference_code=False, save_tokenizer=True)
    return path


def has_tokenizer(path: str) -> bool:
    """Whether the checkpoint directory at `path` carries its own tokenizer."""
    fs, plain = fsspec.core.url_to_fs(path)
    return fs.exists(os.path.join(plain, "tokenizer_config.json"))
