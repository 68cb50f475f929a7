"""Rollouts → fixed-shape `TrainingBatch` of named arrays, several rollouts per row.

Layout. A row holds *blocks* back to back (packing.py decides which): a block is one prompt followed by one
or more responses that continue it. Under the default `shared` layout a group's rollouts form one block, so
the group's prompt is computed once; under `packed` each rollout is its own block; `padded` is the old
layout (one rollout per row, every row as long as the longest), kept as the benchmark's reference. Each
token carries `segment_ids` (its block within the row; -1 on padding), `response_ids` (0 on the prompt, j
on the block's j-th response) and `position_ids` (restarting at 0 in every block; every response continues
from the prompt's length). Attention is causal, inside one block, and a response token sees the prompt and
its own response only (`policy_forward.attention_mask`), so each rollout's logprobs are those of the
rollout alone.

Alignment convention (every per-token field): index `t` describes the *target* token
`target_ids[t] = input_ids[t + 1]`, predicted from the hidden state at `source_positions[t]`. That is `t`
itself, except before the first token of a block's second and later responses: the token at `t` is the
previous response's last token, and the first response token is predicted from the prompt's last position,
so `source_positions[t]` points there (the state all responses of the block share). With a prompt of `p`
tokens at offset `o` and response j starting at `s`, response token k is the target at `t = s - 1 + k`;
`loss_mask`, `sampler_logprobs`, `advantages`, `temperature`, `weight_step` and `sequence_ids` of that
token live at `t`. Prompt tokens are never targets with a mask of 1, and neither are environment tokens of
multi-turn episodes (the rollout's own `loss_mask` is 0 there; they belong to the response, so later turns
are not shared). Per-token values are 0 wherever `loss_mask` is 0 (temperature 1, weight_step
`PAD_ROW_WEIGHT_STEP`, sequence_ids -1), so a loss that forgets the mask still reads finite numbers.

Shapes. The row length is the shortest bucket of `BatchingConfig.bucket_lengths()` that holds the longest
block (one rollout when packed; a group's prompt and responses when shared, split at `max_length`): longer
rows would only add attention over keys the mask hides. The number of rows comes from a ladder
(`row_bucket`: 1..8, then 4 per octave) and is a multiple of `row_multiple` (the trainer's data-parallel size),
and of `microbatch_rows` once it has more rows than one microbatch, so a run compiles a few (rows, length)
shapes. Assembly is pure NumPy; the arrays move to JAX in one `jax.device_put`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import equinox as eqx
import haliax as hax
import jax
import numpy as np

from marinrl.config.batching import BatchingConfig, Layout  # noqa: F401  (the config of this module)
from marinrl.train.packing import plan_rows
from marinrl.types import Rollout

BATCH = "batch"
POSITION = "position"
PAD_ROW_WEIGHT_STEP = -1
"""`weight_step` of a position that is no rollout's target: no weights sampled it."""
DEFAULT_ATTENTION_BREAK_EVEN = 384
"""`BatchingConfig.attention_break_even` when no model is known: 3 × a hidden size of 128."""

