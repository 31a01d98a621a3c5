"""Load, back-fill and validate a lorabus config file.

    cfg = load_config("examples/tiny.yaml", overrides=["rollout.replicas=3"])

The pipeline is: read the YAML (OmegaConf's loader, so `3e-5` is a float as in AReaL's files),
apply `key=value` overrides, lay the result over the schema's defaults, resolve `${a.b}` and
`${oc.env:NAME,default}`, convert into `LorabusConfig` (unknown keys and wrong types are errors),
fill derived defaults, then run every validation rule. Problems are collected rather than raised
one at a time, so a user fixes a broken file in one pass: unknown keys, wrong types and broken
rules together (a value one stage reports is set back to its default for the next, and a rule
about a field already reported is not repeated); `ConfigError.problems` lists them.

The rules that span fields are `services.config.rules` (`validate` is re-exported here, as the
loader's last stage); each returns messages of the form `<dotted.field>: <bad value> <what is
wrong>; <the fix>`.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any, cast

import msgspec
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from proto.messages import adapter_name
from services.config import areal
from services.config.rules import check_schedule, validate
from services.config.schema import LorabusConfig

__all__ = [
    "ConfigError",
    "load_config",
    "read_tree",
    "parse_overrides",
    "deep_merge",
    "config_from_dict",
    "backfill",
    "validate",
]


class ConfigError(ValueError):
    """A config that cannot be used. `problems` holds one message per problem found."""

    def __init__(self, problems: str | Sequence[str], source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f"config {source}" if source else "config"
        if len(self.problems) == 1:
            text = f"{where}: {self.problems[0]}"
        else:
            listed = "\n".join(f"  - {p}" for p in self.problems)
            text = f"{where} has {len(self.problems)} problems:\n{listed}"
        super().__init__(text)


# --- loading ----------------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str], overrides: Iterable[str] = (), *, read_data: bool = True
) -> LorabusConfig:
    """Read, resolve, back-fill and validate one config file; raises `ConfigError`.
    `read_data=False` reads no dataset (no network): `total_train_epochs` stays unconverted."""
    return config_from_dict(read_tree(path), overrides, source=os.fspath(path), read_data=read_data)


def read_tree(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's mapping as written (nothing resolved or checked yet); raises `ConfigError`."""
    source = os.fspath(path)
    try:
        loaded = OmegaConf.load(source)
    except FileNotFoundError:
        raise ConfigError(f"file not found: {source!r}; pass --config with an existing YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"is not valid YAML: {e}", source) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot be read: {_first_line(e)}", source) from None
    tree: object = OmegaConf.to_container(loaded, resolve=False)
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"top level is a {type(tree).__name__}; a config is a mapping of sections "
            "(experiment_name:, actor:, rollout:, ...)",
            source,
        )
    return tree


def config_from_dict(
    tree: dict[str, Any], overrides: Iterable[str] = (), *, source: str | None = None, read_data: bool = True
) -> LorabusConfig:
    """The same pipeline as `load_config`, for a tree already in memory (tests, launchers).
    An AReaL experiment tree is translated first (`services.config.areal`); its problems and
    the native ones are reported together. Overrides on an AReaL tree in AReaL's names
    (`actor.path=...`) apply to it before translation, as AReaL's launcher takes them; the rest
    name native keys and apply after."""
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    if not areal.is_areal(tree):
        cfg = _native_config(tree, overrides, source)
        written = "total_train_steps" in deep_merge(tree, parse_overrides(overrides, source))
        _count_epochs(cfg, written, read_data, source)
        return cfg
    areal_overrides, native_overrides = _split_overrides(tree, overrides, source)
    t = areal.translate(deep_merge(tree, parse_overrides(areal_overrides, source)))
    try:
        cfg = _native_config(t.tree, native_overrides, source)
    except ConfigError as e:
        raise ConfigError(t.problems + [areal.point_back(p, t.origin) for p in e.problems], source) from None
    if t.problems:
        raise ConfigError(t.problems, source)
    written = "total_train_steps" in deep_merge(t.tree, parse_overrides(native_overrides, source))
    how = _count_epochs(cfg, written, read_data, source)
    if how is not None:
        steps = f"total_train_steps = {cfg.total_train_steps}"
        t.rows.append(areal.Row("total_train_epochs", cfg.total_train_epochs, steps, how))
    areal.announce(t, source)
    return cfg


def _count_epochs(cfg: LorabusConfig, steps_written: bool, read_data: bool, source: str | None) -> str | None:
    if not read_data:
        return None
    try:
        how = epochs_to_steps(cfg, steps_written)
    except ConfigError as e:
        raise ConfigError(e.problems, source) from None
    if how is not None and (problems := check_schedule(cfg)):
        raise ConfigError(problems, source)
    return how


