"""`model:` of a job config: where a policy comes from (from scratch, a Levanter checkpoint or a Hugging Face
checkpoint) and, from scratch, its architecture. Configs only: models/policy_model.py builds and loads the model.

The architecture is our own mirror of Levanter's `LlamaConfig` fields (`type: llama`), converted by
`levanter_configs.to_levanter` when a model is built, so a job config parses without importing
Levanter (docs/architecture.md, "Layers"). Other families come from a checkpoint's config.json; Python
callers may also hand Levanter's own `LmConfig` here, which is used as it is."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Union

import draccus

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
CHECKPOINT_POLICIES = ("offload", "recompute", "full", "nested", "save_all")
"""Levanter's gradient-checkpointing policies by name (haliax `ScanCheckpointPolicy.from_bool_or_str`)."""
ATTENTION_BACKENDS = ("auto", "default", "vanilla", "jax_flash", "nvte", "splash")
"""`attn_backend` values: `auto` (marinrl's choice per device, `attention_backend_on`) and Levanter's
`AttentionBackend` names."""
FLASH_MAX_BLOCK = 1024
"""The longest key block of Levanter's JAX flash attention (its default block, `flash_attention.BLOCK_SIZE`)."""


def attention_backend_on(value: str, platform: str, transformer_engine: bool) -> str:
    """The attention backend `attn_backend: value` runs on a `platform` device ("cpu", "gpu", "tpu"), by name.

    `auto` is Levanter's own default (Splash on a TPU, its JAX flash attention on a CPU, Transformer Engine on
    a GPU) except on a GPU without Transformer Engine installed, where Levanter's default falls back to the
    vanilla attention that keeps every layer's scores: an H200 measured the 0.6B recipe's update at a 74.8 GiB
    peak that way (docs/training.md, "Attention in the update"). There `auto` runs `jax_flash`, Levanter's
    flash attention in pure JAX, whose backward recomputes each block's scores instead of keeping them."""
    if value == "auto":
        if platform == "gpu":
            return "nvte" if transformer_engine else "jax_flash"
        return {"tpu": "splash"}.get(platform, "jax_flash")
    if value == "default":
        return {"gpu": "nvte" if transformer_engine else "vanilla", "tpu": "splash"}.get(platform, "jax_flash")
    return value


def attention_backend_here(value: str, platform: str) -> str:
    """`attention_backend_on` for a `platform` device of this Python environment (Transformer Engine installed or
    not here: found without importing it)."""
    import importlib.util

    return attention_backend_on(value, platform, importlib.util.find_spec("transformer_engine") is not None)


def keeps_attention_scores(backend: str, platform: str, length: int) -> bool:
    """Whether the update under `backend` (`attention_backend_on`'s name) keeps every layer's
    [rows, heads, length, length] scores for the backward at rows of `length`: the vanilla attention does, and so
    does the JAX flash attention on a CPU for a row shorter than one block (`train.policy_forward.with_flash_blocks`
    keeps Levanter's vanilla fallback there); the flash attentions keep each layer's output and log-sum-exp."""
    return backend == "vanilla" or (backend == "jax_flash" and platform == "cpu" and length < FLASH_MAX_BLOCK)


@dataclasses.dataclass(frozen=True)
class ArchitectureConfig(draccus.ChoiceRegistry):
    """A model architecture by `type:`; `LEVANTER` names the Levanter config class it becomes."""

    LEVANTER: ClassVar[str] = ""

    @classmethod
    def default_choice_name(cls) -> Optional[str]:
        return "llama"


@dataclasses.dataclass(frozen=True)
class RopeConfig(draccus.ChoiceRegistry):
    """Rotary position embeddings by `type:` (Levanter's `RotaryEmbeddingsConfig` choices)."""

    LEVANTER: ClassVar[str] = ""

    @classmethod
    def default_choice_name(cls) -> Optional[str]:
        return "default"


@RopeConfig.register_subclass("default")
@dataclasses.dataclass(frozen=True)
class DefaultRope(RopeConfig):
    LEVANTER: ClassVar[str] = "levanter.layers.rotary:DefaultRotaryEmbeddingsConfig"
    theta: float = 10000
    factor: float = 1.0


@RopeConfig.register_subclass("llama3")
@dataclasses.dataclass(frozen=True)
class Llama3Rope(RopeConfig):
    LEVANTER: ClassVar[str] = "levanter.layers.rotary:Llama3RotaryEmbeddingsConfig"
    theta: float = 500000
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@RopeConfig.register_subclass("yarn")
@dataclasses.dataclass(frozen=True)
class YarnRope(RopeConfig):
    LEVANTER: ClassVar[str] = "levanter.layers.rotary:YarnRotaryEmbeddingsConfig"
    theta: float = 10000
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 2048
    mscale: float = 1.0


