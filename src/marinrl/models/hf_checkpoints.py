"""Hugging Face checkpoints: load one of the families Levanter implements straight onto a device mesh,
export a Levanter model as one.

Loading reads `config.json` first and refuses, with one message naming the file and the field, what
Levanter would convert wrongly or not at all (an unknown `model_type`, a head size Levanter's model of
that family cannot represent). The weights then stream from the path itself (local, `file://`, `gs://`
or any fsspec URL; no local copy of the shards): each process reads, by byte range, only the rows of
each safetensors tensor that its own devices hold (tensors are split by rows over the mesh's devices),
converted to the requested dtype; Levanter's converter then maps the state dict onto the model and one
program lays it out by the axis mapping, moving rows between processes where the mapping needs it. No
process reads the whole checkpoint unless it holds every device of the mesh, and no device holds the
whole model unless the mesh has one device. Nothing reaches the Hugging Face hub.

tests/test_hf_families.py checks every family against transformers' own PyTorch model of the same
checkpoint (load, generate, one training step, export, reload); docs/models.md lists what is supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import struct
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


_READ_BYTES: dict[str, int] = {}
"""Bytes of checkpoint weight files (safetensors headers and tensor data) this process has read, by path."""


def hf_reads() -> int:
    """How many times this process has read a Hugging Face checkpoint's weights (any path)."""
    return sum(_READS.values())


def hf_read_bytes() -> int:
    """Bytes of Hugging Face checkpoint weight files this process has read (any path): headers and the
    byte ranges of the tensor rows its devices hold; a whole-file read (the fallback) counts every byte."""
    return sum(_READ_BYTES.values())

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
    overrides: Optional[dict] = None,
) -> LmHeadModel:
    """Load a Hugging Face checkpoint directory (local or fsspec URL): each process reads the rows of each
    safetensors tensor its devices hold (`_read_state_dict`), Levanter's converter maps them onto the model.

    The architecture comes from its config.json; the vocabulary keeps the checkpoint's size. Weights are
    read in `dtype` onto `mesh` (default: the mesh in context, else one device) and sharded by
    `axis_mapping` (default: the mapping in context, else replicated). `overrides`: fields of the
    Levanter config set over the family's defaults (Levanter-only knobs: `gradient_checkpointing`,
    `attn_backend`); one the family's config lacks is skipped."""
    hf_config = read_hf_config(path)
    config = levanter_config(hf_config, path)
    config = dataclasses.replace(config, **{k: v for k, v in (overrides or {}).items() if hasattr(config, k)})
    # The converter wants a tokenizer to size the vocabulary; we keep the checkpoint's size instead.
    converter = HFCheckpointConverter(
        type(config), reference_checkpoint=path, HfConfigClass=type(hf_config), tokenizer=byte_tokenizer(512)
    )
    _READS[path] = _READS.get(path, 0) + 1
    dtype = jnp.dtype(dtype)
    fs, plain = fsspec.core.url_to_fs(path)
    files = _safetensors_files(fs, plain)
    with default_mesh(mesh):
        if files is None:
            _warn_whole_file_read(path)
            _READ_BYTES[path] = _READ_BYTES.get(path, 0) + sum(fs.size(f) for f in _torch_files(fs, plain))
            model = converter.load_pretrained(
                config.model_type,
                ref=path,
                config=config,
                axis_mapping=axis_mapping,
                resize_vocab_to_match_tokenizer=False,
                dtype=dtype,
            )
        else:
            state_dict = _read_state_dict(fs, files, path, dtype, hax.partitioning._resolve_mesh())
            model = _from_state_dict(converter, config, int(hf_config.vocab_size), state_dict, axis_mapping)
            del state_dict
    return _in_dtype(model, dtype)


_SAFETENSORS_DTYPES = {
    "F16": np.dtype(np.float16), "BF16": np.dtype(jnp.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "I8": np.dtype(np.int8), "I16": np.dtype(np.int16), "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64), "U8": np.dtype(np.uint8), "U16": np.dtype(np.uint16), "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64), "BOOL": np.dtype(np.bool_),
}

