"""`inference:` of a job config: how the rollout side serves its policy (docs/inference.md). The server is in
server.py, the engine in levanter_engine.py."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Union

from marinrl.config.checks import check_api_key, is_loopback, require_at_least
from marinrl.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizing of the Levanter engine. `None` means the platform's default: on CPU float32, page 64 and an
    explicit page budget (max_seqs full-length sequences); on TPU/GPU Levanter's bfloat16, page 128 and
    a page budget sized from free device memory."""

    max_seqs: int = 64
    """Concurrent sequences (samples) per engine call; larger requests are split into several calls."""
    max_seq_len: int = 512
    """Longest prompt + generated tokens of one sequence."""
    max_prefill_tokens: int = 2048
    """Prompt tokens prefilled together (the prefill buffer; prompts beyond it go to another call)."""
    max_rounds: int = 32
    """Decode steps per device loop before the host collects tokens."""
    max_stop_tokens: int = 4
    """Single-token stops (EOS included) the engine checks on device; more are matched on the host."""
    page_size: Optional[int] = None
    max_pages: Optional[int] = None
    compute_dtype: Optional[str] = None
    hbm_utilization: float = 0.5
    """Accelerators only: share of free device memory for the KV cache when max_pages is None."""

    def __post_init__(self):
        require_at_least(self, 1, "max_seqs", "max_seq_len", "max_prefill_tokens", "max_rounds", "max_stop_tokens")


ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")
"""What `inference.dtype` may name."""
ATTENTIONS = ("xla", "gpu_kernel")
"""What `inference.attention` may name."""


