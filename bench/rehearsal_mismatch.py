"""bench/rehearsal.py's mismatch phase: how far the rollout side's logprobs are from the trainer's on the same
tokens, with a bfloat16 LM head (the default) and with `model.lm_head_float32`, at the rehearsal's model size.

A phase of its own, in a process of its own, not a third job: the job's weights are those of the HF checkpoint
at every step that matters here (step 0, on-policy), so one process can play both sides with the job's own
parts: the rollout side is the job's `InferenceServer` (the recipe's backend, `inference.dtype`, the rollout
mesh of `inference.model_axis_size`) over the model loaded as a rollout worker loads it; the trainer side is
`token_logprobs` (the loss's forward) on the `TrainingBatch` the job's batching builds from those rollouts, over
the same weights in the trainer's compute dtype (`trainer.mp: p=f32,c=bfloat16` casts float32 masters read
from a bfloat16 checkpoint back to the same bfloat16 values; a float32 compute dtype upcasts them). For each
head: `groups` prompts × `generations` samples of `max_tokens` tokens at the lesson's temperature, then
`train/mismatch.py`'s metrics over every response token:

    d_t = log π_trainer(o_t) − log μ(o_t);  k3_kl = mean(e^d − d − 1);  abs_logprob_mean/max = mean/max |d|

It runs with `XLA_FLAGS=--xla_allow_excess_precision=false`: by default XLA:CPU computes a bfloat16 dot in
float32 and drops the rounding of its output to bfloat16 when a float32 cast follows, so on this CPU the
bfloat16 head is measured as exact as the float32 one (tests/test_lm_head_float32.py); with the flag every
bfloat16 result is rounded as the program says, as an accelerator's bfloat16 matmul output is. The job's own
per-step mismatch (`train/mismatch/*`, default precision) is reported beside it by the rehearsal.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

STRICT_PRECISION = "--xla_allow_excess_precision=false"
PROMPTS = ("What is 3 + 4?", "What is 12 - 5?", "What is 6 * 7?", "What is 9 + 16?", "What is 8 - 3?",
           "What is 2 * 11?", "What is 14 + 27?", "What is 30 - 12?")
"""Arithmetic prompts of the rehearsal's lesson's kind (difficulty 1, no chat template), cycled."""
METRICS = ("k3_kl", "abs_logprob_mean", "abs_logprob_max")


def measure(yaml_path: str, out_path: str, groups: int, generations: int, max_tokens: int,
            temperature: float) -> None:
    """The phase's process: both heads, one after the other, written to `out_path` as JSON."""
    import dataclasses

    import equinox as eqx
    import jax
    import numpy as np

    from marinrl.config.trainer import parse_mp
    from marinrl.inference.context import SamplingParams
    from marinrl.inference.served_model import load_served_model
    from marinrl.inference.server import InferenceServer
    from marinrl.models.policy_model import build_tokenizer
    from marinrl.recipe import parse_recipe
    from marinrl.train.batching import make_training_batch
    from marinrl.train.mismatch import mismatch_metrics
    from marinrl.train.policy_forward import token_logprobs
    from marinrl.types import Rollout, RolloutMetadata

    started = time.time()
    job = parse_recipe(pathlib.Path(yaml_path).read_text(), [])
    inference = dataclasses.replace(job.inference, dtype=job.rollout_dtype(), serve_http=False)
    tokenizer = build_tokenizer(job.model)
    model = load_served_model(job.model, inference, dtype=job.rollout_dtype())
    compute = parse_mp(job.trainer.mp)["compute"]
    trainer_model = jax.tree.map(lambda x: x.astype(compute) if eqx.is_inexact_array(x) else x, model)
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(groups)]
    forward = eqx.filter_jit(token_logprobs)
    out: dict = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "backend": inference.backend,
                 "rollout_dtype": job.rollout_dtype(), "trainer_compute_dtype": compute,
                 "rows": groups * generations, "max_tokens": max_tokens, "temperature": temperature}
    for name, f32 in (("bf16_head", False), ("f32_head", True)):
        t = time.time()
        config = dataclasses.replace(inference, lm_head_float32=f32)
        with InferenceServer(config, model, tokenizer) as server:
            gens = server.generate(prompts, generations, SamplingParams(max_tokens=max_tokens,
                                                                         temperature=temperature), seed=0)
        rollouts = [Rollout(prompt_tokens=np.asarray(p), response_tokens=g.tokens, response_logprobs=g.logprobs,
                            temperature=temperature, loss_mask=np.ones(len(g.tokens), np.float32),
                            token_rewards=np.zeros(len(g.tokens), np.float32), episode_reward=0.0,
                            finish_reason=g.finish_reason, env_name="arithmetic", lesson_id="arithmetic",
                            group_id=str(i), metadata=RolloutMetadata("mismatch", 0, 0.0))
                    for i, (p, row) in enumerate(zip(prompts, gens)) for g in row]
        batch = make_training_batch(rollouts, [0.0] * len(rollouts), batch_size=len(rollouts), config=job.batching)
        logp = forward(trainer_model, batch, lm_head_float32=f32)
        metrics = mismatch_metrics(logp, batch.sampler_logprobs, batch.loss_mask, tis_cap=2.0, mis_low=0.5,
                                   mis_high=2.0)
        out[name] = {k: float(metrics[f"mismatch/{k}"]) for k in METRICS}
        out[name]["tokens"] = int(np.asarray(batch.loss_mask.array).sum())
        out[name]["seconds"] = round(time.time() - t, 1)
    out["seconds"] = round(time.time() - started, 1)
    pathlib.Path(out_path).write_text(json.dumps(out))


def run_phase(root: pathlib.Path, groups: int, generations: int, max_tokens: int, temperature: float,
              timeout_s: float, env: dict | None = None) -> dict:
    """The phase in a child process with strict precision (module doc); its result, also in root/mismatch.json."""
    bench = pathlib.Path(__file__).resolve().parent
    out = root / "mismatch.json"
    log = root / "mismatch.log"
    env = dict(env if env is not None else os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {STRICT_PRECISION}".strip()
    code = (f"import sys; sys.path.insert(0, {str(bench)!r}); import rehearsal_mismatch as m; "
            f"m.measure({str(root / 'job.yaml')!r}, {str(out)!r}, {groups}, {generations}, {max_tokens}, "
            f"{temperature})")
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout_s)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the mismatch phase exited {proc.returncode}; its log {log} ends:\n"
                           f"{log.read_text()[-4000:]}")
    return json.loads(out.read_text())
