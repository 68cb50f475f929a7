"""On-policy means π_θ/μ = 1: real generation at the weights the trainer publishes, then the trainer's
first update on those rollouts must see an importance ratio r = exp(log π_θ − log μ) of 1, to float32
precision, on every response token (and its mismatch metrics only rounding); sampled in bfloat16, more.

Everything is real: the TrainWorker (Levanter's Trainer on 4 fake CPU devices) publishes its initial
weights w through the filesystem weight transfer; a sampler thread plays the rollout worker — it
receives w, loads it into an InferenceServer (the scan sampler) that started with other weights, and
has a RolloutManager run a single-turn environment at temperature 1.0 and 0.7 (several prompts of
varied lengths, 4 generations each, stop tokens so responses have varied lengths); the batches go
through Parquet files and the on-policy replay buffer into one `TrainingBatch` (padding, masks and
per-row temperatures) and one update with the sampler-anchored loss (r = π_θ/μ).

Two views of the same ratio: the trainer's own `train/ratio_min` / `train/ratio_max` (the loss's
min and max of r over trained tokens, from Levanter's JSON tracker), and per token, `token_logprobs` —
the forward the loss runs — on the `TrainingBatch` the worker's code builds from the same rollouts,
so that a failure names the row, the token and the temperature.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import threading
import uuid

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.checkpoint import CheckpointerConfig
from levanter.layers.attention import AttentionMask
from levanter.models.llama import LlamaConfig
from levanter.tracker.json_logger import JsonLoggerConfig

from marinrl.config.batching import BatchingConfig
from marinrl.config.loss import LossConfig
from marinrl.config.model import ModelConfig
from marinrl.config.replay import OnPolicyConfig, ReplayConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.config.train_worker import TrainWorkerConfig
from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.envs.base import Grade, Problem, SingleTurnEnv
from marinrl.inference.context import SamplingParams
from marinrl.inference.server import InferenceServer
from marinrl.job.plan import build_trainer
from marinrl.levanter_configs import cpu_trainer_config
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.rollout.manager import LessonRuntime, RolloutManager
from marinrl.storage.rollouts import RolloutWriter
from marinrl.train.batching import make_training_batch
from marinrl.train.losses import token_logprobs
from marinrl.train.mismatch import mismatch_metrics
from marinrl.train.worker import TrainWorker
from marinrl.transfer.endpoints import build_client
from marinrl.types import Rollout

EPS32 = float(np.finfo(np.float32).eps)
VOCAB = 512  # the byte tokenizer needs 256 bytes + specials
ARCH = LlamaConfig(seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   gradient_checkpointing=False)  # the tiny Llama of conftest's `tiny_server`
MODEL = ModelConfig(model=ARCH, vocab_size=VOCAB, seed=0)
STALE = dataclasses.replace(MODEL, seed=1)
"""What the inference server holds before the trainer's weights arrive (a rollout worker's own init)."""
TEMPERATURES = {"t1": 1.0, "t07": 0.7}
"""Lesson -> sampling temperature: T = 1 and T ≠ 1, where μ is the temperature-scaled distribution."""
PROMPTS, GENERATIONS = 3, 4
MAX_TOKENS = 12
STOPS = tuple((t,) for t in range(0, VOCAB, 16))
"""32 single-token stop sequences: ~6% of a near-uniform random model's mass, so that about half the
responses stop early (finish_reason "stop") and the rest run out of budget ("length")."""
DEADLINE_S = 180.0  # generous waits for a loaded machine; only a failure ever waits that long


class VariedPromptsEnv(SingleTurnEnv):
    """Random lowercase prompts of 1..10 letters (3..12 tokens with BOS and '='); the reward (parity of
    the response's length) only gives each group some spread — the ratio does not depend on it."""

    env_name = "varied_prompts"

    def problems(self, n, rng, mode):
        words = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(1, 11))) for _ in range(n)]
        return [Problem(prompt=f"{w}=", answer="", example_id=w) for w in words]

    def grade(self, problem, response):
        return Grade(reward=float(len(response) % 2))