@dataclasses.dataclass(frozen=True)
class InferenceServerConfig:
    """How the rollout side serves its policy."""

    backend: Literal["scan", "engine"] = "scan"
    """What `generate` runs: our scan sampler (fast for rollout batches), or Levanter's engine."""
    serve_http: bool = False
    """Start the OpenAI-compatible endpoint. Off by default: rollouts need only `generate`, and a
    lesson whose environment talks HTTP turns it on (`envs.base.with_endpoint_if_needed`). A default
    of off also keeps a YAML override of any other `inference.*` field from starting it."""
    http_backend: Optional[Literal["scan", "engine"]] = None
    """What the endpoint runs; None: the same as `backend`. The scan sampler batches the requests that
    are queued together into one device call; Levanter's engine adds continuous batching (an
    accelerator's choice for ragged traffic), at 3-4x the CPU cost per token here."""
    host: str = "127.0.0.1"
    """Address the endpoint listens on. Anything but loopback (127.0.0.1, localhost, ::1), e.g. 0.0.0.0,
    lets other machines in, and then `api_key` must be set."""
    api_key: Optional[str] = dataclasses.field(default=None, repr=False)
    """The key every request to the endpoint must send as `Authorization: Bearer <key>` (`/health`
    excepted). None: a random key per server start, which in-process agents get from the server
    (`InferenceServer.api_key`) and no one else knows. Set it for agents outside the process, and for
    any non-loopback `host`; pass it on the command line (`--inference.api_key "$KEY"`) to keep it out
    of config files. Never logged."""
    port: int = 0
    """0: any free port (read it from `server.url`)."""
    model_name: str = "marinrl-policy"
    """The `model` the endpoint reports."""
    default_max_tokens: int = 256
    """HTTP requests without max_tokens get this budget."""
    http_min_batch: int = 8
    """Scan sampler behind the endpoint: a device call holds at least this many prompt rows (padding),
    so that batches of 1..8 queued requests share one compiled shape instead of four."""
    scan_max_cache_bytes: Union[int, Literal["auto"]] = "auto"
    """Scan sampler: KV-cache budget of one device call, per device; a `generate` call needing more is split
    into equal chunks (same samples either way). `auto`: on an accelerator 0.8 of what the device's allocator
    has left after the served weights (a shared GPU's `memory_fraction` included), on a CPU 1 GiB
    (`inference/scan_plan.py`). The sampler logs the split when it makes more than one call."""
    attention: str = "xla"
    """Scan sampler: how a decode step attends to the KV cache. `xla`: XLA ops over whole cache arrays, masked
    (`decoder.GroupedDecodeAttention`). `gpu_kernel`: a Pallas GPU kernel that reads only the slots holding
    tokens, skipping the prompts' left padding and finished rows (`inference/decode_kernel.py`); same tokens,
    logprobs within float32 rounding. Off a GPU, or for a head size the kernel cannot tile, `gpu_kernel` runs
    `xla` and says so in one log line (docs/inference.md, "The decode kernel")."""
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    """Levanter engine sizing (HTTP endpoint, and `generate` with backend='engine')."""
    dtype: Optional[str] = None
    """The rollout model's dtype: its weights, KV cache and the weights the trainer publishes (cast once
    on the trainer's side). None: the trainer's compute dtype (`trainer.mp`), so bfloat16 rollouts under
    `mp: p=f32,c=bfloat16` and float32 on the CPU quickstart. Resolved by `RLJobConfig.rollout_dtype()`.
    A server given a model in another dtype casts it once; the engine's `compute_dtype`, when unset,
    follows it. Logprobs come back float32 whatever it is (docs/inference.md, "Dtypes")."""
    lm_head_float32: bool = False
    """The sampler's LM head in float32: bfloat16 hidden state and head weights multiplied with float32 sums
    into float32 logits (exact products, no bfloat16 rounding of the logits), by the scan sampler and the
    engine alike. In a job it follows `model.lm_head_float32`, which sets the trainer's head too (a job that
    sets it here is refused: one side alone would widen the mismatch it exists to remove)."""
    model_axis_size: Optional[int] = None
    """Tensor parallelism of the rollout model: how many of this host's local devices share each
    weight matrix (whole KV heads and MLP columns per device); the remaining factor of the local
    device count splits generation rows. Must divide the local device count, num_kv_heads, num_heads
    and intermediate_dim. None: on TPU/GPU, 1 (every device samples its own rows with the whole model, no
    all-reduces) when the weights take at most a quarter of one device's memory, else all local devices (or the
    largest divisor that splits the model), as the dry run predicts (`inference/sharding.py`); on a CPU one
    device and no mesh (fake CPU devices share the same cores)."""

    def __post_init__(self):
        if self.backend not in ("scan", "engine"):
            raise ValueError(f"InferenceServerConfig.backend must be 'scan' or 'engine', got {self.backend!r}")
        if self.http_backend not in (None, "scan", "engine"):
            raise ValueError(
                f"InferenceServerConfig.http_backend must be None, 'scan' or 'engine', got {self.http_backend!r}")
        if self.http_min_batch < 1:
            raise ValueError(f"InferenceServerConfig.http_min_batch must be >= 1, got {self.http_min_batch}")
        if self.scan_max_cache_bytes != "auto" and (
                not isinstance(self.scan_max_cache_bytes, int) or self.scan_max_cache_bytes < 1):
            raise ValueError(f"inference.scan_max_cache_bytes must be 'auto' or an integer >= 1, "
                             f"got {self.scan_max_cache_bytes!r}")
        if self.attention not in ATTENTIONS:
            raise ConfigError("inference.attention", f"must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.dtype is not None and self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"inference.dtype must be one of {', '.join(ROLLOUT_DTYPES)} (or null: the trainer's "
                             f"compute dtype), got {self.dtype!r}")
        if self.model_axis_size is not None and self.model_axis_size < 1:
            raise ValueError(f"inference.model_axis_size must be >= 1 (or None: all local devices), "
                             f"got {self.model_axis_size}")
        if self.api_key is not None:
            check_api_key(self.api_key, "inference.api_key")
        elif not is_loopback(self.host):
            raise ValueError(
                f"inference.host is {self.host!r}, which other machines can reach, but inference.api_key is not set: "
                "set inference.api_key to a secret that your agents send as 'Authorization: Bearer <key>' "
                "(e.g. --inference.api_key \"$(openssl rand -hex 32)\"), or serve on inference.host: 127.0.0.1")
