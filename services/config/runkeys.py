"""The keys a run of a fleet owns: what a run file may set, what must differ per run, and what
a stored run config leaves out.

Invariant: one list of run keys for every reader (the run file's checks in `runconfig`, an
AReaL experiment file as a run in `areal_run`); neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

RUN_KEYS: tuple[str, ...] = (
    "experiment_name",
    "trial_name",
    "run",
    "run_dir",
    "seed",
    "total_train_steps",
    "gconfig",
    "fleet.share",
    "actor.lora_rank",
    "actor.lora_alpha",
    "actor.target_modules",
    "actor.optimizer",
    "actor.ppo",
    "actor.seed",
    "actor.checkpoint_every",
    "rollout.lora_name",
    "rollout.max_head_offpolicyness",
    "rollout.consumer_batch_size",
    "rollout.max_concurrent_rollouts",
    "rollout.lora_keep_versions",
    "rollout.lease_seconds",
    "train_dataset",
    "valid_dataset",
)
"""dotted keys a run file may set (a key covers everything below it)"""

PER_RUN_PATHS: tuple[str, ...] = ("actor.checkpoint_dir", "exporter.uri")
"""fleet-written keys that must differ per run: taken as the fleet wrote them, so that
`${run_dir}` in them resolves to the run's own directory"""

CONNECTION_SECTIONS = ("bus", "store", "metrics")
"""what a stored run config leaves out: every service takes these from its own config"""


def only(tree: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """The part of `tree` under the dotted `keys`."""
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if node is None:
            continue
        *parents, leaf = key.split(".")
        target = out
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = node
    return out
