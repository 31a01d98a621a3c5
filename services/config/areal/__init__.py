"""AReaL experiment YAML as input: detect it, translate it into lorabus's config, say what each
field became.

    tree = OmegaConf-loaded AReaL file (as a dict)
    if is_areal(tree):
        t = translate(tree)      # t.tree: native config tree; t.rows: the report; t.problems
        print(report(t.rows))

The invariant: every key of an AReaL file lands in exactly one row, as a lorabus value it
became, as a field with no effect here (and what lorabus does instead), or in `problems` (a
field whose meaning lorabus cannot honour). Nothing is dropped silently, and a value that AReaL
would have used by default (AReaL's defaults, not lorabus's) is translated as if written.

Allocation strings (`fsdp:d4`, `vllm:d4p1t1`, `megatron:(attn:d1p6t1c1|ffn:d1p6t1e1)`) give
the trainer's ranks and Megatron sizes, and the number of rollout replicas and each server's
tensor/pipeline size. `total_train_epochs` stays epochs (lorabus's own `total_train_epochs`): the
config loader turns it into steps as AReaL counts them, epochs * (rows // batch size), when a
service loads the config with its data; translating reads no data. Native lorabus keys that AReaL has no
word for (bus, store, server URLs) go under a top-level `lorabus:` section, merged last.

The translation is data: `tables` (one row per AReaL key: the lorabus key it becomes, no effect
and why, or the values refused and why), applied in order by `translator`; the rows that look at
other keys are functions in `transforms`, `alloc`, `servers` and `datasets`. `renames` names
AReaL keys in native files and unknown keys in AReaL ones; `report` is the printed table.
"""

from __future__ import annotations

from typing import Any, cast

from omegaconf import OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

from services.config.areal.alloc import parse_alloc
from services.config.areal.datasets import GSM8K_INSTRUCTION
from services.config.areal.renames import RENAMES, rename_hint, unknown
from services.config.areal.report import REPORTED_ENV, announce, point_back, report
from services.config.areal.tables import TABLE
from services.config.areal.translator import NATIVE_SECTION, Keep, Row, Translation, Translator, apply, flatten, set_at

__all__ = [
    "GSM8K_INSTRUCTION",
    "NATIVE_SECTION",
    "RENAMES",
    "REPORTED_ENV",
    "Row",
    "Translation",
    "announce",
    "flatten",
    "is_areal",
    "parse_alloc",
    "point_back",
    "rename_hint",
    "report",
    "translate",
]

_AREAL_ONLY_TOP = ("cluster", "allocation_mode")


def is_areal(tree: Any) -> bool:
    """An AReaL file names its backends with allocation strings (`fsdp:d4`, `sglang:d4`), which
    no lorabus field accepts, or has sections only AReaL has (`cluster:`, `saver:`, ...)."""
    if not isinstance(tree, dict):
        return False
    for section in ("actor", "rollout"):
        backend = tree.get(section, {}).get("backend") if isinstance(tree.get(section), dict) else None
        if isinstance(backend, str) and ":" in backend:
            return True
    return any(key in tree for key in _AREAL_ONLY_TOP)


def _resolved(areal: dict[str, Any]) -> dict[str, Any]:
    """The file's keys with its `${...}` resolved as AReaL resolves them: after its defaults are
    merged in, so a reference to a key the file leaves out (`${gconfig.max_new_tokens}` in a file
    without it) reads AReaL's default (those the tables know). The defaults resolve references
    only; the keys the file did not write stay out."""
    written = OmegaConf.create(areal)
    try:
        # a mapping in, a mapping out; OmegaConf types to_container for any container
        return cast("dict[str, Any]", OmegaConf.to_container(written, resolve=True))
    except InterpolationKeyError:
        defaults: dict[str, Any] = {}
        for entry in TABLE:
            if isinstance(entry, Keep) and entry.default is not ... and entry.default is not None:
                set_at(defaults, entry.areal, entry.default)
        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(defaults), written), resolve=True)
        full = flatten(merged)
        kept = {}
        for key in flatten(OmegaConf.to_container(written, resolve=False)):
            for k in [key] if key in full else [k for k in full if k.startswith(key + ".")]:
                kept[k] = full[k]
        tree: dict[str, Any] = {}
        for k, v in kept.items():
            set_at(tree, k, v)
        return tree


def translate(areal: dict[str, Any]) -> Translation:
    """Translate an AReaL tree (its `${...}` are resolved here, in AReaL's vocabulary). Reads no
    file and no data: epochs stay epochs until a service loads the config with its data."""
    areal = dict(areal)
    native_extra = areal.pop(NATIVE_SECTION, None)
    try:
        src = _resolved(areal)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        t = Translation()
        t.problems.append(f"{key}: cannot resolve: {first}; references in an AReaL file name AReaL keys")
        return t
    x = Translator(src)
    apply(x, TABLE)
    for key in x.flat:
        if key not in x.used:
            x.t.problems.append(unknown(key, x.flat[key], x.asked))
    x.t.asked = set(x.asked)
    if native_extra is not None:
        if not isinstance(native_extra, dict):
            x.t.problems.append(f"{NATIVE_SECTION}: {native_extra!r} must be a section of native lorabus keys")
        else:
            for key, value in flatten(native_extra).items():
                set_at(x.t.tree, key, value)
                x.t.rows.append(Row(f"{NATIVE_SECTION}.{key}", value, f"{key} = {value!r}", "native key, as written"))
    return x.t
