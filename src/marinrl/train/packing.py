"""Which rollouts share a row: blocks (a prompt and the responses that continue it) placed into rows.

A *block* is one prompt followed by one or more responses of that prompt. Under the `shared` layout a
group's rollouts form one block (the prompt once, then every response); under `packed` each rollout is a
block of its own. `plan_rows` places blocks into rows of a fixed length by first-fit decreasing: blocks in
order of decreasing length (ties: the order they came in), each into the first row with room for all of
it. A shared block that fits no open row is split at response boundaries: each piece repeats the prompt,
fills the first row that has room for the prompt and enough responses to pay for repeating it, and what
is left goes on to the next such row or a new one. Pure Python over lengths, so the same rollouts always
give the same rows (a resumed run rebuilds its batches exactly).
"""

from __future__ import annotations

from typing import Sequence

Piece = tuple[int, list[int]]
"""(block index, the block's rollouts placed here, in block order): one prompt and those responses."""


def plan_rows(
    prompt_lengths: Sequence[int], members: Sequence[Sequence[int]], response_lengths: Sequence[int], *,
    length: int, split: bool,
) -> list[list[Piece]]:
    """Rows (each a list of pieces, in row order) holding every rollout of every block once.

    `prompt_lengths[b]` and `members[b]` describe block b; `response_lengths[i]` rollout i. Every prompt plus
    any one of its responses must fit `length` (the caller checks). Without `split` blocks stay whole (the
    `packed` layout, whose blocks are single rollouts).
    """
    def need(b: int, idx: Sequence[int]) -> int:
        return prompt_lengths[b] + sum(response_lengths[i] for i in idx)

    order = sorted(range(len(members)), key=lambda b: (-need(b, members[b]), b))
    rows: list[list[Piece]] = []
    free: list[int] = []

    def place(row: int | None, piece: Piece, size: int) -> None:
        if row is None:
            rows.append([])
            free.append(length)
            row = len(rows) - 1
        rows[row].append(piece)
        free[row] -= size

    for b in order:
        whole = need(b, members[b])
        row = next((k for k, f in enumerate(free) if f >= whole), None)
        if row is not None or not split or len(members[b]) == 1:
            place(row, (b, list(members[b])), whole)
            continue
        remaining = list(members[b])
        p = prompt_lengths[b]
        while remaining:
            row, take = None, []
            for k, f in enumerate(free):  # first open row where the repeated prompt pays for itself
                take = _prefix_that_fits(remaining, response_lengths, f - p)
                if take and sum(response_lengths[i] for i in take) >= p:
                    row = k
                    break
            if row is None:
                take = _prefix_that_fits(remaining, response_lengths, length - p)
            place(row, (b, take), need(b, take))
            remaining = remaining[len(take):]
    return rows


def _prefix_that_fits(rollouts: list[int], response_lengths: Sequence[int], room: int) -> list[int]:
    taken, used = [], 0
    for i in rollouts:
        if used + response_lengths[i] > room:
            break
        taken.append(i)
        used += response_lengths[i]
    return taken
