"""Where `lorabus up`'s trainer finds megatron-core and megatron-bridge when the launcher's own
environment lacks them: a `pip --target` site put first on the trainer's PYTHONPATH only.

Invariant: only the trainer's processes (torchrun and its ranks) see the site; the registry,
exporter, rollouts and evaluator keep the venv's packages. Why a site and not the venv:
megatron-bridge 0.6.2 imports with transformers <= 5.17, older than the venv's, so the site
carries its own transformers (`make megatron-env` builds it as `.cache/megatron-site`, the
lent GPU's parts are packed the same way, docs/megatron.md).

Without `--trainer-site`, a Megatron run whose launcher cannot import `megatron.bridge` takes
`.cache/megatron-site` where it exists; otherwise the trainer's own import error names the fix.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from services.config.schema import LorabusConfig
from services.local.processes import Child

DEFAULT_MEGATRON_SITE = Path(".cache/megatron-site")


class BadTrainerSite(ValueError):
    """`--trainer-site` names no usable site; the message says what to give."""


def _has_bridge() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ImportError:  # no `megatron` package at all
        return False


def trainer_site(cfg: LorabusConfig, given: str | None) -> str | None:
    """The site the trainer needs on its PYTHONPATH, or None for the launcher's own packages."""
    if given:
        if not Path(given, "megatron", "bridge").is_dir():
            raise BadTrainerSite(
                f"--trainer-site: {given} holds no megatron/bridge package; give the directory "
                "`make megatron-env` builds (.cache/megatron-site) or another `pip --target` site "
                "with megatron-bridge and megatron-core"
            )
        return str(Path(given).resolve())
    if cfg.actor.backend != "megatron" or _has_bridge():
        return None
    for candidate in (DEFAULT_MEGATRON_SITE, Path(__file__).resolve().parents[2] / DEFAULT_MEGATRON_SITE):
        if (candidate / "megatron" / "bridge").is_dir():
            return str(candidate.resolve())
    return None


def trainer_env(site: str | None) -> dict[str, str]:
    """The trainer's extra environment: the site first on PYTHONPATH, the launcher's after it."""
    if site is None:
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)}


def give_trainer(children: Sequence[Child], site: str | None) -> None:
    """Put `site` on the trainer child's environment (kept across its restarts), no other's."""
    for child in children:
        if child.name == "trainer":
            child.env_extra.update(trainer_env(site))
