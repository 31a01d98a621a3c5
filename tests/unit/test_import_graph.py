"""The import graph of `proto/` and `services/` has no circle and no upward import
(docs/design.md, "Layout"), read from the source with `ast`, so nothing is imported to check it.

Every runtime import counts, a lazy one inside a function too (a circle through it is still a
circle); only imports under `if TYPE_CHECKING:` are left out. The layers, from the ground up:
`proto`; `services/common` and `services/config` (what every service shares); each service
(trainer, rollout, registry, exporter), which imports the layers below and itself, never
another service; and the tools that reach across services (`services/local`, `services/clients`,
`services/cli.py`), which nothing below imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = {"services.common", "services.config"}
SERVICES = {"services.trainer", "services.rollout", "services.registry", "services.exporter"}
TOOLS = {"services.local", "services.clients", "services.cli", "services"}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted([*ROOT.glob("proto/**/*.py"), *ROOT.glob("services/**/*.py")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """The modules of `known` that `path` imports at run time, with the line of each import."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit_else(child)
                continue
            if isinstance(child, ast.Import):
                out.extend((t, child.lineno) for a in child.names if (t := resolve(a.name)))
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for a in child.names:
                    if (t := resolve(f"{child.module}.{a.name}")) is not None:
                        out.append((t, child.lineno))
            visit(child)

    def visit_else(node: ast.If) -> None:
        for child in node.orelse:
            visit(ast.Module(body=[child], type_ignores=[]))

    visit(ast.parse(path.read_text(), filename=str(path)))
    return out


def area(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] == "proto" else ".".join(parts[:2])


def layer(a: str) -> int:
    if a == "proto":
        return 0
    if a in SHARED:
        return 1
    if a in SERVICES:
        return 2
    assert a in TOOLS, f"{a}: a folder of services/ the import rule does not place; add it to a layer here"
    return 3


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    known = modules()
    return known, {m: [(t, line) for t, line in imports(p, known) if t != m] for m, p in known.items()}


def upward(edges: dict[str, list[tuple[str, int]]], known: dict[str, Path]) -> list[str]:
    found = []
    for m, targets in edges.items():
        for t, line in targets:
            a, b = area(m), area(t)
            if a == b:
                continue
            below = layer(b) < layer(a)
            across_shared = layer(a) == layer(b) == 1  # common and config are one layer
            if not (below or across_shared or layer(a) == 3):
                found.append(f"{known[m].relative_to(ROOT)}:{line}: {m} imports {t} ({a} may not import {b})")
    return found


def circles(edges: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Each strongly connected group of modules bigger than one (Tarjan), as one circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in edges.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in edges:
        if v not in index:
            connect(v)
    return groups


def test_no_import_circle_in_proto_and_services():
    _, edges = graph()
    assert len(edges) > 100  # the walk found the tree
    assert circles(edges) == [], "import circles (break each: move the shared part down a module)"


def test_no_upward_import_and_no_service_imports_another():
    known, edges = graph()
    assert upward(edges, known) == []


def test_the_checks_see_a_circle_and_an_upward_import():
    """The two checks on a made-up graph, so that a green run means the tree, not a blind check."""
    edges = {
        "services.common.a": [("services.common.b", 1)],
        "services.common.b": [("services.common.a", 2), ("services.trainer.x", 3)],
        "services.trainer.x": [("services.registry.y", 4)],
        "services.registry.y": [],
    }
    assert circles(edges) == [["services.common.a", "services.common.b"]]
    known = {m: ROOT / f"{m.replace('.', '/')}.py" for m in edges}
    problems = upward(edges, known)
    assert len(problems) == 2
    assert "services.common may not import services.trainer" in problems[0]
    assert "services.trainer may not import services.registry" in problems[1]
