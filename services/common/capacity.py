"""What a fleet's rollout engines can hold, and whether one more run fits: pure, no I/O.

Every replica of a fleet holds the kept versions of every live run at once (one base model,
one adapter per run and version), so the engine's adapter slots are counted over all runs:
run `r` needs `rollout.keep_versions + 1` of them (its keep window, plus one version loading).

- embedded engine: `fleet.lora_slots` slots (unset: the fleet's own run's need) of rank
  `fleet.max_lora_rank` (unset: the fleet's own `actor.lora_rank`) over the modules the fleet's
  own run targets; a run of lower rank or fewer modules is zero-padded into them
  (`services.rollout.run_engines`), so a run must fit that rank and those modules.
- vLLM: `vllm.max_cpu_loras` adapters (the server's cache); rank is the loader's
  `vllm.max_lora_rank` check, repeated on every run's merged config.
- SGLang: `sglang.max_loaded_loras`; rank and targets likewise the loader's.

Invariant: a run is admitted only while the slots of every live run, its own included, fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from services.common import lora_targets
from services.config.schema import LorabusConfig


def need(cfg: LorabusConfig) -> int:
    """Adapter slots one run holds on every replica."""
    return cfg.rollout.keep_versions + 1


def slots(fleet: LorabusConfig) -> tuple[int, str]:
    """(adapter slots of each replica's engine, the setting that says so)."""
    engine = fleet.rollout.engine
    if engine == "vllm":
        v = fleet.vllm
        return (v.max_cpu_loras if v.max_cpu_loras is not None else max(v.max_loras, need(fleet))), "vllm.max_cpu_loras"
    if engine == "sglang":
        return fleet.sglang.max_loaded_loras, "sglang.max_loaded_loras"
    return (fleet.fleet.lora_slots if fleet.fleet.lora_slots is not None else need(fleet)), "fleet.lora_slots"


def max_rank(fleet: LorabusConfig) -> int:
    """The rank of an embedded engine's slots: every run's adapter is padded to it."""
    return fleet.fleet.max_lora_rank if fleet.fleet.max_lora_rank is not None else fleet.actor.lora_rank


def _targets(cfg: LorabusConfig) -> list[str] | Literal["all-linear"]:
    return lora_targets.for_backend(cfg.actor.target_modules, "fsdp2")


def problems(fleet: LorabusConfig, run: LorabusConfig, live: Iterable[LorabusConfig]) -> list[str]:
    """Why the fleet's replicas cannot hold `run` beside the `live` runs (the fleet's own among
    them); empty: it fits."""
    out = []
    have, setting = slots(fleet)
    used = [need(other) for other in live]
    if sum(used) + need(run) > have:
        out.append(
            f"{setting}: {have} adapter slots per replica, the live runs hold {sum(used)} and run "
            f"{run.run!r} needs {need(run)} (rollout.keep_versions + 1); stop a run, lower its "
            f"lora_keep_versions, or start the fleet with {setting} >= {sum(used) + need(run)}"
        )
    if fleet.rollout.engine == "embedded":
        rank = max_rank(fleet)
        if run.actor.lora_rank > rank:
            out.append(
                f"actor.lora_rank: {run.actor.lora_rank} is above the fleet's slot rank {rank} "
                f"(fleet.max_lora_rank); use rank <= {rank}, or start the fleet with "
                f"fleet.max_lora_rank >= {run.actor.lora_rank}"
            )
        mine, theirs = _targets(run), _targets(fleet)
        if theirs != lora_targets.ALL_LINEAR:
            extra = ["all-linear"] if mine == lora_targets.ALL_LINEAR else sorted(set(mine) - set(theirs))
            if extra:
                out.append(
                    f"actor.target_modules: {extra} are not among the fleet's slot modules {theirs} "
                    "(the fleet's own actor.target_modules); target a subset of them"
                )
    return out