def _split_overrides(tree: dict[str, Any], overrides: list[str], source: str | None) -> tuple[list[str], list[str]]:
    """(AReaL overrides, native overrides) for an AReaL tree: a key the translator reads, or one
    the file has, is AReaL's; any other key (rollout.replicas, bus.url, lorabus.*) is native."""
    parse_overrides(overrides, source)  # malformed ones are reported in lorabus's words first
    asked = areal.translate(tree).asked | set(areal.flatten(tree))
    theirs: list[str] = []
    ours: list[str] = []
    for item in overrides:
        key = item.partition("=")[0].strip()
        is_theirs = key in asked or any(a.startswith(key + ".") for a in asked)
        (theirs if is_theirs or key.startswith(areal.NATIVE_SECTION + ".") else ours).append(item)
    return theirs, ours


def _native_config(tree: dict[str, Any], overrides: Iterable[str], source: str | None) -> LorabusConfig:
    tree = deep_merge(tree, parse_overrides(overrides, source))
    defaults = msgspec.to_builtins(LorabusConfig())
    tree = deep_merge(defaults, tree)
    # One pass: shape, type and rule problems are reported together. What one stage reports is
    # set back to its default before the next looks, so that a misspelt key or `actor: 5` is one
    # problem and not also a confusing interpolation or rule failure elsewhere.
    problems = _shape_problems(tree, LorabusConfig, "")
    reported = {_problem_path(p) for p in problems}
    tree = _known_only(tree, defaults, LorabusConfig)
    try:
        resolved = _resolve(tree, source)
    except ConfigError as e:
        raise ConfigError(problems + e.problems, source) from None
    cfg, type_problems = _to_struct(resolved, tree, defaults)
    problems += type_problems
    reported |= {_problem_path(p) for p in type_problems}
    backfill(cfg)
    problems += [p for p in validate(cfg) if not _under(_problem_path(p), reported)]
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _problem_path(problem: str) -> str:
    """The dotted field a problem message starts with (`actor.lr: ...` -> `actor.lr`)."""
    return problem.split(":", 1)[0].split(" ", 1)[0]


def _under(path: str, reported: set[str]) -> bool:
    return any(path == r or path.startswith((r + ".", r + "[")) for r in reported)


def _known_only(tree: dict[str, Any], defaults: dict[str, Any], cls: type[msgspec.Struct]) -> dict[str, Any]:
    """`tree` without its unknown keys, and with a scalar where a section belongs set back to
    the default section (both already reported by `_shape_problems`)."""
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key not in fields:
            continue
        inner = _struct_type(fields[key].type)
        if inner is not None and isinstance(value, dict) and isinstance(defaults.get(key), dict):
            out[key] = _known_only(value, defaults[key], inner)
        elif inner is not None and not isinstance(value, dict) and not (isinstance(value, str) and "${" in value):
            out[key] = defaults.get(key)
        else:
            out[key] = value
    return out


def parse_overrides(overrides: Iterable[str], source: str | None = None) -> dict[str, Any]:
    if isinstance(overrides, str):  # a lone "a=b" would otherwise iterate per character
        overrides = [overrides]
    out: dict[str, Any] = {}
    problems = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
            problems.append(f"override {item!r} is not key=value; write e.g. rollout.replicas=3")
            continue
        try:
            # a dotlist makes a mapping; OmegaConf types to_container for any container
            parsed = cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False))
        except OmegaConfBaseException as e:
            problems.append(f"override {item!r} cannot be parsed: {_first_line(e)}")
            continue
        parts = key.strip().split(".")
        if isinstance(_value_at(parsed, key.strip()), (bool, int, float)) and _is_text(_type_at(parts)):
            # YAML reads trial_name=0123 or =685e72 as a number; a string field keeps the text as
            # written (on a command line the quotes YAML would need are the shell's)
            parsed = _nested(parts, item.partition("=")[2].strip())
        out = deep_merge(out, parsed)
    if problems:
        raise ConfigError(problems, source)
    return out


