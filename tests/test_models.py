"""Policy models and tokenizers: from-scratch init, Levanter and HF checkpoint round trips (local and
through the GCS emulator), the offline byte-level tokenizer, and clear errors for missing paths."""

from __future__ import annotations

import json
import os

import draccus
import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask
from levanter.models.llama import LlamaConfig
from safetensors.numpy import load_file

from marinrl.config.model import LlamaArchitecture, ModelConfig
from marinrl.levanter_configs import to_levanter
from marinrl.models.hf_checkpoints import save_hf_checkpoint
from marinrl.models.policy_model import (
    build_model,
    build_tokenizer,
    init_model,
    load_hf_checkpoint,
    load_levanter_checkpoint,
    save_levanter_checkpoint,
)
from marinrl.models.tokenizers import BOS, EOS, PAD, ROLE_TOKENS, byte_tokenizer, load_tokenizer

SMALL = LlamaConfig(
    seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2,
    gradient_checkpointing=False,
)
CONFIG = ModelConfig(model=SMALL, vocab_size=512, seed=3)


def _arrays(model):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]


def _assert_same_weights(a, b):
    xs, ys = _arrays(a), _arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _logits(model, ids):
    return np.asarray(model(hax.named(jnp.asarray(ids), "position"), attn_mask=AttentionMask.causal()).array)


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIG)


# ------------------------------------------------------------------------------------------- init


def test_init_is_seeded(model):
    _assert_same_weights(model, build_model(CONFIG))
    other = build_model(ModelConfig(model=SMALL, vocab_size=512, seed=4))
    assert not np.array_equal(_arrays(model)[0], _arrays(other)[0])
    assert model.Vocab.size == 512 and model.config.hidden_dim == 32


def test_init_std_gives_normal_weight_matrices_and_keeps_norms():
    m = init_model(SMALL, 512, seed=0, init_std=0.02)
    emb = np.asarray(m.embeddings.token_embeddings.weight.array)
    assert abs(emb.std() - 0.02) < 0.002 and abs(emb.mean()) < 0.002
    np.testing.assert_array_equal(np.asarray(m.transformer.norm.weight.array), 1.0)


def test_model_config_parses_with_draccus():
    cfg = draccus.decode(ModelConfig, {
        "model": {"type": "llama", "hidden_dim": 32, "intermediate_dim": 64, "num_layers": 2,
                  "num_heads": 2, "num_kv_heads": 2, "seq_len": 64},
        "vocab_size": 300, "seed": 7, "init_std": 0.02,
    })
    assert isinstance(cfg.model, LlamaArchitecture) and cfg.model.num_layers == 2 and cfg.vocab_size == 300
    assert isinstance(to_levanter(cfg.model), LlamaConfig) and to_levanter(cfg.model).hidden_dim == 32
    with pytest.raises(ValueError, match="at most one"):
        ModelConfig(levanter_checkpoint="a", hf_checkpoint="b")


# ------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_maps_bytes_to_ids_and_has_specials():
    tok = byte_tokenizer(512)
    assert len(tok) == 512
    text = "héllo, wörld ☃"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id] == [256, 257, 258]
    assert tok.convert_tokens_to_ids(list(ROLE_TOKENS)) == [259, 260, 261, 262]
    # special tokens in text are single tokens; decode can drop them
    ids = tok.encode("a<|user|>b", add_special_tokens=False)
    assert ids == [97, 260, 98] and tok.decode(ids, skip_special_tokens=True) == "ab"
    with pytest.raises(ValueError, match="vocab_size"):
        byte_tokenizer(100)


def test_byte_tokenizer_at_qwen3s_vocabulary_has_every_id_and_drops_reserved_ones_from_text():
    """A random model of a real recipe's shape gets this tokenizer (the device check, dry runs): its reserved
    ids are special tokens, so decoding what a random model samples with `skip_special_tokens` keeps only bytes."""
    vocab = 151_936
    tok = byte_tokenizer(vocab)
    assert len(tok) == vocab
    last = f"<|reserved_{vocab - 264}|>"  # the 263 bytes and specials come first
    assert tok.convert_ids_to_tokens(vocab - 1) == last and tok.convert_tokens_to_ids(last) == vocab - 1
    assert tok.encode(f"a{last}b", add_special_tokens=False) == [97, vocab - 1, 98]
    assert tok.decode([104, 263, vocab - 1, 105], skip_special_tokens=True) == "hi"


def test_byte_tokenizer_chat_template():
    tok = byte_tokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>s<|eos|><|user|>hi<|eos|><|assistant|>"
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert ids == [256, 259, ord("s"), 257, 260, ord("h"), ord("i"), 257, 261]


def test_byte_tokenizer_saves_and_loads_in_transformers_and_levanter(tmp_path):
    from levanter.compat.hf_checkpoints import load_tokenizer as levanter_load_tokenizer

    tok = byte_tokenizer(300)
    tok.save_pretrained(tmp_path / "tok")
    for loaded in (load_tokenizer(str(tmp_path / "tok")), levanter_load_tokenizer(str(tmp_path / "tok"))):
        assert len(loaded) == 300
        assert loaded.encode("abc", add_special_tokens=False) == [97, 98, 99]
        assert loaded.eos_token_id == 257
        assert loaded.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                          add_generation_prompt=True) == "<|bos|><|user|>x<|eos|><|assistant|>"


