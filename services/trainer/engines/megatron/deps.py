"""The optional Megatron stack: one place that imports it and says how to get it."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA_HINT = (
    "install the optional extra with `pip install 'lorabus[megatron]'` (megatron-core) plus "
    "megatron-bridge in an environment that satisfies its pins (transformers<5, "
    "transformer-engine); see docs/megatron.md"
)


class MegatronNotInstalled(ImportError):
    """actor.backend megatron was asked for, but megatron-core / megatron-bridge is missing."""


def require(module: str) -> ModuleType:
    """Import `module` (e.g. `megatron.core`), or fail naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MegatronNotInstalled(
            f"actor.backend: 'megatron' needs {module!r}, which cannot be imported ({exc}); {EXTRA_HINT}"
        ) from exc
