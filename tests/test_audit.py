"""The trained-groups audit trail (marinrl/train/audit.py): written per incarnation, read back, followed
along the resume chain, and counted: duplicates only along the lineage, losses of missing or short steps
and of rolled-back groups the resumed run skipped."""

from __future__ import annotations

import json

from marinrl.train.audit import AuditTrail, audit, lineage, read_trail


def write(root, trainer, first_step, parent, steps: dict[int, list[tuple[str, int]]], t0=0.0):
    trail = AuditTrail(str(root), trainer)
    trail.start(first_step, None if parent is None else f"ckpt/step-{first_step - 1}", parent)
    for step, groups in steps.items():
        trail.record(step, groups)


def on_policy(steps, tag="", per_step=2):
    """Steps -> groups made with the weights before each (staleness 0), named by step and index."""
    return {s: [(f"{tag}{s}.{i}", s - 1) for i in range(per_step)] for s in steps}


def test_the_lineage_follows_resumes_back_and_rolls_back_what_a_dead_trainer_took_past_its_checkpoint(tmp_path):
    write(tmp_path, "a", 0, None, on_policy(range(1, 8)))  # died after step 7, checkpoint at 5
    write(tmp_path, "b", 5, "a", on_policy(range(6, 11)))  # retrains 6 and 7: the same groups, legitimately
    trail = read_trail(str(tmp_path))
    lin = lineage(trail)
    assert lin.chain == ["b", "a"] and lin.resumes == [5] and lin.broken is None
    assert {s: r["groups"][0][0] for s, r in lin.steps.items()} == {s: f"{s}.0" for s in range(1, 11)}
    assert sorted(r["step"] for r in lin.rolled_back) == [6, 7]
    counts = audit(trail, num_steps=10, groups_per_step=2, max_staleness=0)
    assert (counts.steps, counts.groups_trained, counts.groups_duplicated, counts.groups_lost) == (10, 20, 0, 0)


def test_a_group_trained_twice_along_the_lineage_is_a_duplicate(tmp_path):
    steps = on_policy(range(1, 5))
    steps[4] = [("3.1", 2), ("4.1", 3)]  # 3.1 again, one step later (within staleness 1)
    write(tmp_path, "a", 0, None, steps)
    counts = audit(read_trail(str(tmp_path)), num_steps=4, groups_per_step=2, max_staleness=1)
    assert counts.groups_duplicated == 1 and counts.groups_lost == 0
    counts = audit(read_trail(str(tmp_path)), num_steps=4, groups_per_step=2, max_staleness=1, max_uses=2)
    assert counts.groups_duplicated == 0


def test_missing_and_short_steps_are_lost(tmp_path):
    steps = on_policy(range(1, 5))
    del steps[3]
    steps[4] = steps[4][:1]
    write(tmp_path, "a", 0, None, steps)
    counts = audit(read_trail(str(tmp_path)), num_steps=5, groups_per_step=2, max_staleness=0)
    assert counts.missing_steps == [3, 5] and counts.groups_lost == 2 + 1 + 2


def test_a_rolled_back_group_the_resume_skipped_for_a_newer_one_is_lost(tmp_path):
    # Off-policy, staleness 1: the dead trainer took "old" (weights 4) at step 6; the resumed one (from
    # weights 5) trained newer groups (weights 5) at steps 6 and 7 and never "old": its buffer had lost it.
    write(tmp_path, "a", 0, None, {**on_policy(range(1, 6)), 6: [("old", 4), ("5.x", 5)]})
    write(tmp_path, "b", 5, "a", {6: [("5.x", 5), ("5.y", 5)], 7: [("6.0", 6), ("6.1", 6)]})
    counts = audit(read_trail(str(tmp_path)), num_steps=7, groups_per_step=2, max_staleness=1)
    assert counts.groups_lost == 1 and counts.groups_duplicated == 0


def test_a_rolled_back_group_left_over_among_equally_old_ones_is_not_lost(tmp_path):
    # The resumed trainer took two other groups of weights 5 where the dead one took "5.z": oldest first
    # cannot tell them apart, so nothing says the buffer lost it. A dead run's own future weights (6) are
    # not the lineage's and are never counted.
    write(tmp_path, "a", 0, None,
          {**on_policy(range(1, 6)), 6: [("5.z", 5), ("5.x", 5)], 7: [("dead6", 6), ("5.y", 5)]})
    write(tmp_path, "b", 5, "a",
          {6: [("5.x", 5), ("5.y", 5)], 7: [("5.v", 5), ("5.w", 5)], 8: [("7.0", 7), ("7.1", 7)]})
    counts = audit(read_trail(str(tmp_path)), num_steps=8, groups_per_step=2, max_staleness=1)
    assert counts.groups_lost == 0


def test_a_chain_whose_parent_is_missing_says_so_and_counts_the_steps_it_cannot_see(tmp_path):
    write(tmp_path, "b", 5, "gone", on_policy(range(6, 9)))
    trail = read_trail(str(tmp_path))
    assert "gone" in lineage(trail).broken
    assert audit(trail, num_steps=8, groups_per_step=2, max_staleness=0).missing_steps == [1, 2, 3, 4, 5]


def test_the_longest_stall_spans_a_restart(tmp_path):
    write(tmp_path, "a", 0, None, on_policy(range(1, 4)))  # step 3 rolled back
    write(tmp_path, "b", 2, "a", on_policy(range(3, 5)))
    for trainer, step, at in (("a", 1, 100.0), ("a", 2, 101.0), ("a", 3, 102.0), ("b", 3, 140.0), ("b", 4, 141.0)):
        path = tmp_path / trainer / f"step-{step:08d}.json"  # the records' clocks, set: a restart's gap
        path.write_text(json.dumps({**json.loads(path.read_text()), "time": at}))
    # 38 s from the dead trainer's last step to the resumed one's first: what a user watching sees
    assert audit(read_trail(str(tmp_path)), num_steps=4, groups_per_step=2, max_staleness=0).max_stall_s == 38.0


def test_a_rolled_back_group_made_with_the_checkpoints_own_weights_is_lost_when_skipped(tmp_path):
    # The checkpoint holds weights 5; the dead trainer took "ckpt5" (made with exactly those weights) at
    # step 7; the resumed one, from weights 5, trained newer groups (weights 6) at step 7 while "ckpt5" was
    # still fresh, and never "ckpt5": lost. (Counting only groups older than the checkpoint misses it.)
    write(tmp_path, "a", 0, None,
          {**on_policy(range(1, 6)), 6: [("5.x", 5), ("5.y", 5)], 7: [("ckpt5", 5), ("dead6", 6)]})
    write(tmp_path, "b", 5, "a", {6: [("5.x", 5), ("5.y", 5)], 7: [("6.0", 6), ("6.1", 6)]})
    counts = audit(read_trail(str(tmp_path)), num_steps=7, groups_per_step=2, max_staleness=1)
    assert counts.groups_lost == 1 and counts.groups_duplicated == 0
