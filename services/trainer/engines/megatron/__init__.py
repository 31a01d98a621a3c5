"""The Megatron trainer engine (megatron-core + megatron-bridge LoRA).

The pure parts (`state`, `optim`, `step`, `checkpoint`) import without Megatron, so that the
exporter, the benchmarks and the CPU tests can use them; `MegatronEngine` is resolved lazily
and raises `MegatronNotInstalled` (naming the `lorabus[megatron]` extra) when megatron-core or
megatron-bridge is missing.
"""

from __future__ import annotations

from services.trainer.engines.megatron.deps import EXTRA_HINT, MegatronNotInstalled

__all__ = ["EXTRA_HINT", "MegatronEngine", "MegatronNotInstalled"]


def __getattr__(name: str) -> type:
    if name == "MegatronEngine":
        from services.trainer.engines.megatron.engine import MegatronEngine

        return MegatronEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
