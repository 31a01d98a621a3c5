"""Which exported versions the held-out evaluator scores, and which scores are still to come.

Pure functions of the `evaluator` config section and version numbers, shared by the evaluator
(whether to score an export when it arrives) and `lorabus up` (how many scores it is still
waiting for), so that the two always agree. The last version of a run (`final`) is scored under
every policy: it is the one a user asks about.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.config.schema import EvaluatorConfig


def wanted(e: EvaluatorConfig, version: int, final: int) -> bool:
    """Whether the policy scores `version` at all (whatever else is waiting)."""
    if version == final or e.versions != "every_nth":
        return True
    return version % e.nth == 0


def should_score(e: EvaluatorConfig, version: int, newest_exported: int, final: int) -> bool:
    """Whether to score `version` now that it has arrived; `newest_exported` is the newest
    version exported so far (at least `version`). Under `newest`, a version with a newer one
    already waiting is skipped: the evaluator catches up instead of falling further behind."""
    if not wanted(e, version, final):
        return False
    return not (e.versions == "newest" and newest_exported > version)


def still_to_score(e: EvaluatorConfig, exported: Iterable[int], scored: Iterable[int], final: int) -> list[int]:
    """Exported versions whose score has not arrived and will (under `newest`, only the newest
    exported one: the evaluator skips the rest)."""
    done = set(scored)
    versions = sorted(set(exported))
    if e.versions == "newest":
        versions = versions[-1:]
        if done and versions and max(done) >= versions[0]:
            return []
    return [v for v in versions if v not in done and wanted(e, v, final)]
