"""Slot arithmetic over every run of a fleet (services/common/capacity.py)."""

from __future__ import annotations

import msgspec

from services.common import capacity
from services.config.loader import backfill
from services.config.schema import LorabusConfig


def cfg(run: str, engine: str = "embedded", **tree) -> LorabusConfig:
    tree.setdefault("actor", {}).setdefault("target_modules", ["q_proj", "v_proj"])
    tree.setdefault("actor", {}).setdefault("lora_rank", 8)
    tree.setdefault("rollout", {})["engine"] = engine
    return backfill(msgspec.convert({"run": run, **tree}, LorabusConfig))


def test_slots_count_every_live_run():
    fleet = cfg("f", fleet={"lora_slots": 6}, rollout={"max_head_offpolicyness": 1})  # needs 3
    run = cfg("r", rollout={"max_head_offpolicyness": 1})
    assert capacity.need(run) == 3 and capacity.slots(fleet) == (6, "fleet.lora_slots")
    assert capacity.problems(fleet, run, [fleet]) == []
    full = capacity.problems(fleet, run, [fleet, run])
    assert len(full) == 1 and full[0].startswith("fleet.lora_slots: 6 adapter slots per replica, the live runs hold 6")
    assert "fleet.lora_slots >= 9" in full[0]
    # unset: room for the fleet's own run alone
    assert capacity.problems(cfg("f", rollout={"max_head_offpolicyness": 1}), run, [fleet])[0].startswith(
        "fleet.lora_slots: 3 adapter slots"
    )


def test_servers_count_in_their_own_settings():
    vllm = cfg("f", "vllm", vllm={"max_loras": 4, "max_cpu_loras": 8})
    assert capacity.slots(vllm) == (8, "vllm.max_cpu_loras")
    sglang = cfg("f", "sglang", sglang={"max_loaded_loras": 5})
    assert capacity.slots(sglang) == (5, "sglang.max_loaded_loras")
    run = cfg("r", "sglang")  # keep 3 (offpolicyness 2) + 1
    assert capacity.problems(sglang, run, [sglang])[0].startswith("sglang.max_loaded_loras: 5 adapter slots")


def test_embedded_slots_bound_rank_and_modules():
    fleet = cfg("f", fleet={"lora_slots": 99, "max_lora_rank": 16})
    assert capacity.max_rank(fleet) == 16 and capacity.max_rank(cfg("g")) == 8
    assert capacity.problems(fleet, cfg("r", actor={"lora_rank": 16, "target_modules": ["v_proj"]}), []) == []
    big = capacity.problems(fleet, cfg("r", actor={"lora_rank": 32}), [])
    assert big == [
        "actor.lora_rank: 32 is above the fleet's slot rank 16 (fleet.max_lora_rank); use rank <= 16, or "
        "start the fleet with fleet.max_lora_rank >= 32"
    ]
    wide = capacity.problems(fleet, cfg("r", actor={"target_modules": ["q_proj", "o_proj"]}), [])
    assert len(wide) == 1 and wide[0].startswith("actor.target_modules: ['o_proj'] are not among")
    every = capacity.problems(fleet, cfg("r", actor={"target_modules": ["all-linear"]}), [])
    assert every[0].startswith("actor.target_modules: ['all-linear']")
    # a fleet on all-linear takes any targets; servers check rank and modules in the loader
    all_linear = cfg("f", fleet={"lora_slots": 9}, actor={"target_modules": []})
    assert capacity.problems(all_linear, cfg("r", actor={"target_modules": ["all-linear"]}), []) == []
    assert capacity.problems(cfg("f", "vllm"), cfg("r", "vllm", actor={"lora_rank": 64}), []) == []
