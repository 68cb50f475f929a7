"""Real Hugging Face checkpoints of every family Levanter implements among Llama 3, Qwen2, Qwen3, Gemma and
Mistral, written by `transformers` itself (tiny random models), checked against transformers' own
PyTorch model of the same checkpoint: load, generate, one training step, export, reload. A conversion
bug (a transposed or misnamed weight, a wrong rotary or norm, a lost bias) moves logits by O(their
scale); the bounds below are a few float32 ulps of that scale.

Bounds: both sides compute the same float32 function with different summation orders; a sum of n
float32 terms reordered changes by at most about n · eps32 · Σ|terms|. Each logit is a sum over
hidden = 64 products after two layers whose norms keep activations O(1), so 64 · eps32 · max|logits|
covers any reordering, while any conversion bug is ~10⁵ times larger."""

from __future__ import annotations

import json
import os

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from levanter.layers.attention import AttentionBackend, AttentionMask
from levanter.models.llama import LlamaConfig, LlamaLMHeadModel

torch = pytest.importorskip("torch",
                            reason="torch (CPU) is in the dev extra: pip install -c constraints.txt -e '.[dev]'")
transformers = pytest.importorskip("transformers")

from marinrl.config.model import ModelConfig  # noqa: E402
from marinrl.config.server import InferenceServerConfig  # noqa: E402
from marinrl.inference import sampler as scan_sampler  # noqa: E402
from marinrl.inference import sharding  # noqa: E402
from marinrl.inference.server import InferenceServer  # noqa: E402
from marinrl.models.hf_checkpoints import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from marinrl.models.policy_model import build_model, build_tokenizer  # noqa: E402
from marinrl.models.tokenizers import byte_tokenizer  # noqa: E402

VOCAB = 512
EPS32 = float(np.finfo(np.float32).eps)
ULPS = 64  # = hidden size: see the module docstring
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    # Llama 3: its rope scaling, untied head
    "llama3": lambda: transformers.LlamaConfig(
        **_COMMON, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    # Qwen2: q/k/v biases, tied embeddings
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    # Qwen3: q/k norms, head_dim != hidden / heads as in the real Qwen3 sizes
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True),
    # Gemma: (1 + w) norms, scaled embeddings, GELU, tied embeddings
    "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=None),
}
IDS = (np.arange(24) * 37 + 5) % VOCAB


def _write_checkpoint(cfg, path: str) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # transformers initializes biases to 0 and norm weights to 1 (Gemma: 0): a lost
        for p in model.parameters():  # bias or a misread norm would go unseen
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    byte_tokenizer(VOCAB).save_pretrained(path)


def _torch_logits(path: str, ids) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))[None]).logits[0].numpy()


def _logits(model, ids) -> np.ndarray:
    out = model(hax.named(jnp.asarray(ids), "position"), attn_mask=AttentionMask.causal())
    return np.asarray(out.array, dtype=np.float32)


def _assert_close(actual, expected):
    bound = ULPS * EPS32 * float(np.abs(expected).max())
    err = float(np.abs(actual - expected).max())
    assert err <= bound, f"max |Δ| {err:.3g} > {bound:.3g} ({ULPS} ulps of the largest value)"


def _arrays(model):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint path, transformers' logits of IDS, the model loaded in float32)."""
    name = request.param
    path = str(tmp_path_factory.mktemp(name) / "hf")
    _write_checkpoint(FAMILIES[name](), path)
    return name, path, _torch_logits(path, IDS), load_hf_checkpoint(path)


def test_loaded_checkpoint_matches_pytorch(family):
    name, path, expected, model = family
    assert model.Vocab.size == VOCAB
    _assert_close(_logits(model, IDS), expected)
    # through a job's ModelConfig, tokenizer included
    cfg = ModelConfig(hf_checkpoint=path)
    assert [np.array_equal(a, b) for a, b in zip(_arrays(build_model(cfg)), _arrays(model))] == [True] * len(
        _arrays(model))
    assert len(build_tokenizer(cfg)) == VOCAB


