"""A run's config: the keys one run of a fleet may set, laid over the fleet's config.

A run file is a lorabus config holding only run keys (`runkeys.RUN_KEYS`: its name, LoRA shape,
generation, optimiser and PPO settings, off-policyness, data and reward, steps, share).
Everything else (base model, backends, engines, replicas, bus, store) is the fleet's: every run
of a fleet shares one base model and one set of processes. A key the run file omits is the
fleet config's (as written, so `${run_dir}` follows the run); the run's `run_dir` defaults to
`<fleet run_dir>/runs/<run>`, and with it its checkpoints and exports. An AReaL experiment
file may be a run file too: translated as `lorabus up` translates it, it becomes its run keys
(`areal_run`).

The merged tree goes through the config loader (`config_from_dict`): the same shape checks,
did-you-mean and rules as a file given to `lorabus up`, so a run file is valid exactly when the
same keys in a fleet config would be, and its problems read `field: value, problem; fix`.

Invariant: two runs of one fleet never share a run name, a run directory, a checkpoint
directory or an export location (`conflicts`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from services.config import areal, areal_run
from services.config.loader import ConfigError, config_from_dict, deep_merge, parse_overrides, read_tree
from services.config.runkeys import CONNECTION_SECTIONS, PER_RUN_PATHS, RUN_KEYS, only
from services.config.schema import LorabusConfig


def _covered(path: str, keys: Sequence[str]) -> bool:
    return any(path == k or path.startswith(k + ".") for k in keys)


def _schema_fields(cls: Any) -> dict[str, Any]:
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return {f.name: f.type for f in msgspec.structs.fields(cls)}
    return {}


def outside_keys(run_tree: dict[str, Any]) -> list[tuple[str, str]]:
    """(dotted key, problem) for each key of the schema that a run may not set. Keys the
    schema does not know are left to the loader, which names them with a did-you-mean."""
    problems: list[tuple[str, str]] = []

    def walk(node: dict[str, Any], cls: Any, prefix: str) -> None:
        fields = _schema_fields(cls)
        for key, value in node.items():
            path = f"{prefix}{key}"
            if key not in fields:
                continue
            if _covered(path, RUN_KEYS):
                continue
            if isinstance(value, dict) and any(k.startswith(path + ".") for k in RUN_KEYS):
                walk(value, fields[key], path + ".")
                continue
            allowed = sorted({k for k in RUN_KEYS if k.startswith(prefix)} or RUN_KEYS)
            problems.append(
                (
                    path,
                    f"{path}: {value!r} is a fleet setting, the same for every run of the fleet; remove "
                    f"it from the run file (a run sets {', '.join(allowed)})",
                )
            )

    walk(run_tree, LorabusConfig, "")
    return problems


def _without(tree: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for key in keys:
        head, _, leaf = key.rpartition(".")
        node: Any = out
        for part in head.split(".") if head else ():
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def fleet_tree(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The fleet config's tree as written, with its overrides (AReaL files translated): the
    base a run file is laid over."""
    tree = read_tree(path)
    if areal.is_areal(tree):
        tree = areal.translate(tree).tree
    return deep_merge(tree, parse_overrides(overrides, os.fspath(path)))


def run_config(
    fleet: LorabusConfig, fleet_raw: dict[str, Any], run_tree: dict[str, Any], *, source: str | None = None
) -> LorabusConfig:
    """The whole config of the run `run_tree` describes, on the fleet `fleet` (loaded from
    `fleet_raw`); raises `ConfigError` with every problem."""
    if not isinstance(run_tree, dict):
        raise ConfigError(f"top level is a {type(run_tree).__name__}; a run file is a mapping of run keys", source)
    outside = outside_keys(run_tree)
    problems = [problem for _, problem in outside]
    # the fleet's keys are left out rather than stopping here: every problem in one pass
    mine = _without(run_tree, [path for path, _ in outside])
    own = (*RUN_KEYS, *PER_RUN_PATHS)
    pinned = _without(msgspec.to_builtins(fleet), own)
    tree = deep_merge(deep_merge(pinned, only(fleet_raw, own)), mine)
    if "run_dir" not in mine:
        tree["run_dir"] = f"{fleet.run_dir.rstrip('/')}/runs/${{run}}"
    try:
        cfg = config_from_dict(tree, source=source)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems, source) from None
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_run(
    fleet: LorabusConfig, fleet_raw: dict[str, Any], path: str | os.PathLike[str]
) -> tuple[dict[str, Any], LorabusConfig]:
    """(the run file's tree, the run's whole config); raises `ConfigError`. An AReaL experiment
    file is translated as `lorabus up` translates it and becomes its run keys (`areal_run`)."""
    tree = read_tree(path)
    if areal.is_areal(tree):
        tree = areal_run.run_tree(fleet, tree, source=os.fspath(path))
    return tree, run_config(fleet, fleet_raw, tree, source=os.fspath(path))


def conflicts(cfg: LorabusConfig, others: Iterable[LorabusConfig]) -> list[str]:
    """What `cfg` would share with a run the fleet already serves."""
    out = []
    for other in others:
        if cfg.run == other.run:
            out.append(
                f"run: {cfg.run!r} is already a run of this fleet; choose another name (run, or "
                "experiment_name/trial_name)"
            )
            continue
        for field, mine, theirs in (
            ("run_dir", cfg.run_dir, other.run_dir),
            ("actor.checkpoint_dir", cfg.actor.checkpoint_dir, other.actor.checkpoint_dir),
            ("exporter.uri", cfg.exporter.uri, other.exporter.uri),
        ):
            if os.path.normpath(mine) == os.path.normpath(theirs):
                out.append(
                    f"{field}: {mine!r} is run {other.run!r}'s too; runs need their own (write it "
                    "with ${run_dir} in the fleet config, e.g. ${run_dir}/checkpoints)"
                )
    return out


def stored(cfg: LorabusConfig) -> dict[str, Any]:
    """The run's config as the run table keeps it: without the connection sections (no
    credentials on the bus)."""
    return {k: v for k, v in msgspec.to_builtins(cfg).items() if k not in CONNECTION_SECTIONS}


def restore(tree: dict[str, Any], fleet: LorabusConfig) -> LorabusConfig:
    """A stored run config, completed with this service's connection sections."""
    whole = {**tree, **{k: msgspec.to_builtins(getattr(fleet, k)) for k in CONNECTION_SECTIONS}}
    return msgspec.convert(whole, LorabusConfig)
