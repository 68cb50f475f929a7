"""The estimated parts of a role's memory (`memory.predicted_memory`), from shapes: one trainer microbatch's layer
activations (`train_activation_bytes`) and LM-head buffers (`train_logits_bytes`), and one rollout step's working
set (`rollout_working_set_bytes`). The exact parts (weights, gradients, optimizer state, caches) are counted leaf
by leaf in memory.py; these are the formulas, each checked against XLA's buffer assignment (tests/test_dry_run.py,
tests/test_vocab_memory.py)."""

from __future__ import annotations

import numpy as np

from marinrl.config.trainer import parse_mp
from marinrl.dry_run.engine_cache import engine_sizing
from marinrl.dry_run.flops import ModelDims
from marinrl.levanter_configs import to_levanter
from marinrl.train.policy_forward import flash_block, lm_head_block


def microbatch_rows_per_device(job, mesh: dict) -> int:
    """Rows one device holds in one microbatch: `per_device_parallelism`, else (-1, an unresolved `auto`) its share
    of the batch."""
    if job.trainer.per_device_parallelism != "auto" and job.trainer.per_device_parallelism > 0:
        return job.trainer.per_device_parallelism
    return max(1, job.groups_per_step * job.n_generations // (mesh["data"] * mesh["replica"]))


def trainer_platform(job, cpu: bool = False) -> str:
    """The trainer placement's device kind ("cpu", "gpu", "tpu"; `cpu`: fake CPU devices)."""
    return "cpu" if cpu else job.ray.trainer.device[0]


def trainer_attention(job, cpu: bool = False) -> str:
    """The attention backend the trainer's model runs, by name (`config.model.attention_backend_on` for the
    trainer placement's device kind), Transformer Engine taken as installed where it is installed here
    (`attention_backend_here`). A Levanter `LmConfig` handed in by Python: its own `attn_backend` (None:
    Levanter's default)."""
    from marinrl.config.model import attention_backend_here

    return attention_backend_here(attention_setting(job.model.model), trainer_platform(job, cpu))


def attention_setting(architecture) -> str:
    """`attn_backend` of a marinrl architecture (`auto`, a backend's name) or of a Levanter `LmConfig` (its enum's
    name; None: `default`)."""
    value = getattr(architecture, "attn_backend", None)
    return value if isinstance(value, str) else getattr(value, "value", "default")


def train_activation_bytes(job, mesh: dict, length: int, cpu: bool = False) -> float:
    """One microbatch's layer activations per device, from shapes (an estimate). With gradient checkpointing
    each layer keeps its input (rows × length × hidden, compute dtype) and one layer's working set is live
    at a time (~16 × rows × length × max(hidden, intermediate/2): q/k/v, the MLP's hidden units and their
    gradients); without, every layer keeps its working set, and under an attention that materializes them
    (`config.model.keeps_attention_scores`) its scores and probabilities (rows × heads × length²);
    a flash attention holds one block of one layer's at a time instead (rows × heads × block², the block of
    `policy_forward.flash_block`). The LM head's share is `train_logits_bytes`."""
    from marinrl.config.model import keeps_attention_scores

    cfg = to_levanter(job.model.model)
    rows = microbatch_rows_per_device(job, mesh)
    compute = np.dtype(parse_mp(job.trainer.mp)["compute"]).itemsize
    working = 16 * rows * length * max(cfg.hidden_dim, cfg.intermediate_dim // 2) * compute / mesh["model"]
    checkpointing = bool(getattr(cfg, "gradient_checkpointing", False))
    if checkpointing:
        return float(rows * length * cfg.hidden_dim * compute * cfg.num_layers + working)
    if keeps_attention_scores(trainer_attention(job, cpu), trainer_platform(job, cpu), length):
        # every layer keeps its float32 scores and probabilities for the backward (an H200's measured peak,
        # 74.8 GiB for the 0.6B recipe's microbatch of 16 rows of 1024 under the vanilla attention, was 1.76x
        # the estimate without this term; 0.89x with it)
        scores = rows * cfg.num_heads * length * length * (4 + compute) / mesh["model"]
        return float((working + scores) * cfg.num_layers + working)
    blocks = rows * cfg.num_heads * flash_block(length) ** 2 * (4 + compute) / mesh["model"]
    return float(working * cfg.num_layers + working + blocks)


LOGITS_BLOCKS_LIVE = 3
"""Float32 `[tokens, block]` arrays the loss's backward holds at once (XLA:CPU's buffer assignment of the
train step's blockwise cross-entropy, one block or five): the recomputed logits, exp(logits − log Z), and
the gradient p − onehot (whose transposed copy for the head's gradient dot reuses the logits' buffer)."""


def train_logits_bytes(job, mesh: dict, length: int) -> dict:
    """The LM head's share of one microbatch's step per device, from shapes (an estimate), by component:

    - `logits`: `LOGITS_BLOCKS_LIVE` float32 blocks of rows × length × block (`policy_forward.lm_head_block`:
      32,768 columns by default, the whole vocabulary with `cross_entropy_block_size` = vocab), plus one
      float32 array of the remainder block when the vocabulary is not a multiple of the block (XLA places the
      remainder's buffers beside the loop's rather than in them).
    - `logits_compute_copy` (compute dtype narrower than float32, `trainer.mp: p=f32,c=bfloat16`): the head's
      matmul yields a block in the compute dtype before the float32 cast.
    - `lm_head_gradient`: the blockwise VJP's whole head gradient (vocab × hidden, compute dtype), filled block
      by block, held beside the parameter gradients until it joins them (and on FSDP before its
      reduce-scatter).

    Not counted: the entropy metric's pass (forward only, its blocks freed before the backward's; the
    compiled step's temporaries are the same with and without it)."""
    cfg = to_levanter(job.model.model)
    rows = microbatch_rows_per_device(job, mesh)
    vocab = job.model.vocab_size
    compute = np.dtype(parse_mp(job.trainer.mp)["compute"]).itemsize
    block = lm_head_block(getattr(cfg, "cross_entropy_block_size", None), vocab)
    full_blocks, rest = divmod(vocab, block)
    tokens = rows * length / mesh["model"]
    out = {"logits": tokens * 4 * (LOGITS_BLOCKS_LIVE * block + (rest if full_blocks > 1 and rest else 0))}
    if compute < 4:
        out["logits_compute_copy"] = tokens * block * compute
    out["lm_head_gradient"] = vocab * cfg.hidden_dim * compute / mesh["model"]
    return {k: float(v) for k, v in out.items()}


def rollout_working_set_bytes(job, model_axis_size: int, data_axis_size: int) -> float:
    """The larger of one engine prefill and one decode step, per device, from shapes (an estimate): the
    logits of every token in the step (compute dtype), the sampled rows' logits in float32 twice
    (softmax and log-softmax), and one layer's activations (hidden, q/k/v, the MLP's hidden units).
    For the scan sampler: one decode step of a call's rows."""
    dims = ModelDims.of(to_levanter(job.model.model), job.model.vocab_size)
    itemsize = np.dtype(job.inference.engine.compute_dtype or job.rollout_dtype()).itemsize
    vocab_shards = model_axis_size if dims.vocab % model_axis_size == 0 else 1

    def step(tokens: int, sampled: int) -> float:
        logits = tokens * dims.vocab * itemsize / vocab_shards
        sampled_logits = 2 * sampled * dims.vocab * 4 / vocab_shards
        layer = tokens * (2 * dims.hidden + (dims.q_dim + 2 * dims.kv_dim + 2 * dims.intermediate) / model_axis_size)
        return logits + sampled_logits + layer * itemsize

    if job.inference.backend == "engine":
        e = engine_sizing(job)
        decode = e.imputed_max_tokens_per_round
        return max(step(e.max_prefill_size, e.max_seqs_in_prefill), step(decode, decode))
    rows = max(1, job.groups_per_step // job.n_rollout_workers) * job.n_generations // data_axis_size
    return step(rows, rows)
