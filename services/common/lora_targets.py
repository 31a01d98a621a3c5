"""LoRA target names: the config's vocabulary, each trainer backend's, and Megatron <-> HF.

`actor.target_modules` is written in the trainer backend's names: HF leaf names (`q_proj`, ...)
for fsdp2, Megatron's fused linear layers (`linear_qkv`, ...) for megatron, or `all-linear`
alone (or an empty list) for every linear layer but lm_head. Whatever leaves a trainer
(`LoraSpec`, PEFT directories, what vLLM and SGLang load) is in HF names.

Invariant: this module is the one place that spells these names and maps between them; config
validation, both trainers, the exporter and the rollouts ask it rather than keeping a copy.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Final, Literal, overload

Backend = Literal["fsdp2", "megatron"]

ALL_LINEAR: Final = "all-linear"
"""the config keyword for every linear layer but lm_head (peft's own spelling)"""
MEGATRON_LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's linear layers of one decoder layer: what all-linear means to megatron-bridge"""
MEGATRON_TO_HF: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
HF_TO_MEGATRON: dict[str, str] = {hf: mg for mg, hfs in MEGATRON_TO_HF.items() for hf in hfs}
HF_LINEAR = tuple(HF_TO_MEGATRON)
"""the HF leaf names Megatron's linear layers fuse: what all-linear reaches in a Qwen2/Qwen3 decoder"""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""the ranks vLLM's --max-lora-rank accepts"""


def problems(targets: Sequence[str], backend: Backend) -> list[str]:
    """Every problem with `actor.target_modules` for `backend`, as config messages; empty: usable."""
    names, out = list(targets), []
    if ALL_LINEAR in names and len(names) > 1:
        out.append(
            f"actor.target_modules: {names} mixes {ALL_LINEAR!r} with explicit names; "
            f"use [{ALL_LINEAR}] (or []) alone, or list the modules"
        )
    for name in names:
        if not name.strip():
            out.append(f"actor.target_modules: {name!r} is empty; remove it")
        elif name == ALL_LINEAR:
            continue
        elif backend == "fsdp2" and name in MEGATRON_TO_HF:
            hf = ", ".join(MEGATRON_TO_HF[name])
            out.append(
                f"actor.target_modules: {name!r} is a Megatron module name, but actor.backend "
                f"fsdp2 wraps HF modules; use {hf} instead"
            )
        elif backend == "megatron" and name not in MEGATRON_TO_HF:
            if name in HF_TO_MEGATRON:
                fix = f"use {HF_TO_MEGATRON[name]!r} (Megatron fuses it with its siblings)"
            else:
                close = difflib.get_close_matches(name, MEGATRON_LINEAR, n=1)
                fix = (f"did you mean {close[0]!r}? " if close else "") + (
                    f"allowed: {', '.join(MEGATRON_LINEAR)} or {ALL_LINEAR}"
                )
            out.append(
                f"actor.target_modules: {name!r} is not a Megatron linear layer for actor.backend megatron; {fix}"
            )
    return out


@overload
def for_backend(targets: Sequence[str], backend: Literal["megatron"]) -> list[str]: ...
@overload
def for_backend(targets: Sequence[str], backend: Backend) -> list[str] | Literal["all-linear"]: ...
def for_backend(targets: Sequence[str], backend: Backend) -> list[str] | Literal["all-linear"]:
    """`actor.target_modules` as the backend's LoRA takes them, duplicates dropped.

    peft (fsdp2) understands "all-linear" and resolves it against the model; megatron-bridge's
    `LoRA` takes explicit names, so there all-linear becomes `MEGATRON_LINEAR`. A name the backend
    does not have raises ValueError with the messages of `problems`."""
    found = problems(targets, backend)
    if found:
        raise ValueError("\n".join(found))
    names = list(dict.fromkeys(targets))
    if not names or names == [ALL_LINEAR]:
        return list(MEGATRON_LINEAR) if backend == "megatron" else ALL_LINEAR
    return names


def to_hf(targets: Sequence[str]) -> list[str]:
    """The HF leaf names an adapter trained on `targets` touches, sorted.

    Megatron names become the modules they fuse (`linear_qkv` -> k/q/v_proj); HF names pass
    through, so a `LoraSpec` written either way maps to the same list; empty or all-linear is
    every name of `HF_LINEAR`. Any other name raises ValueError."""
    names = list(targets)
    if not names or names == [ALL_LINEAR]:
        return sorted(HF_LINEAR)
    out: set[str] = set()
    for name in names:
        if name in MEGATRON_TO_HF:
            out.update(MEGATRON_TO_HF[name])
        elif name in HF_TO_MEGATRON:
            out.add(name)
        else:
            raise ValueError(
                f"actor.target_modules: {name!r} is neither a Megatron linear layer "
                f"({', '.join(MEGATRON_LINEAR)}) nor an HF one ({', '.join(HF_LINEAR)}); "
                f"use those names or [{ALL_LINEAR}]"
            )
    return sorted(out)
