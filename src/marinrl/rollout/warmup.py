"""Compile the rollout sampler before the policy's first weights arrive.

A rollout worker holds a model of the policy's shapes from its start, but used to compile its
sampler only once the trainer had published weight step 0: after the trainer's own startup, and
then twice in a row (the first full eval, greedy with one sample per prompt; then the first batch).
The sampler's compiled program depends on the shapes of a call (prompts, prompt length bucket,
samples per prompt, token budget bucket, stop sequences), never on the weights' values, so the worker
runs each lesson's environment once per kind of call it will make first (train batch, full eval,
micro eval) against a `DryRunContext`: the environment builds its real prompts, the server compiles
the program for their shapes and runs only the prefill, and every generation comes back empty.
The trainer's initialization runs meanwhile.

The environment sees one extra call per kind with a throwaway random generator (never the worker's);
an environment that fails on empty responses just warms less (its error is logged at INFO, never
counted). Environments that talk to the OpenAI endpoint get no endpoint from a dry context and are
skipped. `RolloutWorkerConfig.warm_up_sampler: false` turns this off (environments with side effects
per call).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from marinrl.inference.context import Generation, SamplingParams

logger = logging.getLogger(__name__)


class DryRunContext:
    """An InferenceContext whose `generate` compiles and prefills but generates nothing."""

    def __init__(self, server):
        self._server = server

    @property
    def tokenizer(self):
        return self._server.tokenizer

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams,
                 seed: int) -> list[list[Generation]]:
        return self._server.generate_dry(prompts, n, sampling, seed)

    def for_policy(self, policy: str) -> DryRunContext:
        """The dry run of `policy`'s model (several policy models: `marinrl/rollout/policy_router.py`)."""
        route = getattr(self._server, "for_policy", None)
        return self if route is None else DryRunContext(route(policy))


def warm_up_sampler(manager, calls: Sequence[tuple[str, int, int]]) -> dict[str, float]:
    """Run every lesson's environment once per (mode, n_examples, n_generations) in `calls` against a
    dry run of `manager`'s server, with the sampling settings the real call uses ("train": the lesson's;
    "eval": its eval settings). Returns seconds per "<lesson>/<mode>/<n_examples>x<n_generations>";
    a call that failed is logged and left out."""
    ctx = DryRunContext(manager.server)
    seconds: dict[str, float] = {}
    for lesson_id, runtime in manager.lessons.items():
        for mode, n_examples, n_generations in calls:
            sampling = runtime.sampling if mode == "train" else runtime.eval_params
            key = f"{lesson_id}/{mode}/{n_examples}x{n_generations}"
            started = time.perf_counter()
            try:
                manager.env(lesson_id).sample(ctx, n_examples, n_generations, sampling,
                                              np.random.default_rng(0), mode)
            except Exception as e:  # the real call reports real failures; this one only warms less
                logger.info("sampler warm-up of %s skipped: %s: %s", key, type(e).__name__, e)
                continue
            seconds[key] = time.perf_counter() - started
    return seconds
