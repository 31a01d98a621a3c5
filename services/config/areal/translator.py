"""The small machine that applies the translation tables (`tables.py`) to one AReaL tree.

A `Translator` holds the flattened AReaL file and records, for each key, exactly one outcome:
a lorabus value it became (`to`), no effect here and why (`noop`), or a problem (`refuse`).
`used` is every key with an outcome; the caller reports every other key as unknown, so nothing
is dropped silently. The table entries (`Keep`, `NoEffect`, `Only`) are these three outcomes as
data; an entry that needs to look at other keys is a plain function of the `Translator`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

NATIVE_SECTION = "lorabus"
"""the top-level section of an AReaL file for native lorabus keys, merged last"""


@dataclass(frozen=True)
class Row:
    areal: str
    value: Any
    became: str
    """`native.key = value`, or '-' for a field with no effect here"""
    note: str = ""


@dataclass
class Translation:
    tree: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    """native dotted key -> the AReaL key it came from (to point native problems back)"""
    asked: set[str] = field(default_factory=set)
    """every AReaL key the translation looked for (the AReaL names a command line may use)"""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def set_at(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


class Translator:
    def __init__(self, src: dict[str, Any]):
        self.src = src
        self.flat = flatten(src)
        self.used: set[str] = set()
        self.asked: set[str] = set()
        """every AReaL key the translation looked for: the candidates for 'did you mean'"""
        self.t = Translation()
        self.server_flags: list[str] = []
        """command-line flags for the inference server from rollout.backend (t and p sizes)"""

    # what happened to one AReaL key
    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return self.flat.get(key, default)

    def has(self, key: str) -> bool:
        self.asked.add(key)
        return key in self.flat

    def to(self, key: str, native: str, value: Any = ..., note: str = "", default: Any = ...) -> None:
        """AReaL `key` becomes lorabus `native` (its value, converted, or AReaL's default)."""
        self.asked.add(key)
        if key not in self.flat and default is ...:
            return
        raw = self.flat.get(key, default)
        value = raw if value is ... else value
        self.used.add(key)
        set_at(self.t.tree, native, value)
        self.t.origin[native] = key
        shown = raw if key in self.flat else f"{raw!r} (AReaL default)"
        self.t.rows.append(Row(key, shown, f"{native} = {value!r}", note))

    def noop(self, key: str, note: str) -> None:
        """AReaL keys under `key` (a leaf or a section) have no effect here; `note` says why."""
        self.asked.add(key)
        for k in [k for k in self.flat if k == key or k.startswith(key + ".")]:
            if k not in self.used:
                self.used.add(k)
                self.t.rows.append(Row(k, self.flat[k], "-", note))

    def refuse(self, key: str, problem: str) -> None:
        self.used.add(key)
        shown = self.flat.get(key)
        self.t.problems.append(f"{key}: {shown!r} {problem}")

    def only(self, key: str, allowed: Any, why: str, note: str = "AReaL's default; lorabus does the same") -> None:
        """Accepted at `allowed` (AReaL's default) only; any other value is refused with `why`."""
        self.asked.add(key)
        if key not in self.flat:
            return
        ok = self.flat[key] in allowed if isinstance(allowed, tuple) else self.flat[key] == allowed
        if ok:
            self.noop(key, note)
        else:
            self.refuse(key, why)


@dataclass(frozen=True)
class Keep:
    """AReaL `areal` becomes lorabus `native`, as written or at AReaL's `default` (`...`: none)."""

    areal: str
    native: str
    default: Any = ...
    note: str = ""

    def __call__(self, x: Translator) -> None:
        x.to(self.areal, self.native, default=copy.deepcopy(self.default), note=self.note)


@dataclass(frozen=True)
class NoEffect:
    """AReaL keys at or under `areal` have no effect here, for the reason `why`."""

    areal: str
    why: str

    def __call__(self, x: Translator) -> None:
        x.noop(self.areal, self.why)


_SAME = "AReaL's default; lorabus does the same"


@dataclass(frozen=True)
class Only:
    """Accepted at `allowed` (AReaL's default, or a tuple of values) with no effect; any other
    value is refused with `why`."""

    areal: str
    allowed: Any
    why: str
    note: str = _SAME

    def __call__(self, x: Translator) -> None:
        x.only(self.areal, self.allowed, self.why, self.note)


Entry = Callable[[Translator], None]
"""one table entry: a Keep, NoEffect or Only, or a function for a key that depends on others"""


def apply(x: Translator, table: Iterable[Entry]) -> None:
    """Each entry in order: an earlier outcome for a key stands (`noop` skips used keys)."""
    for entry in table:
        entry(x)