def test_generation(family):
    """The scan sampler's logprobs of its own samples equal PyTorch's for the same sequences, in every
    family (through the server, as rollouts sample)."""
    name, path, _, model = family
    InferenceServer(InferenceServerConfig(serve_http=False), model, byte_tokenizer(VOCAB))  # accepted
    prompts = [list(IDS[:5]), list(IDS[3:12])]
    out = scan_sampler.sample(model, prompts, n=2, temperature=1.0, max_tokens=8, stop_sequences=[], seed=0)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    for row in range(len(prompts) * 2):
        prompt, n_new = prompts[row // 2], int(out.lengths[row])
        seq = np.array(prompt + list(out.tokens[row, :n_new]))
        with torch.no_grad():
            logp = torch.log_softmax(torch_model(torch.tensor(seq)[None]).logits[0], -1).numpy()
        expected = logp[np.arange(len(prompt) - 1, len(seq) - 1), seq[len(prompt):]]
        _assert_close(out.logprobs[row, :n_new], expected)
    # tensor parallel (2 KV heads over "model", rows over "data"): what one device samples, up to the
    # reassociated sums of intermediate = 128 terms (tests/test_sharded_rollout.py derives this bound)
    where = sharding.rollout_mesh(model, 2)
    split = scan_sampler.sample(sharding.place(model, where), prompts, n=2, temperature=1.0, max_tokens=8,
                                stop_sequences=[], seed=0, mesh=where.mesh)
    np.testing.assert_array_equal(split.tokens, out.tokens)
    bound = 4 * EPS32 * 128 * max(1.0, float(np.abs(out.logprobs).max()))
    assert float(np.abs(split.logprobs - out.logprobs).max()) <= bound


def test_a_family_the_sampler_cannot_run_is_one_clear_error():
    """Gemma 2 (attention and final soft-capping, post-norms, alternating windows) is not Gemma's
    decoder: refused when the server is built, naming the models the sampler runs."""
    from levanter.models.gemma import Gemma2Config, Gemma2LMHeadModel

    cfg = Gemma2Config(hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64)
    model = Gemma2LMHeadModel.init(hax.Axis("vocab", VOCAB), cfg, key=jax.random.PRNGKey(0))
    refusal = r"scan sampler runs .*GemmaLMHeadModel \(gemma\).*; got Gemma2LMHeadModel"
    with pytest.raises(NotImplementedError, match=refusal):
        InferenceServer(InferenceServerConfig(serve_http=False), model, byte_tokenizer(VOCAB))


def test_a_sliding_window_is_refused_past_its_length(tmp_path):
    """Mistral with a window: exact up to it (Levanter ignores the window, transformers applies it), so
    a call that could run past it is one clear error before any compile; within it, logprobs match."""
    path = str(tmp_path / "hf")
    _write_checkpoint(transformers.MistralConfig(**_COMMON, sliding_window=16), path)
    model = load_hf_checkpoint(path)
    too_long = r"prompt \(9 tokens\) \+ max_tokens \(8\) exceeds the model's sliding_window \(16\)"
    with pytest.raises(ValueError, match=too_long):
        scan_sampler.sample(model, [list(IDS[:5]), list(IDS[3:12])], n=1, temperature=1.0, max_tokens=8,
                            stop_sequences=[], seed=0)
    out = scan_sampler.sample(model, [list(IDS[3:12])], n=1, temperature=1.0, max_tokens=7, stop_sequences=[], seed=0)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    seq = np.array(list(IDS[3:12]) + list(out.tokens[0, :7]))
    with torch.no_grad():
        logp = torch.log_softmax(torch_model(torch.tensor(seq)[None]).logits[0], -1).numpy()
    _assert_close(out.logprobs[0, :7], logp[np.arange(8, 15), seq[9:]])


def _next_token_loss(model, ids):
    logits = model(hax.named(ids, "position"), attn_mask=AttentionMask.causal()).array.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[1:, None], axis=-1))


def test_train_step_export_and_reload(family, tmp_path):
    """One SGD step (gradient checkpointing on, the vanilla attention: both set over the family's defaults)
    changes the model; its export loads back bit for bit in marinrl and gives the trained model's logits in
    PyTorch."""
    name, path, _, _ = family
    model = load_hf_checkpoint(path, overrides={"gradient_checkpointing": True,
                                                "attn_backend": AttentionBackend.VANILLA})
    assert model.config.gradient_checkpointing is True
    assert model.config.attn_backend == AttentionBackend.VANILLA
    ids = jnp.asarray(IDS)
    opt = optax.sgd(1.0)
    params = eqx.filter(model, eqx.is_inexact_array)

    @eqx.filter_jit
    def step(model):
        loss, grads = eqx.filter_value_and_grad(_next_token_loss)(model, ids)
        updates, _ = opt.update(grads, opt.init(params))
        return loss, eqx.apply_updates(model, updates)

    loss, trained = step(model)
    assert float(_next_token_loss(trained, ids)) < float(loss)

    out = str(tmp_path / "exported")
    save_hf_checkpoint(trained, out, tokenizer=byte_tokenizer(VOCAB))
    original, exported = (json.load(open(os.path.join(p, "config.json"))) for p in (path, out))
    assert exported["model_type"] == original["model_type"]
    reloaded = load_hf_checkpoint(out)
    for a, b in zip(_arrays(reloaded), _arrays(trained), strict=True):
        np.testing.assert_array_equal(a, b)
    _assert_close(_torch_logits(out, IDS), _logits(trained, IDS))


