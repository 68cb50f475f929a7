"""`ServeConfig`: one checkpoint served over HTTP (`marinrl serve`, docs/inference.md). serve.py runs it."""

from __future__ import annotations

import dataclasses
from typing import Optional

from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """A saved policy behind the OpenAI-compatible endpoint and the token endpoint, until interrupted."""

    checkpoint: str
    """A Levanter checkpoint (a `step-N` directory, or a folder of them: the latest is served) or a Hugging
    Face checkpoint directory (config.json + safetensors); a local path or an fsspec URL."""
    inference: InferenceServerConfig = dataclasses.field(
        default_factory=lambda: InferenceServerConfig(serve_http=True))
    """How it is served, as a job's rollout workers serve their policy: the bind address (`host`, `port`),
    the API key (`api_key`; None: a random one, printed once at start), the `model_name` the endpoint
    reports, the backend (`engine` for models the scan sampler does not run) and the `dtype`. The
    endpoint is always on (`serve_http`)."""
    model: Optional[ModelConfig] = None
    """Architecture of a Levanter checkpoint without model_config.json (the Trainer's own), and the
    parameter `dtype`; its checkpoint fields are ignored. None: the checkpoint describes itself."""
    tokenizer: Optional[str] = None
    """HF tokenizer directory. None: `model.tokenizer`, else the HF checkpoint's own tokenizer, else the
    byte-level tokenizer sized to the model's vocabulary."""
    weight_step: Optional[int] = None
    """The weight step the endpoint reports on every token (`weight_steps`); None: the checkpoint's."""

    def __post_init__(self):
        if not self.inference.serve_http:
            object.__setattr__(self, "inference", dataclasses.replace(self.inference, serve_http=True))
        if self.weight_step is not None and self.weight_step < 0:
            raise ValueError(f"ServeConfig.weight_step must be >= 0, got {self.weight_step}")