def test_missing_tokenizer_is_a_clear_error(tmp_path, gcs_root):
    missing = str(tmp_path / "no-such-tokenizer")
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer"):
        load_tokenizer(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="gs://"):
        load_tokenizer(f"{gcs_root}/tok")


def test_tokenizer_loads_from_gcs(gcs_root, tmp_path):
    import fsspec

    byte_tokenizer(300).save_pretrained(tmp_path / "tok")
    fs = fsspec.filesystem("gs", token="anon")
    fs.put(str(tmp_path / "tok") + "/", f"{gcs_root}/tok/", recursive=True)
    tok = load_tokenizer(f"{gcs_root}/tok")
    assert len(tok) == 300 and tok.encode("z", add_special_tokens=False) == [ord("z")]


# ---------------------------------------------------------------------------- Levanter checkpoints


def test_levanter_checkpoint_round_trip_local(model, tmp_path):
    root = str(tmp_path / "ckpts")
    save_levanter_checkpoint(model, f"{root}/step-5", step=5)
    later = build_model(ModelConfig(model=SMALL, vocab_size=512, seed=9))
    save_levanter_checkpoint(later, f"{root}/step-9", step=9)
    _assert_same_weights(load_levanter_checkpoint(f"{root}/step-5"), model)
    _assert_same_weights(load_levanter_checkpoint(root), later)  # a folder of steps: the latest
    # through ModelConfig, and with the architecture given explicitly
    _assert_same_weights(build_model(ModelConfig(levanter_checkpoint=f"{root}/step-5")), model)
    _assert_same_weights(load_levanter_checkpoint(f"{root}/step-5", SMALL, 512), model)


def test_levanter_checkpoint_round_trip_gcs(model, gcs_root):
    path = f"{gcs_root}/run/step-2"
    save_levanter_checkpoint(model, path, step=2)
    loaded = load_levanter_checkpoint(f"{gcs_root}/run")
    _assert_same_weights(loaded, model)
    ids = np.arange(10) % 512
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(model, ids))


def test_levanter_checkpoint_written_by_the_trainer_layout_loads(model, tmp_path):
    """A Trainer checkpoint has no model_config.json: the architecture comes from the caller."""
    from levanter.checkpoint import save_checkpoint

    path = str(tmp_path / "trainer" / "step-3")
    save_checkpoint({"model": model, "step": 3}, step=3, checkpoint_path=path)
    with pytest.raises(ValueError, match="model_config"):
        load_levanter_checkpoint(path)
    _assert_same_weights(load_levanter_checkpoint(path, SMALL, 512), model)
    _assert_same_weights(build_model(ModelConfig(model=SMALL, vocab_size=512, levanter_checkpoint=path)), model)


def test_missing_levanter_checkpoint_is_a_clear_error(tmp_path, gcs_root):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_levanter_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_levanter_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="gs://"):
        load_levanter_checkpoint(f"{gcs_root}/nothing-here")


# ---------------------------------------------------------------------------------- HF checkpoints


def test_hf_checkpoint_round_trip(model, tmp_path):
    tok = byte_tokenizer(512)
    path = str(tmp_path / "hf")
    save_hf_checkpoint(model, path, tokenizer=tok)
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 512 and cfg["hidden_size"] == 32
    assert cfg["eos_token_id"] == tok.eos_token_id
    weights = load_file(os.path.join(path, "model.safetensors"))
    assert weights["model.layers.1.self_attn.q_proj.weight"].shape == (32, 32)
    assert weights["model.embed_tokens.weight"].shape == (512, 32)
    assert weights["lm_head.weight"].shape == (512, 32)

    loaded = load_hf_checkpoint(path)
    assert loaded.config.hidden_dim == 32 and loaded.config.num_layers == 2 and loaded.Vocab.size == 512
    _assert_same_weights(loaded, model)
    ids = np.arange(12) * 7 % 512
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(model, ids))
    # through ModelConfig: the tokenizer comes along
    hf_cfg = ModelConfig(hf_checkpoint=path)
    _assert_same_weights(build_model(hf_cfg), model)
    assert len(build_tokenizer(hf_cfg)) == 512


def test_hf_checkpoint_loads_from_gcs(model, tmp_path, gcs_root):
    import fsspec

    save_hf_checkpoint(model, str(tmp_path / "hf"), tokenizer=byte_tokenizer(512))
    fsspec.filesystem("gs", token="anon").put(str(tmp_path / "hf") + "/", f"{gcs_root}/hf/", recursive=True)
    _assert_same_weights(load_hf_checkpoint(f"{gcs_root}/hf"), model)


def test_missing_hf_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not-there"):
        load_hf_checkpoint(str(tmp_path / "not-there"))
    (tmp_path / "no-config").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(str(tmp_path / "no-config"))
    with pytest.raises(FileNotFoundError, match="not-there"):
        build_model(ModelConfig(hf_checkpoint=str(tmp_path / "not-there")))