LESSONS = {
    lesson: LessonRuntime(make_env=VariedPromptsEnv, env_name="varied_prompts",
                          sampling=SamplingParams(temperature=t, max_tokens=MAX_TOKENS, stop_sequences=STOPS))
    for lesson, t in TEMPERATURES.items()
}


class RolloutSide(threading.Thread):
    """The rollout worker's part: waits for the trainer's weight step 0, serves it through the scan
    sampler and writes one batch per lesson stamped with it. Keeps what it did for the test."""

    def __init__(self, weights: FilesystemTransferConfig, rollout_root: str):
        super().__init__(daemon=True)
        self.weights_config = weights
        self.rollout_root = rollout_root
        self.weights = None  # the model the sampler generated with
        self.rollouts: list[Rollout] = []
        self.error: BaseException | None = None

    def run(self):
        try:
            client = build_client(self.weights_config, build_model(STALE))
            update = client.wait_for(0, timeout_s=DEADLINE_S)
            server = InferenceServer(InferenceServerConfig(serve_http=False), build_model(STALE), byte_tokenizer(VOCAB))
            with server:
                manager = RolloutManager(server, LESSONS)
                manager.update_model(update.model, update.weight_step)
                writer = RolloutWriter(self.rollout_root)
                for k, lesson in enumerate(LESSONS):
                    batch, metrics = manager.sample_batch(lesson, PROMPTS, GENERATIONS, "train",
                                                          np.random.default_rng(k), update.weight_step, "sampler")
                    assert batch is not None, f"lesson {lesson} produced no rollouts: {metrics}"
                    writer.write(batch)
                    self.rollouts += [r for g in batch.groups for r in g.rollouts]
                self.weights = update.model
        except BaseException as e:  # re-raised by the test
            self.error = e


