"""An AReaL experiment file as a run of a fleet: `lorabus run submit areal.yaml --config FLEET`.

The file goes through the translation `lorabus up` applies (`services.config.areal`, the same
table, printed the same way), then the translated config is loaded whole (the loader's rules,
its interpolations and epochs resolved). The run is that config's run keys
(`runkeys.RUN_KEYS`: name, LoRA shape, generation, optimiser and PPO settings, data and
reward, steps); everything else is the fleet's, as for any run file. A fleet setting the file
gives otherwise (its allocation, its engine, its paths) is listed as not taken, since the fleet
runs every run on one set of processes; the base model is the one fleet setting a run cannot
do without, so an `actor.path` or `actor.tokenizer_path` other than the fleet's is refused.

Invariant: what is sent to the registry is native run keys only, so the registry checks it
exactly as it checks any run file.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import msgspec

from services.config import areal, runkeys
from services.config.loader import ConfigError, config_from_dict
from services.config.schema import LorabusConfig

BASE_KEYS = ("actor.path", "actor.tokenizer_path")
"""fleet settings a run's file must agree with: the model every run of the fleet shares"""
NOT_COMPARED = ("run_dir", "experiment_name", "trial_name", "run", "total_train_epochs")
"""keys that name or count the run itself (its run keys, or derived from them)"""


def _same_path(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a == b
    return os.path.normpath(str(a)) == os.path.normpath(str(b))


def fleet_differences(cfg: LorabusConfig, fleet: LorabusConfig) -> list[tuple[str, Any, Any]]:
    """(key, the file's value, the fleet's) for each fleet setting the two configs give
    differently; run keys, per-run paths and connection sections are not fleet settings."""
    mine, theirs = areal.flatten(msgspec.to_builtins(cfg)), areal.flatten(msgspec.to_builtins(fleet))
    skip = (*runkeys.RUN_KEYS, *runkeys.PER_RUN_PATHS, *runkeys.CONNECTION_SECTIONS, *NOT_COMPARED)
    out = []
    for key in sorted(mine.keys() | theirs.keys()):
        if any(key == k or key.startswith(k + ".") for k in skip):
            continue
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, str) and isinstance(b, str):  # `${run_dir}/...` names each run's own place
            a, b = a.replace(cfg.run_dir, "${run_dir}"), b.replace(fleet.run_dir, "${run_dir}")
        if a != b and not (key in BASE_KEYS and _same_path(a, b)):
            out.append((key, a, b))
    return out


def run_tree(fleet: LorabusConfig, tree: dict[str, Any], *, source: str) -> dict[str, Any]:
    """The run keys of the AReaL experiment `tree`, as a run file would hold them; raises
    `ConfigError` with every problem (the translation's, the loader's, a base model of its own).
    Prints the translation table and the fleet settings not taken to stderr."""
    t = areal.translate(tree)
    if t.problems:
        raise ConfigError(t.problems, source)
    try:
        cfg = config_from_dict(t.tree, source=source)
    except ConfigError as e:
        raise ConfigError([areal.point_back(p, t.origin) for p in e.problems], source) from None
    differences = fleet_differences(cfg, fleet)
    base = [
        f"{key}: {mine!r} is not the fleet's base model {theirs!r}; every run of a fleet trains one "
        f"adapter on the fleet's base model (submit it to a fleet of {mine!r}, or set {key} to the fleet's)"
        for key, mine, theirs in differences
        if key in BASE_KEYS
    ]
    if base:
        raise ConfigError(base, source)
    print(f"lorabus: {source} is an AReaL experiment file; as a run of fleet {fleet.run!r} it became:", file=sys.stderr)
    print(areal.report(t.rows), file=sys.stderr)
    if differences:
        print(f"fleet settings of {source} not taken (the fleet's are, for every run):", file=sys.stderr)
        for key, mine, theirs in differences:
            print(f"  {key}: {mine!r} (the fleet's: {theirs!r})", file=sys.stderr)
    keys = [k for k in runkeys.RUN_KEYS if k != "run_dir"]  # the run's directory is the fleet's runs/<run>
    return runkeys.only(msgspec.to_builtins(cfg), keys)
