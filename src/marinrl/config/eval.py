"""`EvalConfig`: one offline evaluation of one checkpoint on some lessons (`marinrl eval`, docs/evaluation.md).
eval.py runs it."""

from __future__ import annotations

import dataclasses
from typing import Optional

from marinrl.config.curriculum import LessonConfig
from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """One evaluation of one checkpoint on some lessons."""

    checkpoint: str
    """A Levanter checkpoint (a `step-N` directory, or a folder of them: the latest is taken) or a
    Hugging Face checkpoint directory (config.json + safetensors); a local path or an fsspec URL."""
    lessons: tuple[LessonConfig, ...]
    """What to evaluate: each lesson's environment, token budget, stop strings and eval temperature."""
    n_examples: int = 32
    """Prompts per lesson."""
    samples: int = 1
    """Samples per prompt. 1: greedy unless `temperature` says otherwise. K > 1: pass@K, which needs
    a temperature > 0."""
    temperature: Optional[float] = None
    """Sampling temperature of every lesson; None: each lesson's `eval_temperature` (default 0: greedy)."""
    max_tokens: Optional[int] = None
    """Token budget of every lesson; None: each lesson's `max_tokens`."""
    pass_threshold: float = 1.0
    """A sample passes (for pass@1 and pass@K) when its reward is at least this; the built-in tasks
    score 0 or 1."""
    output: Optional[str] = None
    """Directory (local or fsspec URL) for metrics.json and rollouts/; None: write nothing."""
    batch_size: int = 64
    """Prompts per manager call: one progress-bar step and one rollout file."""
    seed: int = 0
    """Each lesson's prompts and samples are drawn from (seed, lesson_id): the same whichever other
    lessons run with it."""
    weight_step: Optional[int] = None
    """Weight step stamped on the rollouts; None: the checkpoint's (see `resolve_checkpoint`)."""
    model: Optional[ModelConfig] = None
    """Architecture (`model`, `vocab_size`) of a Levanter checkpoint without model_config.json (the
    Trainer's own), and the parameter `dtype`; its checkpoint fields are ignored. None: the checkpoint
    describes itself, float32."""
    tokenizer: Optional[str] = None
    """HF tokenizer directory. None: `model.tokenizer`, else the HF checkpoint's own tokenizer, else
    the byte-level tokenizer sized to the model's vocabulary."""
    inference: InferenceServerConfig = dataclasses.field(
        default_factory=InferenceServerConfig)
    """How the policy is served (`backend: engine` for models the scan sampler does not run); `dtype`
    loads and samples the checkpoint in that dtype (`bfloat16`, as a job's rollout workers at scale),
    over `model.dtype`."""
    progress: bool = True
    """Show a progress bar (on stderr)."""

    def __post_init__(self):
        if not self.lessons:
            raise ValueError("EvalConfig.lessons is empty: name lessons (--lessons) or a curriculum (--curriculum)")
        ids = [lesson.lesson_id for lesson in self.lessons]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"EvalConfig: duplicate lesson ids {dup}; give each its own id (ID=ENV:ARGS)")
        for name in ("n_examples", "samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"EvalConfig.temperature must be >= 0, got {self.temperature}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"EvalConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if self.weight_step is not None and self.weight_step < 0:
            raise ValueError(f"EvalConfig.weight_step must be >= 0, got {self.weight_step}")
        if self.samples > 1:
            for lesson in self.lessons:
                if self.temperature_of(lesson) == 0:
                    raise ValueError(
                        f"lesson {lesson.lesson_id!r}: samples={self.samples} at temperature 0 (greedy) are "
                        f"{self.samples} identical samples; give a temperature > 0 for pass@{self.samples}")

    def temperature_of(self, lesson: LessonConfig) -> float:
        return lesson.eval_temperature if self.temperature is None else self.temperature

    def max_tokens_of(self, lesson: LessonConfig) -> int:
        return lesson.max_tokens if self.max_tokens is None else self.max_tokens
