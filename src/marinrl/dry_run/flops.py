"""FLOPs of a job's steps from the model's shapes: pure functions, one rule for every recipe.

The rule (the MFU convention, written out so two recipes are comparable):
- a token's forward pass costs 2 FLOPs per matmul parameter (`ModelDims.matmul_params`: every layer's
  projections and the LM head; the embedding lookup is a gather, no FLOPs) plus attention: 2 × 2 ×
  layers × q_dim FLOPs per attended key (scores, then the weighted sum of values);
- a token at position i of a causal sequence attends to i keys (itself included): a sequence of L
  tokens attends to L(L+1)/2 keys in all, a decode step at context c to c keys;
- training costs 3 forward passes (forward, and twice that for the backward): the *model* FLOPs;
  gradient checkpointing recomputes each layer's forward during the backward, so the *executed* FLOPs
  add that many more forward passes of the layers (not of the LM head): `recomputed_forward_passes`.

What it leaves out: norms, rotary embeddings, softmax and the other elementwise work (well under 1% at
these widths), and the attention a packed row's block masks skip (a row counts as one causal sequence).
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The shapes that decide a Llama-family model's FLOPs and cache size."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    """The LM head is the embedding matrix (counted once in the parameters, used as a matmul)."""

    @classmethod
    def of(cls, model_config, vocab_size: int) -> ModelDims:
        head = (getattr(model_config, "actual_head_size", None) or getattr(model_config, "head_dim", None)
                or model_config.hidden_dim // model_config.num_heads)
        return cls(hidden=model_config.hidden_dim, intermediate=model_config.intermediate_dim,
                   layers=model_config.num_layers, heads=model_config.num_heads, kv_heads=model_config.num_kv_heads,
                   head_dim=head, vocab=vocab_size,
                   tied_embeddings=bool(getattr(model_config, "tie_word_embeddings", False)))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """One layer's projections: q, k, v, o and the gated MLP's three matrices."""
        return self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden + \
            3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies by: every layer's projections and the LM head."""
        return self.layers * self.layer_matmul_params + self.hidden * self.vocab

    def attention_flops(self, keys: float) -> float:
        """Forward attention FLOPs of all layers for `keys` attended (query, key) pairs."""
        return 4.0 * self.layers * self.q_dim * keys


def causal_keys(length: int) -> int:
    """(query, key) pairs of a causal sequence of `length` tokens: L(L+1)/2."""
    return length * (length + 1) // 2


def forward_flops(dims: ModelDims, tokens: int, keys: float, *, lm_head: bool = True) -> float:
    """One forward pass over `tokens` tokens attending to `keys` keys in all."""
    params = dims.matmul_params if lm_head else dims.layers * dims.layer_matmul_params
    return 2.0 * params * tokens + dims.attention_flops(keys)


def recomputed_forward_passes(gradient_checkpointing) -> int:
    """How many times the backward pass recomputes each layer's forward under a haliax checkpoint policy
    (`LlamaConfig.gradient_checkpointing`): True, "full", "recompute", "offload": once (the layer's input
    is kept, its inside recomputed); "nested": twice (the outer blocks, then their layers); False,
    "save_all": never. A `ScanCheckpointPolicy` object: by the same fields."""
    policy = gradient_checkpointing
    if policy is False or policy == "save_all":
        return 0
    if policy is True or policy in ("full", "recompute", "offload"):
        return 1
    if policy == "nested":
        return 2
    if hasattr(policy, "disable"):  # haliax ScanCheckpointPolicy
        if policy.disable or policy.save_block_internals is True:
            return 0
        return 2 if policy.nested else 1
    raise ValueError(f"model.model.gradient_checkpointing: unknown policy {policy!r}")


@dataclasses.dataclass(frozen=True)
class TrainFlops:
    """One optimizer step's FLOPs over the whole mesh."""

    model: float
    """3 forward passes of every row (6·N·T + 3 × attention): what MFU is computed from."""
    executed: float
    """`model` plus the layers' forward passes gradient checkpointing recomputes."""
    recompute: float
    """executed - model."""
    tokens: int


