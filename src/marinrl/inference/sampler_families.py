"""The Levanter models the scan sampler runs, and each one's differences from Llama's decoder.

The sampler (`sampler.py`) re-implements only the cached attention and calls the model's own modules
for everything else (embedding, norms, rotary embeddings, QK norms, activation, LM head), so a family
runs exactly when its decoder is Llama's structure up to those modules. What differs is listed here,
per model class, and handled explicitly; any other class (a subclass included, e.g. Gemma 2 with its
soft-capping and post-norms) is refused rather than run with a silent mismatch:

- Llama 3 / Qwen3: the reference (Qwen3's q/k norms are the attention module's own).
- Qwen2: biases on q/k/v (and on the MLP when `no_bias` is false): the packed projections carry them.
- Gemma (v1): its norm computes x * (1 + w) in float32 (the layer's own `GemmaRMSNorm`), GeLU-tanh MLP
  (the MLP's own activation), tied head (`get_lm_head`), head size hidden / heads (the loader refuses
  others), and the embedding multiplied by sqrt(hidden) in the activation dtype: `embed_scale`.
- Mistral: Llama's decoder, plus `sliding_window`; Levanter's training forward ignores the window while
  transformers applies it, so the two agree only on sequences no longer than the window, and the
  sampler refuses a call that could exceed it (`attention_window`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from levanter.models.gemma import GemmaDecoderLayer, GemmaLMHeadModel
from levanter.models.llama import LlamaDecoderLayer, LlamaLMHeadModel
from levanter.models.mistral import MistralLMHeadModel
from levanter.models.qwen import Qwen3LMHeadModel, QwenDecoderLayer, QwenLMHeadModel


@dataclasses.dataclass(frozen=True)
class SamplerFamily:
    """How the sampler runs one Levanter model class."""

    name: str
    """The Hugging Face `model_type` of the family."""
    layer_type: type
    """The decoder layer class the model must hold (input norm, attention, post-attention norm, MLP)."""
    embed_scale: bool = False
    """Multiply token embeddings by sqrt(hidden) (Gemma), in the embeddings' dtype as Levanter does."""


SAMPLER_FAMILIES: dict[type, SamplerFamily] = {
    LlamaLMHeadModel: SamplerFamily("llama", LlamaDecoderLayer),
    Qwen3LMHeadModel: SamplerFamily("qwen3", LlamaDecoderLayer),
    QwenLMHeadModel: SamplerFamily("qwen2", QwenDecoderLayer),
    GemmaLMHeadModel: SamplerFamily("gemma", GemmaDecoderLayer, embed_scale=True),
    MistralLMHeadModel: SamplerFamily("mistral", LlamaDecoderLayer),
}


def sampler_family(model) -> SamplerFamily:
    """The family of `model`, or NotImplementedError naming the model classes the sampler runs."""
    family = SAMPLER_FAMILIES.get(type(model))
    if family is None:
        names = ", ".join(f"{c.__name__} ({f.name})" for c, f in SAMPLER_FAMILIES.items())
        raise NotImplementedError(f"the scan sampler runs {names}; got {type(model).__name__}, which it cannot "
                                  "sample exactly")
    layers = model.transformer.layers
    # Stacked holds one module with stacked weights, BlockSeq a list (scan_layers=False): no copy either way
    layer = layers.stacked if hasattr(layers, "stacked") else layers.blocks[0]
    if type(layer) is not family.layer_type:
        raise NotImplementedError(f"the scan sampler expects {family.layer_type.__name__} layers in "
                                  f"{type(model).__name__}, got {type(layer).__name__}")
    return family


def attention_window(config) -> Optional[int]:
    """The sliding window transformers applies to this model, or None. Qwen's window is used only with
    `use_sliding_window`; Mistral's whenever it is set."""
    if not getattr(config, "use_sliding_window", True):
        return None
    return getattr(config, "sliding_window", None)


def check_window(model, longest_prompt: int, max_tokens: int) -> None:
    """ValueError if a row of this call (prompt + generated tokens) could be longer than the model's
    sliding window: there Levanter's forward (no window) and the checkpoint's own (windowed) differ."""
    window = attention_window(model.config)
    if window is not None and longest_prompt + max_tokens > window:
        raise ValueError(
            f"prompt ({longest_prompt} tokens) + max_tokens ({max_tokens}) exceeds the model's sliding_window "
            f"({window}): the scan sampler and Levanter attend without a window, so it would not be this model")