class TrainingBatch(eqx.Module):
    """One optimizer step's worth of rows, as named arrays over (batch, position) (see the module docstring)."""

    input_ids: hax.NamedArray  # int32: the rows' tokens, blocks back to back, right-padded
    target_ids: hax.NamedArray  # int32: input_ids shifted left by one
    source_positions: hax.NamedArray  # int32: the position whose hidden state predicts target_ids[t]
    position_ids: hax.NamedArray  # int32: position of the token inside its block (restarts per block)
    segment_ids: hax.NamedArray  # int32: block of the token inside its row (-1: padding)
    response_ids: hax.NamedArray  # int32: 0 on a prompt, j on the block's j-th response
    sequence_ids: hax.NamedArray  # int32: rollout of target t inside its row (-1: no rollout's target)
    loss_mask: hax.NamedArray  # float32: 1 where target_ids[t] is a trained response token
    sampler_logprobs: hax.NamedArray  # float32: log μ(target_ids[t]) at the sampling temperature
    advantages: hax.NamedArray  # float32: advantage credited to target_ids[t]
    temperature: hax.NamedArray  # float32: the target's sampling temperature (logits are divided by it)
    weight_step: hax.NamedArray  # int32: weights that sampled the target (for staleness metrics)
    sequence_slots: hax.NamedArray  # [batch] float32: rollout slots of the batch / rows (constant normalization)

    @property
    def Batch(self) -> hax.Axis:
        return self.input_ids.resolve_axis("batch")

    @property
    def Pos(self) -> hax.Axis:
        return self.input_ids.resolve_axis("position")

    @staticmethod
    def field_axes(name: str) -> tuple[str, ...]:
        """The axis names of field `name`: (batch,) for `sequence_slots`, (batch, position) for the rest."""
        return (BATCH,) if name == "sequence_slots" else (BATCH, POSITION)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_rollouts(cls, rollouts: Sequence[Rollout], advantages, *, batch_size: int, config: BatchingConfig,
                      trainable=None, row_multiple: int = 1, microbatch_rows: int | None = None) -> TrainingBatch:
        """See `make_training_batch`."""
        return make_training_batch(rollouts, advantages, batch_size=batch_size, config=config, trainable=trainable,
                                   row_multiple=row_multiple, microbatch_rows=microbatch_rows)

    @classmethod
    def from_numpy(cls, arrays: dict[str, np.ndarray]) -> TrainingBatch:
        """Wraps the arrays of `pack_rollouts` as named arrays, moving them to JAX in one call."""
        on_device = jax.device_put(arrays)
        return cls(**{name: hax.named(on_device[name], cls.field_axes(name)) for name in cls.field_names()})

    @classmethod
    def one_sequence_per_row(cls, *, input_ids, target_ids, loss_mask, sampler_logprobs, advantages, temperature,
                             weight_step=None) -> TrainingBatch:
        """A batch whose row i is one sequence with plain causal attention (hand-made batches in tests, the
        dry run's shapes): `temperature` and `weight_step` are per row, [batch]; the rest [batch, position]."""
        ids = np.asarray(input_ids)
        rows, length = ids.shape
        per_token = lambda v, dtype: np.broadcast_to(np.asarray(v, dtype)[:, None], (rows, length)).copy()  # noqa: E731
        mask = np.asarray(loss_mask, np.float32)
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
        return cls.from_numpy({
            "input_ids": ids.astype(np.int32), "target_ids": np.asarray(target_ids, np.int32),
            "source_positions": positions, "position_ids": positions.copy(),
            "segment_ids": np.zeros((rows, length), np.int32), "response_ids": np.zeros((rows, length), np.int32),
            "sequence_ids": np.where(mask > 0, 0, -1).astype(np.int32), "loss_mask": mask,
            "sampler_logprobs": np.asarray(sampler_logprobs, np.float32),
            "advantages": np.asarray(advantages, np.float32), "temperature": per_token(temperature, np.float32),
            "weight_step": per_token(np.zeros(rows) if weight_step is None else weight_step, np.int32),
            "sequence_slots": np.ones(rows, np.float32)})


