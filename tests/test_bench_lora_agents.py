"""bench/lora_agents.py (many agents, one base) at a tiny size, in-process: its JSON lines carry every figure, and the
shared layout holds one base: each extra agent adds exactly one adapter's bytes to the trainer's parameters and one
adapter (and its scale) to the rollout worker's weights. No wall-clock figure is asserted."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import lora_agents  # noqa: E402

KEYS = {"agents", "layout", "trainer_peak_gib", "rollout_peak_gib", "gen_tokens_per_s", "step_s", "total_rows", "rank",
        "machine"}


def test_the_shared_layout_adds_one_adapter_per_agent(capsys):
    returned = lora_agents.main(["--tiny", "--agents", "1,2", "--total-rows", "4", "--steps", "1", "--calls", "1"])
    out = capsys.readouterr().out.splitlines()
    lines = [json.loads(line) for line in out if line.startswith("{")]
    *per_case, last = lines
    assert per_case == json.loads(json.dumps(returned)) and last == {"ratios": {}}  # no K = 4 here
    assert [(x["agents"], x["layout"]) for x in per_case] == [(1, "shared"), (2, "shared")]
    for x in per_case:
        assert KEYS <= set(x), KEYS - set(x)
        assert (x["total_rows"], x["rank"], x["rows_per_adapter"]) == (4, 8, 4 // x["agents"])
        assert x["trainer_peak_gib"] > 0 and x["rollout_peak_gib"] > 0 and x["gen_tokens_per_s"] > 0
        assert x["rollout_memory"] in ("held", "held+temp") and {"cpu", "cpus", "jax"} <= set(x["machine"])
    one, two = per_case
    base = lora_agents.build_model(lora_agents.model_config(tiny=True))
    adapter = lora_agents.adapter_bytes(base, lora_agents.lora_configs(8, 2)[1])
    assert adapter > 0 and two["trainer_param_bytes"] - one["trainer_param_bytes"] == adapter
    assert one["trainer_param_bytes"] == lora_agents.nbytes(base) + adapter  # one base
    assert two["rollout_held_bytes"] - one["rollout_held_bytes"] == adapter + 4  # a slot: A, B and a float32 scale
    assert out.index("machine: " + json.dumps(one["machine"])) < out.index(json.dumps(returned[0]))


def test_ratios_and_targets():
    def line(k, layout, trainer, rollout, gen, steps):
        return {"agents": k, "layout": layout, "trainer_peak_gib": trainer, "rollout_peak_gib": rollout,
                "gen_tokens_per_s": gen, "step_s_all": steps}

    r = lora_agents.ratios([line(1, "shared", 1.0, 2.0, 100.0, [1.0]), line(4, "shared", 1.2, 2.2, 90.0, [1.0, 2.0]),
                            line(4, "per_adapter", 4.0, 8.0, 80.0, [2.0, 2.0])])
    assert r == pytest.approx({"trainer_memory_k4_over_k1": 1.2, "rollout_memory_k4_over_k1": 1.1,
                               "gen_k4_over_k1": 0.9, "step_k4_shared_over_per_adapter": 0.75})  # median of 1/2, 2/2
    assert set(r) == set(lora_agents.TARGETS)
