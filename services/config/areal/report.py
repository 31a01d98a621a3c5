"""The translation table a user reads: AReaL field, its value, what it became here (or no effect
and why), printed once per `lorabus up` (the services it starts do not print it again).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from services.config.areal.translator import Row, Translation


def _collapse(rows: list[Row]) -> list[Row]:
    """Neighbouring no-effect rows of one section with one reason become one row (`saver.*`)."""
    out: list[Row] = []
    for r in rows:
        top = r.areal.split(".")[0]
        last = out[-1] if out else None
        if (
            last is not None
            and r.became == "-"
            and last.became == "-"
            and last.note == r.note
            and last.areal.split(".")[0] == top
            and "." in r.areal
        ):
            out[-1] = Row(f"{top}.*", "…", "-", r.note)
        else:
            out.append(r)
    return out


def report(rows: list[Row]) -> str:
    """One table: AReaL field, its value, what it became here (or '-' and why not)."""

    def cut(text: Any, n: int) -> str:
        s = str(text)
        return s if len(s) <= n else s[: n - 1] + "…"

    rows = _collapse(rows)
    head = ("AReaL field", "value", "lorabus")
    k = max([len(head[0])] + [len(r.areal) for r in rows])
    v = min(24, max([len(head[1])] + [len(str(r.value)) for r in rows]))
    lines = [f"{head[0]:<{k}}  {head[1]:<{v}}  {head[2]}", f"{'-' * k}  {'-' * v}  {'-' * 7}"]
    for r in rows:
        became = r.became if r.became != "-" else "no effect"
        if r.note:
            became += f" ({r.note})" if r.became != "-" else f": {r.note}"
        lines.append(f"{r.areal:<{k}}  {cut(r.value, v):<{v}}  {became}")
    return "\n".join(lines)


def point_back(problem: str, origin: dict[str, str]) -> str:
    """A native problem about a translated field, with the AReaL field it came from."""
    key = problem.split(":", 1)[0]
    source = origin.get(key)
    return f"{problem} (from AReaL's {source})" if source and source != key else problem


REPORTED_ENV = "LORABUS_AREAL_REPORTED"
"""set once the table is printed, so the services `lorabus up` starts do not print it again"""


def announce(t: Translation, source: str | None) -> None:
    if os.environ.get(REPORTED_ENV) == "1":
        return
    os.environ[REPORTED_ENV] = "1"
    print(
        f"lorabus: {source or 'config'} is an AReaL experiment file; translated as follows "
        "(`lorabus config translate` prints the native YAML):",
        file=sys.stderr,
    )
    print(report(t.rows), file=sys.stderr)