@ArchitectureConfig.register_subclass("llama")
@dataclasses.dataclass(frozen=True)
class LlamaArchitecture(ArchitectureConfig):
    """Levanter's `LlamaConfig` (Llama 2/3 layout: RMSNorm, SwiGLU, rotary positions) with its defaults, so a
    YAML block means what it means to Levanter."""

    LEVANTER: ClassVar[str] = "levanter.models.llama:LlamaConfig"

    seq_len: int = 2048
    """Longest sequence the position axis holds."""
    hidden_dim: int = 4096
    """Width of the residual stream."""
    intermediate_dim: int = 11008
    """Width of the MLP."""
    num_layers: int = 32
    num_heads: int = 32
    """Query heads."""
    num_kv_heads: int = 32
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    head_dim: Optional[int] = None
    """None: hidden_dim / num_heads."""
    activation_function: str = "silu"
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    use_qk_norm: bool = False
    upcast_attn: bool = False
    use_bias: bool = False
    gradient_checkpointing: Union[bool, str] = True
    """Recompute each block's activations in the backward pass: true, false, a Levanter policy
    (`CHECKPOINT_POLICIES`), or `auto`: off where the trainer's predicted peak without it fits its device,
    else on (docs/training.md, "Gradient checkpointing and the microbatch")."""
    scan_layers: bool = True
    """One stacked block scanned over layers (faster compiles) instead of unrolled blocks (on CPU the update
    at the reference size is 1.35-1.4x faster unrolled, docs/performance.md)."""
    rope: RopeConfig = dataclasses.field(default_factory=DefaultRope)
    """Rotary positions: `{type: default, theta: …}`, `llama3` or `yarn` scaling."""
    attn_backend: str = "auto"
    """The attention of the model's full forward passes (the update, π_old, the reference; the sampler has its
    own, `inference.attention`): `auto`, or one of Levanter's backends (`ATTENTION_BACKENDS`). `auto` is a flash
    attention on every device kind (`attention_backend_on`); like `gradient_checkpointing` it applies to a
    checkpoint's model too."""

    def errors(self, field: str) -> Optional[tuple[str, str]]:
        """(field, problem) of the first bad value, or None."""
        for name in ("seq_len", "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                return f"{field}.{name}", f"must be >= 1, got {getattr(self, name)}"
        gc = self.gradient_checkpointing
        if not isinstance(gc, bool) and gc not in ("auto", *CHECKPOINT_POLICIES):
            return (f"{field}.gradient_checkpointing",
                    f"must be true, false, auto or one of {', '.join(CHECKPOINT_POLICIES)}, got {gc!r}")
        if self.attn_backend not in ATTENTION_BACKENDS:
            return (f"{field}.attn_backend",
                    f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attn_backend!r}")
        if self.num_heads % self.num_kv_heads:
            return f"{field}.num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}"
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            return (f"{field}.num_heads",
                    f"{self.num_heads} heads do not divide hidden_dim={self.hidden_dim} (or set head_dim)")
        return None


@ArchitectureConfig.register_subclass("qwen3")
@dataclasses.dataclass(frozen=True)
class Qwen3Architecture(LlamaArchitecture):
    """Levanter's `Qwen3Config`: Llama's fields (QK-norm through `use_qk_norm`) and a sliding window."""

    LEVANTER: ClassVar[str] = "levanter.models.qwen:Qwen3Config"
    use_sliding_window: bool = False
    sliding_window: int = 4096


def reference_llama() -> LlamaArchitecture:
    """The reference shape of docs/performance.md, unrolled and without recomputation (small models on CPU)."""
    return LlamaArchitecture(seq_len=256, hidden_dim=128, intermediate_dim=512, num_layers=4, num_heads=4,
                             num_kv_heads=4, gradient_checkpointing=False, scan_layers=False)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Where a policy comes from. With neither checkpoint set, the model is built from scratch."""

    model: ArchitectureConfig = dataclasses.field(default_factory=reference_llama)
    """The architecture of a model built from scratch (`type: llama`, its fields). For an HF checkpoint its
    config.json rules instead, except `gradient_checkpointing` and `attn_backend`, which are taken from here
    (Levanter-only knobs); for a Levanter checkpoint written by `save_levanter_checkpoint` its `model_config.json` does.
    Python may pass a Levanter `LmConfig` of any family."""
    vocab_size: int = 512
    """Size of the vocabulary axis of a model built from scratch (and of the byte-level tokenizer)."""
    seed: int = 0
    """PRNG seed of the from-scratch initialization."""
    init_std: Optional[float] = None
    """If set, every weight matrix is initialized N(0, init_std) instead of Levanter's fan-in scaled
    default (the reference shape of docs/performance.md uses 0.02); norms keep their ones, biases their zeros."""
    levanter_checkpoint: Optional[str] = None
    """Levanter checkpoint: a `step-N` directory or a run's checkpoint folder (latest step wins)."""
    hf_checkpoint: Optional[str] = None
    """Hugging Face checkpoint directory (config.json + safetensors), local or fsspec URL."""
    tokenizer: Optional[str] = None
    """HF tokenizer directory; None: the checkpoint's own tokenizer if it has one, else byte-level."""
    dtype: str = "float32"
    """Parameter dtype."""
    lm_head_float32: bool = False
    """Compute the LM head (final hidden state × output projection → logits) in float32 wherever this model's
    logprobs are taken: by the rollout sampler (both backends) and by the trainer (the loss, π_old and the
    reference), so that the two sides' logprobs of the same tokens stop differing by the rounding of
    bfloat16 logits, the largest known source of sampler/trainer mismatch. The weights keep their dtype
    (the head's bfloat16 weights are what both sides hold); the hidden state, the products' sums and the
    logits are float32. A no-op for a float32 model. In a job this one switch sets both sides
    (`inference.lm_head_float32` follows it); docs/training.md, "Sampler/trainer mismatch"."""

    def __post_init__(self):
        if self.levanter_checkpoint and self.hf_checkpoint:
            raise ValueError("ModelConfig: set at most one of levanter_checkpoint and hf_checkpoint")
        if self.vocab_size < 1:
            raise ValueError(f"ModelConfig.vocab_size must be >= 1, got {self.vocab_size}")
        if self.init_std is not None and not (0 < self.init_std < float("inf")):
            raise ValueError(f"ModelConfig.init_std must be finite and > 0 (or null), got {self.init_std}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"ModelConfig.dtype must be a float dtype ({', '.join(FLOAT_DTYPES)}), got {self.dtype!r}")
        if isinstance(self.model, ArchitectureConfig):
            bad = self.model.errors("model")
            if bad:
                raise ValueError(f"ModelConfig.{bad[0]}: {bad[1]}")