_BATCH_BYTES = 256 * 1024**2
"""Host memory one round of range reads may hold (ranges are read concurrently where the filesystem can)."""

_warned_whole_file: set[str] = set()


def _warn_whole_file_read(path: str) -> None:
    if path not in _warned_whole_file:
        _warned_whole_file.add(path)
        logger.warning("%s has no safetensors weights (PyTorch .bin only): every process reads every byte of it "
                       "through Levanter's converter", path)


def _torch_files(fs, plain: str) -> list[str]:
    index = os.path.join(plain, "pytorch_model.bin.index.json")
    if fs.exists(index):
        with fs.open(index, "r") as f:
            return [os.path.join(plain, n) for n in dict.fromkeys(json.load(f)["weight_map"].values())]
    single = os.path.join(plain, "pytorch_model.bin")
    return [single] if fs.exists(single) else []


def _safetensors_files(fs, plain: str) -> Optional[list[str]]:
    """The checkpoint's safetensors files, in the index's order (the same on every host), or None."""
    index = os.path.join(plain, "model.safetensors.index.json")
    if fs.exists(index):
        with fs.open(index, "r") as f:
            return [os.path.join(plain, n) for n in dict.fromkeys(json.load(f)["weight_map"].values())]
    single = os.path.join(plain, "model.safetensors")
    return [single] if fs.exists(single) else None


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of a safetensors file: its key, dtype, shape and absolute byte range in `file`."""
    key: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def row_bytes(self) -> int:
        return (self.end - self.start) // self.shape[0] if self.shape and self.shape[0] else self.end - self.start


def _cat(fs, path: str, file: str, start: int, end: int) -> bytes:
    data = fs.cat_file(file, start=start, end=end)
    _READ_BYTES[path] = _READ_BYTES.get(path, 0) + len(data)
    return data


def _read_header(fs, file: str, path: str) -> list[_Tensor]:
    """The tensors of one safetensors file, from its header: 8 bytes of little-endian header length, then
    that many bytes of JSON giving each tensor's dtype, shape and data offsets (relative to the header's end)."""
    (n,) = struct.unpack("<Q", _cat(fs, path, file, 0, 8))
    header = json.loads(_cat(fs, path, file, 8, 8 + n))
    tensors = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        if meta["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {key} has dtype {meta['dtype']}, which this loader cannot read")
        lo, hi = meta["data_offsets"]
        tensors.append(_Tensor(key, file, _SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + lo,
                               8 + n + hi))
    return sorted(tensors, key=lambda t: t.start)


def _row_sharding(shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """How a checkpoint tensor is read: its rows (first dimension) split over as many of the mesh's devices
    as divide them (the mesh axes whose product is largest), so each device's part is one contiguous byte
    range; a scalar, or rows no mesh axis divides, replicated (every process reads all of it)."""
    P = jax.sharding.PartitionSpec
    if not shape:
        return jax.sharding.NamedSharding(mesh, P())
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    best: tuple = ()
    for r in range(len(axes), 0, -1):
        for combo in itertools.combinations(axes, r):
            size = math.prod(mesh.shape[a] for a in combo)
            if shape[0] % size == 0 and size > math.prod(mesh.shape[a] for a in best):
                best = combo
    return jax.sharding.NamedSharding(mesh, P(best if best else None))


def _read_state_dict(fs, files: list[str], path: str, dtype, mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """Every tensor of the safetensors `files` as a global jax.Array split by rows over `mesh`
    (`_row_sharding`), this process reading only the byte ranges of the rows its own devices hold.
    Floating tensors are cast to `dtype` as read, as Levanter's reader does (bfloat16 excepted, which
    numpy does not count as floating: `_in_dtype` casts those)."""
    tensors = [t for f in files for t in _read_header(fs, f, path)]
    cast = (lambda a: a.astype(dtype, copy=False)) if dtype is not None else (lambda a: a)
    out: dict[str, jax.Array] = {}
    # per tensor: its sharding, each local device's row range, the merged row ranges this process reads
    plans = []
    for t in tensors:
        sharding = _row_sharding(t.shape, mesh)
        rows = {}
        for device, index in sharding.addressable_devices_indices_map(t.shape).items():
            rows[device] = (0, 1) if not t.shape else index[0].indices(t.shape[0])[:2]
        segments: list[list[int]] = []
        for lo, hi in sorted(set(rows.values())):
            if segments and lo <= segments[-1][1]:
                segments[-1][1] = max(segments[-1][1], hi)
            else:
                segments.append([lo, hi])
        plans.append((t, sharding, rows, segments))
    total = sum(t.end - t.start for t in tensors)
    mine = sum((hi - lo) * t.row_bytes for t, _, _, segs in plans for lo, hi in segs)
    logger.info("Reading %d tensors from %s: %d of %d bytes (the rows of this process's %d devices)", len(tensors),
                path, mine, total, len(mesh.local_devices))
    batch: list = []

    def flush():
        files_, starts, ends = [], [], []
        for t, _, _, segs in batch:
            for lo, hi in segs:
                files_.append(t.file)
                starts.append(t.start + lo * t.row_bytes)
                ends.append(t.start + hi * t.row_bytes)
        blobs = iter(fs.cat_ranges(files_, starts, ends)) if files_ else iter(())
        for t, sharding, rows, segs in batch:
            got = {}
            for lo, hi in segs:
                data = next(blobs)
                if isinstance(data, Exception):
                    raise data
                _READ_BYTES[path] = _READ_BYTES.get(path, 0) + len(data)
                got[(lo, hi)] = data
            shards = []
            for device, (lo, hi) in rows.items():
                (slo, shi), data = next((k, v) for k, v in got.items() if k[0] <= lo and hi <= k[1])
                local_shape = (hi - lo,) + t.shape[1:] if t.shape else ()
                arr = np.frombuffer(data, dtype=t.dtype, count=math.prod(local_shape),
                                    offset=(lo - slo) * t.row_bytes).reshape(local_shape)
                if np.issubdtype(arr.dtype, np.floating):
                    arr = cast(arr)
                shards.append(jax.device_put(arr, device))
            out[t.key] = jax.make_array_from_single_device_arrays(t.shape, sharding, shards)
        batch.clear()

    held = 0
    for plan in plans:
        size = sum((hi - lo) * plan[0].row_bytes for lo, hi in plan[3])
        if batch and held + size > _BATCH_BYTES:
            flush()
            held = 0
        batch.append(plan)
        held += size
    flush()
    return out


def _from_state_dict(converter: HFCheckpointConverter, config: LmConfig, vocab_size: int, state_dict: dict,
                     axis_mapping) -> LmHeadModel:
    """The model of `state_dict` (HF keys), by Levanter's own conversion, in one program laid out by
    `axis_mapping`: what `HFCheckpointConverter.load_pretrained` does once it holds a state dict (no vocab
    resize: the model keeps the checkpoint's vocabulary)."""
    import equinox as eqx
    from haliax.state_dict import from_torch_compatible_state_dict
    from levanter.compat.hf_checkpoints import _patch_missing_buffers_for_deser

    Vocab = hax.Axis("vocab", vocab_size)
    model_cls = config.model_type
    prefix = converter.ignore_prefix
    if not (prefix and any(k.startswith(f"{prefix}.") for k in state_dict)):
        prefix = None

    def convert(template, sd):
        model = from_torch_compatible_state_dict(template, sd, prefix=prefix)
        model = _patch_missing_buffers_for_deser(model, model_cls, Vocab, config, jax.random.PRNGKey(0), axis_mapping)
        return hax.shard_with_axis_mapping(model, axis_mapping)

    convert = hax.named_jit(convert, axis_resources=axis_mapping, out_axis_resources=axis_mapping,
                            donate_args=(True,))
    return convert(eqx.filter_eval_shape(model_cls.init, Vocab, config, key=jax.random.PRNGKey(0)), state_dict)


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
