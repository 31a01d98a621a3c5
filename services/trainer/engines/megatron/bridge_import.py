"""Import megatron-bridge where Transformer Engine is absent, for megatron-core's local layer spec.

Invariant: after `import_bridge()`, `megatron.bridge` is imported, Transformer Engine is not in
`sys.modules` (unless it is really installed, when nothing here happens), every megatron-core and
megatron-bridge module took its own no-TE branch, and the one module that was given a placeholder
for TE, `megatron.bridge.peft.lora_layers`, is the only module that holds it.

Why: megatron-bridge 0.4-0.6.2 guard every TE import (`safe_import_from`) but one:
`peft/lora_layers.py` starts with `import transformer_engine.pytorch as te`, and `import
megatron.bridge` reaches it (AutoBridge -> model_bridge -> peft_bridge -> canonical_lora). That
module uses `te` only in `TEFusedLoRALinear` (chosen when `use_transformer_engine_op_fuser` is set)
and in two return annotations (`te.ops.Sequential`). `LoRA` on a local-spec model wraps
megatron-core's `ColumnParallelLinear` / `RowParallelLinear` in the plain `LoRALinear` and never
reaches TE. So the placeholder answers `ops.Sequential` and raises, naming the fix, on anything
else; the engine refuses the op fuser.

Second, megatron-bridge decides "TE present" by importing TE class names from megatron-core's
`extensions.transformer_engine`, which without TE still defines them (on a MagicMock base, or as
None for the grouped linears), so `peft.utils.HAVE_TE` comes out True and `LoRA` crashes with
`isinstance(m, None)` on the first local linear. `import_bridge` sets those flags to the truth.

Third, on Python 3.11 (outside megatron-bridge's declared >=3.12, which the CPU tests and `lorabus
up` on a 3.11 venv use) `typing.override` is given typing_extensions' before the import:
megatron-core 0.19's `megatron.training.models` (reached by `import megatron.bridge`) imports it
from `typing`, and nothing else in either package needs 3.12.

How: the placeholder cannot simply sit in `sys.modules` while megatron-bridge imports (megatron-core
modules imported on the way would then see "TE installed" and break). Instead megatron-core's
modules that lora_layers needs, and lora_layers' own megatron-bridge imports, are imported first,
under the real, not yet executed `megatron.bridge` package object; lora_layers alone is imported
with the placeholder present; the placeholder is removed; then the package's `__init__` runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import typing

from services.trainer.engines.megatron.deps import require

TE_MODULES = ("transformer_engine", "transformer_engine.pytorch")
PLACEHOLDER_USER = "megatron.bridge.peft.lora_layers"
# lora_layers' imports (megatron-bridge 0.6.2), loaded before it without the placeholder
LORA_LAYERS_DEPS = (
    "megatron.core.transformer.moe.moe_utils",
    "megatron.bridge.peft.adapter_wrapper",
    "megatron.bridge.peft.lora_merge",
)
TE_HINT = (
    "Transformer Engine is not installed; the lorabus Megatron engine uses megatron-core's local "
    "layer spec without it (install transformer-engine[pytorch] to use TE layers)"
)


class TransformerEngineAbsent(RuntimeError):
    """Code reached a Transformer Engine feature through the import placeholder."""


class _Unavailable:
    """What `te.ops.Sequential` is when TE is absent: fine in an annotation, an error when used."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TransformerEngineAbsent(f"transformer_engine.pytorch.ops.Sequential: {TE_HINT}")


def _placeholder() -> tuple[types.ModuleType, types.ModuleType]:
    def missing(module: str):
        def absent(name: str) -> object:
            # AttributeError (not TransformerEngineAbsent) so that hasattr/safe_import_from say "absent"
            raise AttributeError(f"{module}.{name}: {TE_HINT}")

        return absent

    root = types.ModuleType("transformer_engine", "lorabus placeholder: Transformer Engine is not installed")
    root.__path__ = []
    root.__getattr__ = missing("transformer_engine")  # type: ignore[method-assign]
    pytorch = types.ModuleType("transformer_engine.pytorch", root.__doc__)
    pytorch.__path__ = []
    pytorch.ops = types.SimpleNamespace(Sequential=_Unavailable)  # type: ignore[attr-defined]
    pytorch.__getattr__ = missing("transformer_engine.pytorch")  # type: ignore[method-assign]
    root.pytorch = pytorch  # type: ignore[attr-defined]
    return root, pytorch


def have_transformer_engine() -> bool:
    if any(isinstance(sys.modules.get(m), types.ModuleType) and _is_placeholder(sys.modules[m]) for m in TE_MODULES):
        return False
    return importlib.util.find_spec("transformer_engine") is not None


def _is_placeholder(module: types.ModuleType) -> bool:
    return (module.__doc__ or "").startswith("lorabus placeholder")


# megatron-bridge modules whose module-level TE flags are read at call time (0.6.2)
TE_FLAGS = {
    "megatron.bridge.peft.utils": ("HAVE_TE",),
    "megatron.bridge.peft.module_matcher": (
        "HAVE_TE",
        "HAVE_TE_COL_LINEAR",
        "HAVE_TE_LN_COL_LINEAR",
        "HAVE_TE_ROW_LINEAR",
    ),
}


def _flags_say_no_te() -> None:
    for module, flags in TE_FLAGS.items():
        mod = importlib.import_module(module)
        for flag in flags:
            if not hasattr(mod, flag):
                raise RuntimeError(
                    f"{module}.{flag}: not defined in this megatron-bridge version; lorabus cannot "
                    "tell its LoRA that Transformer Engine is absent: use megatron-bridge 0.6.2 or "
                    "install transformer-engine"
                )
            setattr(mod, flag, False)


def _typing_override() -> None:
    """`typing.override` on Python < 3.12, from typing_extensions (a no-op decorator either way)."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]


def import_bridge() -> types.ModuleType:
    """`megatron.bridge`, imported as described above; idempotent."""
    if "megatron.bridge" in sys.modules:  # imported whole (a failed import is removed below)
        return sys.modules["megatron.bridge"]
    _typing_override()
    require("megatron.core")
    if have_transformer_engine():
        return require("megatron.bridge")
    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None or spec.loader is None:
        return require("megatron.bridge")  # raises MegatronNotInstalled naming the extra
    package = importlib.util.module_from_spec(spec)
    sys.modules["megatron.bridge"] = package
    try:
        for name in LORA_LAYERS_DEPS:
            importlib.import_module(name)
        before = set(sys.modules)
        root, pytorch = _placeholder()
        sys.modules.update({"transformer_engine": root, "transformer_engine.pytorch": pytorch})
        try:
            importlib.import_module(PLACEHOLDER_USER)
        finally:
            for name in TE_MODULES:
                sys.modules.pop(name, None)
        new = set(sys.modules) - before - set(TE_MODULES)
        if new != {PLACEHOLDER_USER}:
            raise RuntimeError(
                f"megatron-bridge: importing {PLACEHOLDER_USER} with the TE placeholder also imported "
                f"{sorted(new - {PLACEHOLDER_USER})[:5]}; this megatron-bridge version imports more "
                "than lorabus expects: add them to LORA_LAYERS_DEPS, or install transformer-engine"
            )
        spec.loader.exec_module(package)
        _flags_say_no_te()
    except BaseException:
        for name in [n for n in sys.modules if n == "megatron.bridge" or n.startswith("megatron.bridge.")]:
            del sys.modules[name]
        raise
    return package