def train_flops(dims: ModelDims, rows: int, length: int, recompute_passes: int) -> TrainFlops:
    """The train step on `rows` rows of `length` tokens, each row one causal sequence."""
    tokens, keys = rows * length, rows * causal_keys(length)
    model = 3.0 * forward_flops(dims, tokens, keys)
    recompute = recompute_passes * forward_flops(dims, tokens, keys, lm_head=False)
    return TrainFlops(model=model, executed=model + recompute, recompute=recompute, tokens=tokens)


@dataclasses.dataclass(frozen=True)
class GenerationFlops:
    """A batch's generation FLOPs, every row generating `response` tokens (the budget: an upper bound)."""

    prefill: float
    """Each prompt once (its samples share its cache), causal over the prompt."""
    decode: float
    """Every decode step of every row: response - 1 forward passes of one token (the first token is
    sampled from the prefill's logits), the k-th attending to prompt + k keys."""
    prompt_tokens: int
    decode_tokens: int

    @property
    def total(self) -> float:
        return self.prefill + self.decode


def generation_flops(dims: ModelDims, prompts: int, samples: int, prompt: int, response: int) -> GenerationFlops:
    """`prompts` prompts of `prompt` tokens, `samples` rows each, `response` tokens per row."""
    steps = max(0, response - 1)
    prefill = prompts * forward_flops(dims, prompt, causal_keys(prompt))
    # decode step k = 1..steps processes the token at position prompt + k - 1: prompt + k keys
    keys_per_row = steps * prompt + causal_keys(steps)
    rows = prompts * samples
    decode = rows * forward_flops(dims, steps, keys_per_row)
    return GenerationFlops(prefill=prefill, decode=decode, prompt_tokens=prompts * prompt, decode_tokens=rows * steps)


CHIP_PEAK_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100": 312e12,
    "TPU v6 lite": 918e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v4": 275e12,
}
"""Dense bfloat16 peak FLOP/s of one chip, by the start of JAX's `device_kind` (vendors' data sheets: H100/H200
SXM 989 TFLOP/s without sparsity, A100 312; TPU v6e 918, v5e 197, v5p 459, v4 275). MFU divides by these."""


def chip_peak_flops(device_kind: str) -> Optional[float]:
    """The peak of the longest `CHIP_PEAK_FLOPS` name `device_kind` starts with (`NVIDIA H100 80GB HBM3` is an
    H100, `TPU v5 lite` a v5e, not a v5p); None for a chip not in the table (a CPU)."""
    names = [n for n in CHIP_PEAK_FLOPS if device_kind.startswith(n)]
    return CHIP_PEAK_FLOPS[max(names, key=len)] if names else None


CHIP_MEMORY_BANDWIDTH = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100": 3.35e12,
    "NVIDIA A100": 2.04e12,
    "TPU v6 lite": 1.64e12,
    "TPU v5 lite": 0.819e12,
    "TPU v5": 2.765e12,
    "TPU v4": 1.2e12,
}
"""Memory bandwidth (bytes/s) of one chip's HBM by the start of JAX's `device_kind`, from vendors' data sheets
(H200 SXM 4.8 TB/s, H100 SXM 3.35, A100 80GB 2.04; TPU v6e 1.64, v5e 0.819, v5p 2.765, v4 1.2). A decode step
of the scan sampler is bound by it: `scan_plan.decode_bytes_per_step` over this is its roofline."""
PLAN_DEVICES = {"h100": "NVIDIA H100", "h200": "NVIDIA H200", "a100": "NVIDIA A100", "v5p": "TPU v5",
                "v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v4": "TPU v4"}
"""Short names for `bench/generation.py --plan DEVICE`, to the `device_kind` prefixes above."""


def chip_memory_bandwidth(device_kind: str) -> Optional[float]:
    """The bandwidth of the longest `CHIP_MEMORY_BANDWIDTH` name `device_kind` starts with; None if none does."""
    names = [n for n in CHIP_MEMORY_BANDWIDTH if device_kind.startswith(n)]
    return CHIP_MEMORY_BANDWIDTH[max(names, key=len)] if names else None