def _nested(parts: list[str], value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for parts ["a", "b"]."""
    out: Any = value
    for part in reversed(parts):
        out = {part: out}
    return cast("dict[str, Any]", out)


def _is_text(tp: Any) -> bool:
    """Whether a field of type `tp` holds a string (`str`, or `str | None`)."""
    return tp is str or (str in typing.get_args(tp) and set(typing.get_args(tp)) <= {str, type(None)})


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` wins; mappings merge key by key, anything else (lists too) replaces."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _resolve(tree: dict[str, Any], source: str | None) -> dict[str, Any]:
    try:
        # a mapping in, a mapping out; OmegaConf types to_container for any container
        return cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.create(tree), resolve=True))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(
            f"{key}: cannot resolve {_value_at(tree, key)!r}: {_first_line(e)}; references are "
            "${section.key} (from the top level) or ${oc.env:NAME,default}",
            source,
        ) from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# --- conversion into the typed shape ---------------------------------------------------------

_MSGSPEC_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.+)$")


def _to_struct(tree: dict[str, Any], raw: dict[str, Any], defaults: dict[str, Any]) -> tuple[LorabusConfig, list[str]]:
    """`tree` is resolved; `raw` is the same before resolution, to show where a value came from.
    Every wrong value is reported: msgspec stops at the first error, so each one found is
    explained, set back to its default, and the conversion tried again."""
    problems: list[str] = []
    tree = msgspec.to_builtins(tree)  # a private copy: bad values are replaced below
    for _ in range(_MAX_TYPE_PROBLEMS):
        try:
            # strict=False: `${oc.env:...}` always yields strings, so "8" must still become 8.
            return msgspec.convert(tree, LorabusConfig, strict=False), problems
        except msgspec.ValidationError as e:
            problems.append(_explain(e, tree, raw, prefix=""))
            path = _explained_path(e)
            if not path or not _reset(tree, defaults, path):
                break
    raise ConfigError(problems)


_MAX_TYPE_PROBLEMS = 200
"""a bound on conversion retries; a file has far fewer fields"""


def _explained_path(e: msgspec.ValidationError) -> list[str]:
    m = _MSGSPEC_AT.match(str(e))
    assert m is not None  # every part of the pattern but `msg` is optional, and `msg` takes anything
    rel = (m.group("path") or "").lstrip(".") if m else ""
    # a bad list element resets the whole list: defaults have no element to take
    return _split_path(rel.split("[", 1)[0])


def _reset(tree: dict[str, Any], defaults: dict[str, Any], parts: list[str]) -> bool:
    """Set `tree` at `parts` back to the default there (or drop it if none); False if absent."""
    node, base = tree, defaults
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            return False
        node, base = node[part], base.get(part, {}) if isinstance(base, dict) else {}
    leaf = parts[-1]
    if leaf not in node:
        return False
    if isinstance(base, dict) and leaf in base:
        node[leaf] = base[leaf]
    else:
        del node[leaf]
    return True


def _struct_type(tp: Any) -> type[msgspec.Struct] | None:
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            return t
    return None


def _shape_problems(tree: dict[str, Any], cls: type[msgspec.Struct], prefix: str) -> list[str]:
    """Unknown keys (with a did-you-mean) and scalars where a section belongs, at every depth."""
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    problems = []
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key in fields:
            inner = _struct_type(fields[key].type)
            if inner is None:
                continue
            if isinstance(value, dict):
                problems.extend(_shape_problems(value, inner, path))
            elif not (isinstance(value, str) and "${" in value):  # may resolve to a mapping
                some = ", ".join(f.name for f in msgspec.structs.fields(inner)[:3])
                problems.append(
                    f"{path}: {value!r} has type {type(value).__name__}; it must be a section "
                    f"(a mapping of keys such as {some}, ...)"
                )
            continue
        if hint := areal.rename_hint(path):  # AReaL's name for it first, spellings second
            problems.append(f"{path}: unknown key (value {value!r}); {hint}")
            continue
        close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
        where = f"a key of {prefix}" if prefix else "a top-level section"
        if close:
            fix = f"did you mean {prefix + '.' if prefix else ''}{close[0]}?"
        else:
            fix = f"known keys: {', '.join(fields)}"
        problems.append(f"{path}: unknown key (value {value!r}) is not {where}; {fix}")
    return problems


def _type_at(parts: list[str]) -> Any:
    tp: Any = LorabusConfig
    for part in parts:
        if part.startswith("["):
            args = typing.get_args(tp)
            tp = args[0] if args else Any
            continue
        cls = _struct_type(tp)
        if cls is None:
            return Any
        tp = next((f.type for f in msgspec.structs.fields(cls) if f.name == part), Any)
    return tp


def _split_path(path: str) -> list[str]:
    return [p for p in re.split(r"\.|(?=\[)", path) if p]


def _value_at(tree: Any, dotted: str) -> Any:
    node = tree
    for part in _split_path(dotted):
        if part.startswith("[") and isinstance(node, list):
            node = node[int(part[1:-1])]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _explain(e: msgspec.ValidationError, tree: dict[str, Any], raw: dict[str, Any], prefix: str) -> str:
    m = _MSGSPEC_AT.match(str(e))
    assert m is not None  # every part of the pattern but `msg` is optional, and `msg` takes anything
    msg, rel = m.group("msg"), (m.group("path") or "")
    rel = rel.lstrip(".")
    path = ".".join(p for p in (prefix, rel) if p).replace(".[", "[")
    value = _value_at(tree, path)
    origin = _value_at(raw, path)
    came_from = f" (from {origin!r})" if isinstance(origin, str) and "${" in origin else ""
    if em := _EXPECTED.match(msg):
        want, got = em.group("want"), em.group("got")
        if want == "object":
            return f"{path}: {value!r}{came_from} has type {got}; it must be a section (a mapping of keys)"
        if value is None:
            hint = "; give it a value (an empty `key=` or `key:` means null)"
        elif want == "str":
            hint = "; quote it in YAML"
        else:
            hint = ""
        return f"{path}: {value!r}{came_from} has type {got}, expected {want}{hint}"
    if em := _ENUM.match(msg):
        choices = [a for a in typing.get_args(_type_at(_split_path(path))) if isinstance(a, str)]
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
        fix = f"; did you mean {close[0]!r}?" if close else ""
        return f"{path}: {value!r} is not one of {', '.join(map(repr, choices))}{fix}"
    if em := _UNKNOWN.match(msg):
        return f"{path}.{em.group('name')}: unknown key"
    return f"{path}: {value!r}: {msg}"


# --- derived defaults ------------------------------------------------------------------------


def backfill(cfg: LorabusConfig) -> LorabusConfig:
    """Fill the fields whose defaults depend on others (in place; returns `cfg`)."""
    ro = cfg.rollout
    if not ro.lora_name:
        ro.lora_name = cfg.gconfig.lora_name
    ppo = cfg.actor.ppo
    if ppo.overlong_tokens is not None and ppo.overlong_max_tokens is None:
        ppo.overlong_max_tokens = cfg.gconfig.max_new_tokens
    # written out (the properties give the same values) so that a dumped config shows them
    ro.max_concurrent_rollouts = ro.max_concurrent
    ro.lora_keep_versions = ro.keep_versions
    if cfg.vllm.max_cpu_loras is None:
        cfg.vllm.max_cpu_loras = max(cfg.vllm.max_loras, ro.keep_versions + 1)
    v0 = adapter_name(ro.lora_name, 0)
    v0_entry = f"{v0}={(ro.server_adapter_dir or ro.adapter_dir).rstrip('/')}/{v0}"
    # The server preloads v0 at start so that the first admitted request never waits on a load.
    if ro.preload_v0 and ro.engine == "vllm" and not _names(cfg.vllm.lora_modules) & {v0}:
        cfg.vllm.lora_modules.append(v0_entry)
    if ro.preload_v0 and ro.engine == "sglang" and not _names(cfg.sglang.lora_paths) & {v0}:
        cfg.sglang.lora_paths.append(v0_entry)
    for ds in (cfg.train_dataset, cfg.valid_dataset):
        if ds.tokenizer_path is None and (ds.chat_template or ds.max_length is not None):
            ds.tokenizer_path = cfg.actor.tokenizer_path or cfg.actor.path
    return cfg


def epochs_to_steps(cfg: LorabusConfig, steps_written: bool) -> str | None:
    """With `total_train_epochs` set: read the training set and set `total_train_steps` as AReaL
    counts it, epochs x (prompts // consumer_batch_size), or the steps written where fewer.
    Returns how it was counted (for the start-up summary); raises `ConfigError`."""
    epochs = cfg.total_train_epochs
    if epochs is None:
        return None
    from services.common.data import DataError, load_prompts

    try:
        rows = len(load_prompts(cfg.train_dataset))
    except DataError as e:
        raise ConfigError(
            f"total_train_epochs: {epochs} cannot become steps: the training set cannot be read "
            f"(train_dataset.{e}); make it readable, or set total_train_steps instead"
        ) from None
    batch = cfg.rollout.consumer_batch_size
    counted = epochs * (rows // batch)
    how = f"{epochs} x ({rows} prompts // batch {batch}) = {counted}"
    if steps_written and cfg.total_train_steps < counted:
        return f"{how}; total_train_steps {cfg.total_train_steps} is fewer and wins"
    if counted < 1:
        raise ConfigError(
            f"total_train_epochs: {epochs} is 0 steps: {rows} training prompts make no whole batch of "
            f"rollout.consumer_batch_size {batch}; lower consumer_batch_size or give more prompts"
        )
    cfg.total_train_steps = counted
    return how


def _names(entries: list[str]) -> set[str]:
    return {e.partition("=")[0] for e in entries}
