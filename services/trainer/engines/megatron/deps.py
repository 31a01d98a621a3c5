"""The optional Megatron stack: one place that imports it and says how to get it."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA_HINT = (
    "install megatron-core and megatron-bridge without their dependencies: `pip install --no-deps "
    "megatron-bridge==0.6.2 megatron-core==0.19.2` (Python 3.12, transformers 5.8-5.17; "
    "Transformer Engine optional), as `make megatron-env` and "
    "benchmarks/device/megatron-bridge-site.sh do (`lorabus[megatron]` alone brings megatron-core); "
    "see docs/megatron.md"
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
