"""The runs `benchmarks/multi_run.py` measures: which task, which runs, and how each is written
as `lorabus up` overrides (alone, or as the fleet's own run) and as a `lorabus run submit` file.

Pure: no I/O but `run_file`'s write. A spec is the same run whether it runs alone or in a
fleet: the same seed, LoRA shape and steps, so its solo run is its control.

Invariant: spec i's solo overrides and its run file set the same run keys to the same values;
the fleet settings (`fleet.*`) are the only overrides a fleet adds, and they change where a run
runs, never what it computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = ("all-linear",)
KEEP_SLOTS = 4
"""adapter slots one run holds on every replica at max_head_offpolicyness 2 (keep 3 + 1 loading)"""


@dataclass(frozen=True)
class RunSpec:
    """One run: its seed and, when it differs from the config's, its LoRA shape."""

    seed: int
    rank: int | None = None
    """None: the config's actor.lora_rank (and alpha, targets)"""
    targets: tuple[str, ...] = ALL_LINEAR
    alpha_per_rank: float = 2.0
    """lora_alpha = alpha_per_rank * rank: every rank gets the same LoRA scale"""

    @property
    def lora(self) -> dict:
        """The run's `actor` keys (seed and LoRA shape)."""
        if self.rank is None:
            return {}
        return {
            "seed": self.seed,
            "lora_rank": self.rank,
            "lora_alpha": self.alpha_per_rank * self.rank,
            "target_modules": list(self.targets),
        }

    def describe(self) -> str:
        if self.rank is None:
            return f"seed {self.seed}, the config's LoRA"
        where = "all-linear" if self.targets == ALL_LINEAR else "attention"
        return f"seed {self.seed}, r{self.rank} {where}"


@dataclass(frozen=True)
class Task:
    name: str
    config: str
    overrides: tuple[str, ...] = ()
    """for every `lorabus up` of the task (the fleet's and each solo run's)"""
    steps: int = 10
    runs: tuple[int, ...] = (1, 2, 4)
    eval_every: int = 0
    """score every Nth version of each run (0: the last one only) besides v0"""
    late_from: int = 0
    """fleets of at least this many runs submit their last run late, into a busy fleet (0: never)"""
    late_version: int = 3
    """'busy': the fleet's own run has published this version"""
    up_timeout_s: float = 3000.0
    specs: tuple[RunSpec, ...] = field(default_factory=tuple)

    def spec(self, i: int) -> RunSpec:
        """Run i (1-based) of a fleet: the mixed specs in turn, or seed i in the config's shape."""
        return self.specs[(i - 1) % len(self.specs)] if self.specs else RunSpec(seed=i)


MIXED = (
    RunSpec(seed=1, rank=16, targets=ALL_LINEAR),  # the fleet's own run: the widest targets
    RunSpec(seed=2, rank=8, targets=ATTENTION),
    RunSpec(seed=3, rank=32, targets=ALL_LINEAR),
    RunSpec(seed=4, rank=16, targets=ATTENTION),
    RunSpec(seed=5, rank=8, targets=ALL_LINEAR),
    RunSpec(seed=6, rank=32, targets=ATTENTION),
    RunSpec(seed=7, rank=16, targets=ALL_LINEAR),
    RunSpec(seed=8, rank=8, targets=ATTENTION),
)
"""ranks 8/16/32 and all-linear vs attention-only; the first is the fleet's own run, whose
targets are the slot pool's (`capacity.problems`: every other run's must be a subset)"""

TASKS = {
    "tiny": Task(name="tiny", config="examples/tiny.yaml"),
    "arith3": Task(
        name="arith3",
        config="examples/arith3_gpu.yaml",
        overrides=("actor.dtype=bfloat16", "rollout.dtype=bfloat16"),
        steps=40,
        runs=(1, 2, 4, 8),
        eval_every=10,
        late_from=4,
        up_timeout_s=300.0,
        specs=MIXED,
    ),
}


def solo_overrides(task: Task, i: int, run: str, run_dir: Path, steps: int) -> list[str]:
    """`lorabus up` overrides of spec i alone (or as a fleet's own run)."""
    spec = task.spec(i)
    out = [f"run={run}", f"run_dir={run_dir}", f"total_train_steps={steps}", f"seed={spec.seed}"]
    for key, value in spec.lora.items():
        text = "[" + ",".join(value) + "]" if isinstance(value, list) else str(value)
        out.append(f"actor.{key}={text}")
    return out


def fleet_overrides(task: Task, n: int) -> list[str]:
    """What a fleet of runs 1..n adds: slots for every run's keep window, room for n runs and
    the highest rank among them (the own run's rank is the default slot rank)."""
    out = [f"fleet.lora_slots={KEEP_SLOTS * n}", f"fleet.max_runs={max(n, 1)}"]
    ranks = [r for i in range(1, n + 1) if (r := task.spec(i).rank) is not None]
    own = task.spec(1).rank
    if own is not None and ranks and max(ranks) > own:
        out.append(f"fleet.max_lora_rank={max(ranks)}")
    return out


def run_tree(task: Task, i: int, run: str, steps: int) -> dict:
    """Spec i as a run file's keys (what `lorabus run submit FILE` sends)."""
    spec = task.spec(i)
    tree: dict = {"run": run, "seed": spec.seed, "total_train_steps": steps}
    if spec.lora:
        tree["actor"] = spec.lora
    return tree


def run_file(path: Path, tree: dict) -> Path:
    path.write_text(json.dumps(tree))
    return path


def late(task: Task, n: int, i: int) -> bool:
    """Whether run i of a fleet of n is submitted into the busy fleet."""
    return bool(task.late_from) and n >= task.late_from and i == n and n > 1


def versions_to_score(task: Task, steps: int) -> list[int]:
    """The versions of each run scored on the held-out set (v0, the base, is scored once)."""
    if task.eval_every <= 0:
        return [steps]
    return sorted({*range(task.eval_every, steps + 1, task.eval_every), steps})