def test_loads_onto_a_mesh_in_bfloat16(family):
    """bf16 weights read straight onto a 2 × 2 mesh, laid out by the axis mapping: every device holds a
    part of the model, and each weight is the float32 one rounded to bf16."""
    name, path, _, model32 = family
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    mapping = {"embed": "data", "mlp": "model", "heads": "model", "kv_heads": "model"}
    model = load_hf_checkpoint(path, dtype=jnp.bfloat16, axis_mapping=mapping, mesh=mesh)
    expected = hax.partitioning.infer_resource_partitions(model, mapping, mesh=mesh)
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    for leaf, expected_sharding in zip(leaves, jax.tree_util.tree_leaves(expected), strict=True):
        assert leaf.dtype == jnp.bfloat16
        assert leaf.sharding.is_equivalent_to(expected_sharding, leaf.ndim), (leaf.shape, leaf.sharding,
                                                                              expected_sharding)
    total = sum(x.nbytes for x in leaves)
    on_device0 = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == mesh.devices.flat[0])
    assert on_device0 < total / 2
    for a, b in zip(_arrays(model), _arrays(model32), strict=True):
        np.testing.assert_array_equal(a, b.astype(jnp.bfloat16))


def test_gradient_checkpointing_follows_the_model_config(family):
    name, path, _, _ = family
    for on in (True, False):
        cfg = ModelConfig(hf_checkpoint=path, model=LlamaConfig(gradient_checkpointing=on))
        assert build_model(cfg).config.gradient_checkpointing is on


# --------------------------------------------------------------------------- one family is enough


def test_loads_straight_from_gcs(tmp_path, gcs_root):
    import fsspec

    path = str(tmp_path / "hf")
    _write_checkpoint(FAMILIES["llama3"](), path)
    from marinrl.models.hf_checkpoints import hf_read_bytes

    fsspec.filesystem("gs", token="anon").put(path + "/", f"{gcs_root}/hf/", recursive=True)
    before = hf_read_bytes()
    loaded = load_hf_checkpoint(f"{gcs_root}/hf")
    assert hf_read_bytes() - before == os.path.getsize(os.path.join(path, "model.safetensors"))  # ranged GETs, once
    assert isinstance(loaded, LlamaLMHeadModel)
    _assert_close(_logits(loaded, IDS), _torch_logits(path, IDS))


def test_a_checkpoint_levanter_cannot_represent_is_one_clear_error(tmp_path):
    # Levanter's Gemma (v1) attention uses hidden / heads as its head size: gemma-7b's 256 != 3072 / 16
    cfg = transformers.GemmaConfig(**_COMMON, head_dim=32)
    cfg.save_pretrained(tmp_path / "gemma")
    with pytest.raises(ValueError,
                       match=r"gemma/config.json: head_dim is 32, .* hidden_size / num_attention_heads = 16"):
        load_hf_checkpoint(str(tmp_path / "gemma"))
    transformers.BertConfig(vocab_size=VOCAB).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError,
                       match=r"bert/config.json: model_type 'bert' has no Levanter model; supported: .*qwen2"):
        load_hf_checkpoint(str(tmp_path / "bert"))
    with pytest.raises(FileNotFoundError, match="not-there"):
        load_hf_checkpoint(str(tmp_path / "not-there"))


def test_range_reads_give_levanters_model_bitwise_and_one_process_reads_every_byte_once(family):
    """The row-range reader against Levanter's whole-file reader, on a 2 × 2 mesh with the mapping of a
    trainer (FSDP over "data", tensor parallel over "model"), in float32 and bf16: the same values, dtypes
    and shardings. One process holds every device, so it reads each file's bytes exactly once."""
    from factories import levanter_load_pretrained

    from marinrl.models.hf_checkpoints import hf_read_bytes

    name, path, _, _ = family
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    mapping = {"embed": "data", "mlp": "model", "heads": "model", "kv_heads": "model"}
    file_bytes = os.path.getsize(os.path.join(path, "model.safetensors"))
    for dtype in (jnp.float32, jnp.bfloat16):
        before = hf_read_bytes()
        ours = load_hf_checkpoint(path, dtype=dtype, axis_mapping=mapping, mesh=mesh)
        assert hf_read_bytes() - before == file_bytes
        theirs = levanter_load_pretrained(path, dtype, mapping, mesh)
        assert jax.tree.structure(ours) == jax.tree.structure(theirs)
        for a, b in zip(jax.tree.leaves(eqx.filter(ours, eqx.is_array)),
                        jax.tree.leaves(eqx.filter(theirs, eqx.is_array)), strict=True):
            assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
