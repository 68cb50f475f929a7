"""Tokenizers: an offline byte-level tokenizer for tests and the CPU demo, and loading of any local
Hugging Face tokenizer directory. Nothing here ever reaches a hub.

The byte-level tokenizer maps each UTF-8 byte to the token id equal to its value (0..255), then
puts the special tokens right after the bytes and pads the vocabulary with reserved tokens up to
`vocab_size`, so that `len(tokenizer) == vocab_size` and a model's vocabulary axis matches it
exactly (Levanter resizes a model to `len(tokenizer)` when it loads an HF checkpoint).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

import fsspec

if TYPE_CHECKING:  # transformers is imported where a tokenizer is built: the sizes below are free
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)
N_BYTES = 256
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")

# Each message is `<|role|>content<|eos|>`; the conversation starts with BOS and a generation prompt
# opens an assistant turn, which the model ends by sampling EOS (the end-of-turn token).
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def byte_tokenizer_errors(vocab_size: int) -> str | None:
    """Why `byte_tokenizer(vocab_size)` cannot be built, or None: checked without building it."""
    n_fixed = N_BYTES + len(SPECIAL_TOKENS)
    if vocab_size < n_fixed:
        return f"byte_tokenizer: vocab_size must be >= {n_fixed} (256 bytes + specials), got {vocab_size}"
    return None


def byte_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level `PreTrainedTokenizerFast`: token id = byte value for ids 0..255, then BOS, EOS, PAD
    and the role markers, then reserved tokens up to `vocab_size`. Built offline: 2 s at Qwen3's 151,936.

    The special and reserved tokens are added to the Rust tokenizer, marked special (decoding with
    `skip_special_tokens` drops them); the Python wrapper names only the role markers as its
    additional special tokens: given all 151,680 reserved ones it took 3 minutes to build."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # where transformers 4 and 5 both have it

    problem = byte_tokenizer_errors(vocab_size)
    if problem:
        raise ValueError(problem)
    n_fixed = N_BYTES + len(SPECIAL_TOKENS)
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(N_BYTES)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    # ByteLevel maps every byte to one printable character; with no merges BPE then emits one token
    # per byte, whose id is the byte value.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - n_fixed)]
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *reserved)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=BYTE_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    assert tok.convert_tokens_to_ids(BOS) == N_BYTES and tok.convert_tokens_to_ids(PAD) == N_BYTES + 2
    assert len(tok) == vocab_size
    return tok


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load a Hugging Face tokenizer from a local directory or an fsspec URL (gs://, file://, ...).

    Never contacts a hub: a path that does not exist raises FileNotFoundError naming it."""
    if "://" in path and not path.startswith("file://"):
        fs, plain = fsspec.core.url_to_fs(path)
        if not fs.isdir(plain):
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        with tempfile.TemporaryDirectory() as tmp:
            for name in fs.ls(plain, detail=False):
                if fs.isfile(name):
                    fs.get(name, os.path.join(tmp, os.path.basename(name)))
            return _load_local_tokenizer(tmp, shown_as=path)
    return _load_local_tokenizer(path.removeprefix("file://"), shown_as=path)


def _load_local_tokenizer(path: str, *, shown_as: str) -> PreTrainedTokenizerBase:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory not found: {shown_as}")
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {shown_as}: none of {', '.join(TOKENIZER_FILES)}")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many kinds for a broken directory
        raise ValueError(f"cannot load the tokenizer in {shown_as}: {e}") from e