def pack_rollouts(
    rollouts: Sequence[Rollout], advantages, *, batch_size: int, config: BatchingConfig, trainable=None,
    row_multiple: int = 1, microbatch_rows: int | None = None, min_shape: tuple[int, int] = (0, 0),
) -> dict[str, np.ndarray]:
    """The NumPy arrays of a `TrainingBatch` (same names), following the module's layout and alignment.

    `advantages[i]` is rollout i's advantage, credited to every trained token of that rollout, or one
    advantage per response token (multi-turn credit, `advantages.token_advantages`).
    `trainable[i] = False` (e.g. a truncated response under DAPO's overlong masking) keeps the rollout but
    masks all of its tokens out. `batch_size` is the batch's rollout slots (`len(rollouts)` or more: the
    rest count as empty rollouts, as padding rows did, for `constant` normalization); the number of rows
    is a multiple of `row_multiple` (each data-parallel device gets whole rows) and, when there are more than
    `microbatch_rows` (gradient accumulation), of that too (Levanter splits the batch into equal
    microbatches). Rollouts sharing a `group_id` and an identical prompt share a block under the `shared`
    layout. `min_shape`: at least this many (rows, positions), the shape of another batch packed with the same
    arguments, so that batches of several adapters stack (`train/adapter_streams.py`).
    """
    n = len(rollouts)
    if len(advantages) != n:
        raise ValueError(f"advantages must have one entry per rollout ({n}), got {len(advantages)}")
    adv = []  # per rollout, one advantage per response token
    for i, (r, a) in enumerate(zip(rollouts, advantages)):
        a = np.asarray(a, dtype=np.float64)
        size = r.response_tokens.size
        if a.ndim == 0:
            a = np.full(size, a)
        elif a.shape != (size,):
            raise ValueError(f"advantages[{i}] must be a number or {size} per-token values (group "
                             f"{r.group_id!r}), got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"advantages[{i}] must be finite, got {a}")
        adv.append(a)
    train = np.ones(n, dtype=bool) if trainable is None else np.asarray(trainable)
    if train.shape != (n,) or train.dtype != np.bool_:
        raise ValueError(f"trainable must be {n} booleans to match the rollouts, got {trainable!r}")
    if n == 0:
        raise ValueError("cannot build a batch from zero rollouts")
    if n > batch_size:
        raise ValueError(f"{n} rollouts do not fit a batch of {batch_size} rows")
    if row_multiple < 1:
        raise ValueError(f"row_multiple must be >= 1, got {row_multiple}")
    if microbatch_rows is not None and (microbatch_rows < 1 or microbatch_rows % row_multiple):
        raise ValueError(f"microbatch_rows must be a positive multiple of row_multiple={row_multiple}, got "
                         f"{microbatch_rows}")
    for i, r in enumerate(rollouts):
        if r.prompt_tokens.size == 0:
            raise ValueError(f"rollout {i} (group {r.group_id!r}) has an empty prompt: the first response token "
                             f"needs at least one context token (a BOS) to be predicted from")
        if r.num_tokens > config.max_length:
            raise ValueError(f"rollout {i} (group {r.group_id!r}) has {r.num_tokens} tokens "
                             f"({r.prompt_tokens.size} prompt + {r.response_tokens.size} response), more than "
                             f"a row holds: BatchingConfig.max_length={config.max_length}")
    longest = max(r.num_tokens for r in rollouts)
    response_lengths = [r.response_tokens.size for r in rollouts]
    prompts, members = _blocks(rollouts, config.layout)
    prompt_lengths = [p.size for p in prompts]
    if config.layout == "padded":
        length = max(config.bucket_for(longest), min_shape[1])
        rows = [[(i, [i])] for i in range(n)]
        num_rows = _round_up(batch_size, microbatch_rows or row_multiple)
    else:
        # rows at most as long as the longest block: longer would only add attention over masked-out keys.
        # `shared` tries every bucket from the longest rollout's up: a split block repeats its prompt per
        # piece, and rows x L x (L + break-even) prices the prompt savings against attention's L^2
        longest_block = max(p + sum(response_lengths[i] for i in m) for p, m in zip(prompt_lengths, members))
        top = max(config.bucket_for(min(config.max_length, longest_block)), min_shape[1])
        shared = config.layout == "shared"
        lengths = ([L for L in config.bucket_lengths() if max(config.bucket_for(longest), min_shape[1]) <= L <= top]
                   if shared else [top])
        break_even = config.attention_break_even or DEFAULT_ATTENTION_BREAK_EVEN
        plans = [(plan_rows(prompt_lengths, members, response_lengths, length=L, split=shared), L) for L in lengths]
        # ties: fewer rows
        rows, length = min(plans, key=lambda p: (row_bucket(len(p[0])) * p[1] * (p[1] + break_even), -p[1]))
        num_rows = _round_up(row_bucket(len(rows)), row_multiple)
        if microbatch_rows is not None and num_rows > microbatch_rows:
            num_rows = _round_up(num_rows, microbatch_rows)
        num_rows = min(num_rows, _round_up(batch_size, microbatch_rows or row_multiple))
    num_rows = max(num_rows, min_shape[0])

    shape = (num_rows, length)
    input_ids = np.full(shape, config.pad_token_id, dtype=np.int32)
    source = np.broadcast_to(np.arange(length, dtype=np.int32), shape).copy()
    position_ids = np.zeros(shape, np.int32)
    segment_ids = np.full(shape, -1, np.int32)
    response_ids = np.zeros(shape, np.int32)
    sequence_ids = np.full(shape, -1, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    logprobs = np.zeros(shape, np.float32)
    adv_tokens = np.zeros(shape, np.float32)
    temperature = np.ones(shape, np.float32)
    weight_step = np.full(shape, PAD_ROW_WEIGHT_STEP, np.int32)
    for row, pieces in enumerate(rows):
        offset, ordinal = 0, 0
        for segment, (b, piece) in enumerate(pieces):
            prompt = prompts[b]
            p = prompt.size
            input_ids[row, offset:offset + p] = prompt
            position_ids[row, offset:offset + p] = np.arange(p)
            segment_ids[row, offset:offset + p] = segment
            start = offset + p
            for j, i in enumerate(piece, start=1):
                r = rollouts[i]
                size = r.response_tokens.size
                tokens = slice(start, start + size)
                input_ids[row, tokens] = r.response_tokens
                position_ids[row, tokens] = np.arange(p, p + size)
                segment_ids[row, tokens] = segment
                response_ids[row, tokens] = j
                targets = slice(start - 1, start - 1 + size)  # positions whose targets are the response tokens
                source[row, start - 1] = offset + p - 1  # the first response token follows the prompt
                mask = r.loss_mask & train[i]  # bool, aligned with response tokens
                loss_mask[row, targets] = mask
                logprobs[row, targets] = np.where(mask, r.response_logprobs, 0.0)
                adv_tokens[row, targets] = np.where(mask, adv[i], 0.0)
                temperature[row, targets] = np.where(mask, r.temperature, 1.0)
                weight_step[row, targets] = np.where(mask, r.token_weight_steps, PAD_ROW_WEIGHT_STEP)
                sequence_ids[row, targets] = np.where(mask, ordinal, -1)
                ordinal += 1
                start += size
            offset = start
    target_ids = np.full_like(input_ids, config.pad_token_id)
    target_ids[:, :-1] = input_ids[:, 1:]
    return {
        "input_ids": input_ids,
        "target_ids": target_ids,
        "source_positions": source,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "response_ids": response_ids,
        "sequence_ids": sequence_ids,
        "loss_mask": loss_mask,
        "sampler_logprobs": logprobs,
        "advantages": adv_tokens,
        "temperature": temperature,
        "weight_step": weight_step,
        "sequence_slots": np.full((num_rows,), batch_size / num_rows, np.float32),
    }


def _blocks(rollouts: Sequence[Rollout], layout: Layout) -> tuple[list[np.ndarray], list[list[int]]]:
    """(prompt of each block, the rollouts continuing it): one block per group and prompt when shared
    (in order of first appearance), else one per rollout."""
    if layout != "shared":
        return [r.prompt_tokens for r in rollouts], [[i] for i in range(len(rollouts))]
    index: dict[tuple, int] = {}
    prompts, members = [], []
    for i, r in enumerate(rollouts):
        key = (r.group_id, np.asarray(r.prompt_tokens, np.int64).tobytes())
        if key not in index:
            index[key] = len(prompts)
            prompts.append(r.prompt_tokens)
            members.append([])
        members[index[key]].append(i)
    return prompts, members


def row_bucket(rows: int) -> int:
    """Row counts a packed batch can have: every count to 8, then 4 per octave (10, 12, 14, 16, 20, …):
    a run compiles a few shapes, not one per count, for at most 1/4 (on average ~1/8) padding rows."""
    if rows <= 8:
        return max(rows, 1)
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def _round_up(value: int, multiple: int) -> int:
    return max(1, math.ceil(value / multiple)) * multiple


def make_training_batch(
    rollouts: Sequence[Rollout], advantages, *, batch_size: int, config: BatchingConfig, trainable=None,
    row_multiple: int = 1, microbatch_rows: int | None = None,
) -> TrainingBatch:
    """Packs rollouts (with their advantages) into a `TrainingBatch` (`pack_rollouts`, moved to JAX).

    The position axis is a bucket of `config` and the rows a multiple of `row_multiple` (and of `microbatch_rows`
    past one microbatch), so a run compiles
    a few shapes, not one per batch.
    """
    arrays = pack_rollouts(rollouts, advantages, batch_size=batch_size, config=config, trainable=trainable,
                           row_multiple=row_multiple, microbatch_rows=microbatch_rows)
    return TrainingBatch.from_numpy(arrays)


def row_alignment(trainer_config) -> dict[str, int | None]:
    """`make_training_batch`'s row arguments for this trainer: rows in multiples of the data-parallel size (each
    device gets whole rows) and, only when Levanter accumulates gradients (its microbatch is smaller than the
    batch), of the microbatch past one. Levanter fills an unset `per_device_parallelism` with the whole batch,
    so its `microbatch_size` alone would pad every packed batch back to `train_batch_size` rows."""
    mbs = trainer_config.microbatch_size
    accumulating = mbs is not None and mbs < trainer_config.train_batch_size
    return {"row_multiple": trainer_config.data_axis_size, "microbatch_rows": mbs if accumulating else None}