class MetricsLog(logging.Handler):
    """Levanter's JSON tracker lines of one logger, as {step: metrics}."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.steps: dict[int, dict] = {}

    def emit(self, record):
        entry = json.loads(record.getMessage())
        if entry.get("event") == "log" and entry.get("step") is not None:
            self.steps.setdefault(entry["step"], {}).update(entry["metrics"])


def logprob_error_bound(model, batch) -> jax.Array:
    """Per position, a bound on |log π_θ − log μ| when both are the same weights' float32 logprobs.

    Both sides compute log softmax(z)[o] with z_v = (h · W_v) / T, h the final hidden state: the
    sampler decoding with a KV cache, the trainer with one causal forward and Levanter's blockwise
    cross-entropy. Same math, summed in different orders, so the two differ only by rounding:

    - A float32 dot product of n terms is off by about sqrt(n) · eps32 times the sum of its terms'
      magnitudes (n · eps32 at worst); here n ≤ hidden_dim = 64, so ~8 eps32 relative per stage.
    - The stages are each of the num_layers layers, the final norm and the head: num_layers + 2.
      Each adds its rounding to h relative to h's magnitude, and each program rounds on its own, so
      the two can differ by twice that: c = 2 · 8 · (num_layers + 2) = 16 (num_layers + 2).
    - So each logit differs by at most c · eps32 · A_t, A_t = max_v Σ_k |h_k| |W_kv| / T (the logits'
      magnitude scale at position t; dividing by T < 1 scales errors and logits alike).
    - log softmax(z)[o] = z_o − logsumexp(z) moves by at most |Δz_o| + max_v |Δz_v| ≤ 2 c eps32 A_t,
      plus its own rounding, a few eps32 of |log μ_t| (4 here).

    Measured (A_t ≈ 6, log μ in [-9, -2]): the largest |log π_θ − log μ| is 3e-6, about 1/50 of the
    bound (1e-4 at T = 1, 1.7e-4 at T = 0.7). Weights off by a relative 1e-4 move it by up to 2e-3;
    a wrong temperature, or targets shifted by one position, by up to 1 and 5.
    """
    h = model.activations(batch.input_ids, AttentionMask.causal())
    if isinstance(h, tuple):
        h = h[0]
    w = model.get_lm_head()
    mass = hax.dot(hax.abs(h), hax.abs(w), axis=model.Embed)  # [batch, position, vocab]: Σ_k |h_k| |W_kv|
    scale = hax.max(mass, axis=model.Vocab) / batch.temperature
    c = 16.0 * (model.config.num_layers + 2)
    return 2.0 * c * EPS32 * scale.array + 4.0 * EPS32 * jnp.abs(batch.sampler_logprobs.array)


@eqx.filter_jit
def _forward_and_bound(model, batch):
    return token_logprobs(model, batch).array, logprob_error_bound(model, batch)


def test_first_on_policy_update_has_ratio_one_on_every_token(tmp_path: pathlib.Path):
    rows = len(TEMPERATURES) * PROMPTS * GENERATIONS
    tracker = f"marinrl.tests.on_policy_ratio.{uuid.uuid4().hex[:8]}"
    cfg = TrainWorkerConfig(
        rollout_root=str(tmp_path / "rollouts"),
        weights=FilesystemTransferConfig(root=str(tmp_path / "weights")),
        model=MODEL,
        trainer=cpu_trainer_config(num_train_steps=1, train_batch_size=rows, id="ratio", log_dir=tmp_path / "logs",
                                   tracker=JsonLoggerConfig(logger_name=tracker),
                                   checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt"))),
        loss=LossConfig(ratio_anchor="sampler"),  # r = π_θ/μ from the stored sampler logprobs
        replay=ReplayConfig(sampling=OnPolicyConfig(), timeout_s=DEADLINE_S, poll_interval_s=0.05),
        batching=BatchingConfig(max_length=64, min_bucket=16),
        groups_per_step=len(TEMPERATURES) * PROMPTS,
    )
    log = MetricsLog()
    logging.getLogger(tracker).addHandler(log)
    rollout_side = RolloutSide(cfg.weights, cfg.rollout_root)
    rollout_side.start()
    try:
        result = TrainWorker(cfg, build_trainer(cfg)).run()
    except Exception as e:
        rollout_side.join(DEADLINE_S)
        if rollout_side.error is not None:
            raise rollout_side.error from e
        raise
    finally:
        logging.getLogger(tracker).removeHandler(log)
    rollout_side.join(DEADLINE_S)
    if rollout_side.error is not None:
        raise rollout_side.error
    rollouts = rollout_side.rollouts

    # Premises: one update, on exactly these rollouts; both temperatures; prompts and responses of
    # varied lengths, some stopped by a stop token and some by the budget (padding and masks matter).
    assert (result.first_step, result.final_step) == (0, 1)
    assert sorted(result.trained_groups[0]) == sorted({r.group_id for r in rollouts})
    assert len(rollouts) == rows
    assert {r.temperature for r in rollouts} == set(TEMPERATURES.values())
    assert len({r.prompt_tokens.size for r in rollouts}) >= 3, [r.prompt_tokens.size for r in rollouts]
    for t in TEMPERATURES.values():
        of_t = [r for r in rollouts if r.temperature == t]
        assert {r.finish_reason for r in of_t} == {"stop", "length"}, f"T={t}: {[r.finish_reason for r in of_t]}"
        assert len({r.response_tokens.size for r in of_t}) >= 3, f"T={t}: {[r.response_tokens.size for r in of_t]}"
    n_tokens = sum(r.response_tokens.size for r in rollouts)

    # Per token: the loss's forward at w on the batch the worker builds from these rollouts.
    batch = make_training_batch(rollouts, [0.0] * rows, batch_size=rows, config=cfg.batching)
    mask = np.asarray(batch.loss_mask.array) > 0
    assert mask.sum() == n_tokens, "every response token, and nothing else, is trained"
    logp, bound = map(np.asarray, _forward_and_bound(rollout_side.weights, batch))
    mu = np.asarray(batch.sampler_logprobs.array)
    temperature = np.asarray(batch.temperature.array)
    ratio_error = np.abs(np.expm1(logp.astype(np.float64) - mu))
    allowed = np.expm1(bound.astype(np.float64)) + EPS32  # the ratio's own exp rounding: one eps32
    bad = np.argwhere(mask & ~(ratio_error <= allowed))
    problems = []
    if len(bad):
        problems.append("π_θ/μ ≠ 1 at (row, position, T, log π_θ, log μ, |r-1|, bound): " + "; ".join(
            f"({i}, {t}, {temperature[i]:g}, {logp[i, t]:.6f}, {mu[i, t]:.6f}, {ratio_error[i, t]:.2e}, "
            f"{allowed[i, t]:.2e})" for i, t in bad[:6]) + f" ({len(bad)} of {n_tokens} tokens)")

    # The trainer's own update: min and max of r over the tokens it trained, from its tracker.
    train = log.steps[0]
    assert train["train/num_tokens"] == n_tokens, "the update trains every response token, and nothing else"
    worst = max(train["train/ratio_max"] - 1.0, 1.0 - train["train/ratio_min"])
    if not worst <= allowed[mask].max():
        low, high = train["train/ratio_min"], train["train/ratio_max"]
        problems.append(f"the first update's π_θ/μ is in [{low!r}, {high!r}]: |r-1| up to {worst:.2e} > bound "
                        f"{allowed[mask].max():.2e}")

    # The same update's mismatch metrics (train/mismatch/*): trainer and sampler both float32 at the same
    # weights, on-policy, so they measure rounding only: |d| within the per-token bound, k3 within
    # e^b − b − 1 of the largest bound b, and no token that TIS would clip or MIS mask.
    b = float(bound[mask].max())
    got = {k[len("train/mismatch/"):]: v for k, v in train.items() if k.startswith("train/mismatch/")}
    if not (got["abs_logprob_max"] <= b and got["abs_logprob_mean"] <= b and 0 <= got["k3_kl"] <= np.expm1(b) - b
            and got["tis_clipped_frac"] == 0 and got["mis_masked_frac"] == 0):
        problems.append(f"on-policy float32 mismatch beyond rounding (bound {b:.2e}): {got}")
    assert not problems, "\n".join(problems)


@eqx.filter_jit
def _mismatch_and_bound(model, batch):
    metrics = mismatch_metrics(token_logprobs(model, batch), batch.sampler_logprobs, batch.loss_mask,
                               tis_cap=2.0, mis_low=0.5, mis_high=2.0)
    return metrics, logprob_error_bound(model, batch)


def test_bf16_sampling_is_off_the_f32_trainer_by_more_than_rounding():
    """The same weights served with `inference.dtype: bfloat16` (weights and KV cache in bf16): the mismatch
    the trainer's float32 forward measures on those rollouts is larger than float32 rounding can make it
    (the bound of the test above, at its largest over the batch), on average over the tokens."""
    model = build_model(MODEL)
    server = InferenceServer(InferenceServerConfig(dtype="bfloat16"), model, byte_tokenizer(VOCAB))
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(server.model, eqx.is_inexact_array))} == {jnp.dtype("bfloat16")}
    rollouts = []
    with server:
        manager = RolloutManager(server, LESSONS)
        for k, lesson in enumerate(LESSONS):
            batch, metrics = manager.sample_batch(lesson, PROMPTS, GENERATIONS, "train", np.random.default_rng(k), 0,
                                                  "sampler")
            assert batch is not None, metrics
            rollouts += [r for g in batch.groups for r in g.rollouts]
    batch = make_training_batch(rollouts, [0.0] * len(rollouts), batch_size=len(rollouts),
                                config=BatchingConfig(max_length=64, min_bucket=16))
    metrics, bound = _mismatch_and_bound(model, batch)
    metrics = {k: float(v) for k, v in metrics.items()}
    b = float(np.asarray(bound)[np.asarray(batch.loss_mask.array) > 0].max())
    assert metrics["mismatch/abs_logprob_mean"] > b, (metrics, b)
    assert metrics["mismatch/abs_logprob_max"] >= metrics["mismatch/abs_logprob_mean"] and metrics["mismatch/k3_kl"] > 0
