"""AReaL's allocation strings (`fsdp:d4`, `vllm:d4p1t1`, `megatron:(attn:d1p6t1c1|ffn:d1p6t1e1)`)
and what they become: the trainer's backend, ranks and Megatron sizes, the rollout engine, its
replicas and each server's tensor/pipeline size.

Every parallelism lorabus's engines lack (context, expert tensor, FSDP with t/p/e) is a problem
naming the string, never a size dropped. Megatron: ranks = D x T x P of the string (the attention
side of the hybrid MoE syntax, whose ffn side must describe as many ranks); which T x P x E grids
the engine runs is `services.config.megatron_layout`'s to say.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from services.config.areal.translator import Row, Translator, set_at

_DIMS = re.compile(r"([a-z])(\d+)")


@dataclass(frozen=True)
class Alloc:
    backend: str
    dims: dict[str, int]
    """d t p c e (attention side for the hybrid MoE syntax)"""
    ffn: dict[str, int] | None = None


def parse_alloc(text: str) -> Alloc:
    """`backend[:name]:dims` as AReaL's grammar has it, for one engine."""
    m = re.fullmatch(r"\s*([a-z]+)(?:\[\w+\])?\s*:\s*(.+?)\s*", text)
    if not m:
        raise ValueError("is not <backend>:<dims> (e.g. fsdp:d4, vllm:d2t2)")
    backend, rest = m.groups()
    hybrid = re.fullmatch(r"\(?\s*attn\s*:\s*([a-z0-9]+)\s*\|\s*ffn\s*:\s*([a-z0-9]+)\s*\)?", rest)
    if hybrid:
        return Alloc(backend, _dims(hybrid.group(1), "cdtp"), _dims(hybrid.group(2), "detp"))
    return Alloc(backend, _dims(rest.replace(" ", ""), "dtpce"))


def _dims(text: str, allowed: str) -> dict[str, int]:
    if not text or _DIMS.sub("", text):
        raise ValueError(f"has dimensions {text!r}; write letters {', '.join(allowed)} each with a size")
    out: dict[str, int] = {}
    for letter, size in _DIMS.findall(text):
        if letter not in allowed:
            raise ValueError(f"dimension {letter!r} is not one of {', '.join(allowed)}")
        out[letter] = int(size)
    return out


def backends(x: Translator) -> None:
    actor, rollout = x.get("actor.backend"), x.get("rollout.backend")
    if x.has("allocation_mode"):
        # AReaL's deprecated single string, e.g. "sglang:d4+fsdp:d4"; per-engine fields win
        parts = str(x.get("allocation_mode")).split("+")
        infer = [p for p in parts if p.strip().startswith(("sglang", "vllm"))]
        train = [p for p in parts if p not in infer]
        rollout = rollout if rollout is not None else (infer[0] if infer else None)
        actor = actor if actor is not None else (train[0] if train else None)
        x.noop("allocation_mode", "read as actor.backend / rollout.backend where those are unset")
    _train_alloc(x, actor)
    _infer_alloc(x, rollout)


def _alloc(x: Translator, key: str, text: Any, examples: str) -> Alloc | None:
    """The allocation string `text` given for `key`, parsed and marked used; None: reported."""
    if text is None:
        x.t.problems.append(f"{key}: missing; AReaL requires it (e.g. {examples})")
        return None
    try:
        a = parse_alloc(str(text))
    except ValueError as e:
        if key in x.flat:
            x.refuse(key, str(e))
        else:  # a part of the deprecated allocation_mode: name the string the user wrote
            x.t.problems.append(f"allocation_mode: {x.get('allocation_mode')!r}: its part {str(text).strip()!r} {e}")
        return None
    x.used.add(key)
    return a


def _train_alloc(x: Translator, text: Any) -> None:
    key = "actor.backend"
    if (a := _alloc(x, key, text, "fsdp:d4 or megatron:d2t2")) is None:
        return
    d = a.dims
    dp, tp, pp, cp, ep = (d.get(k, 1) for k in "dtpce")
    if a.ffn is not None:
        ep = a.ffn.get("e", 1)
        etp, fpp = a.ffn.get("t", 1), a.ffn.get("p", 1)
        if etp != 1:
            x.t.problems.append(
                f"{key}: {text!r} has expert tensor parallelism t{etp}; lorabus's Megatron engine has none (use ffn t1)"
            )
        if fpp != pp:
            x.t.problems.append(f"{key}: {text!r} has attn p{pp} but ffn p{fpp}; they must be equal")
        attn_world, ffn_world = dp * tp * pp * cp, a.ffn.get("d", 1) * etp * fpp * ep
        if attn_world != ffn_world:
            # both sides describe the same ranks (AReaL's hybrid MoE grid)
            x.t.problems.append(
                f"{key}: {text!r} has attn d*t*p*c = {attn_world} ranks but ffn d*t*p*e = {ffn_world}; "
                "they must be equal (the ffn's d is the expert-data-parallel size)"
            )
    if cp != 1:
        x.t.problems.append(f"{key}: {text!r} has context parallelism c{cp}; lorabus's engines have none (use c1)")
    if a.backend == "fsdp":
        if tp != 1 or pp != 1 or ep != 1:
            x.t.problems.append(
                f"{key}: {text!r}: lorabus's FSDP2 engine shards data-parallel only "
                "(use fsdp:dN, or megatron: for tensor parallelism)"
            )
        set_at(x.t.tree, "actor.backend", "fsdp2")
        world = dp
        became = f"actor.backend = 'fsdp2', actor.nproc_per_node = {world}"
    elif a.backend == "megatron":
        set_at(x.t.tree, "actor.backend", "megatron")
        for name, size in (("tensor", tp), ("pipeline", pp), ("expert", ep)):
            set_at(x.t.tree, f"actor.megatron.{name}_model_parallel_size", size)
            x.t.origin[f"actor.megatron.{name}_model_parallel_size"] = key
        world = dp * tp * pp
        became = (
            f"actor.backend = 'megatron', actor.nproc_per_node = {world}, "
            f"actor.megatron tensor/pipeline/expert sizes {tp}/{pp}/{ep}"
        )
    else:
        x.t.problems.append(
            f"{key}: {text!r}: backend {a.backend!r} is not supported; lorabus trains with fsdp or megatron"
        )
        return
    set_at(x.t.tree, "actor.nproc_per_node", world)
    x.t.origin.update({"actor.backend": key, "actor.nproc_per_node": key})
    x.t.rows.append(Row(key, text, became, "one trainer process per GPU, under torchrun when > 1"))


def _infer_alloc(x: Translator, text: Any) -> None:
    key = "rollout.backend"
    if (a := _alloc(x, key, text, "sglang:d4 or vllm:d2t2")) is None:
        return
    if a.backend not in ("sglang", "vllm"):
        x.t.problems.append(f"{key}: {text!r}: backend {a.backend!r} is not an inference server; use sglang or vllm")
        return
    bad = set(a.dims) - set("dtp")
    if bad or a.ffn is not None:
        x.t.problems.append(f"{key}: {text!r}: inference takes d, t and p only")
        return
    dp, tp, pp = (a.dims.get(k, 1) for k in "dtp")
    set_at(x.t.tree, "rollout.engine", a.backend)
    set_at(x.t.tree, "rollout.replicas", dp)
    x.t.origin.update({"rollout.engine": key, "rollout.replicas": key})
    flags: list[str] = []
    if a.backend == "vllm":
        flags = ([f"--tensor-parallel-size={tp}"] if tp > 1 else []) + (
            [f"--pipeline-parallel-size={pp}"] if pp > 1 else []
        )
    else:
        flags = ([f"--tp-size={tp}"] if tp > 1 else []) + ([f"--pp-size={pp}"] if pp > 1 else [])
    x.server_flags = flags
    x.t.rows.append(
        Row(
            key,
            text,
            f"rollout.engine = {a.backend!r}, rollout.replicas = {dp}"
            + (f", {a.backend}.extra_args += {flags}" if flags else ""),
            "one rollout sidecar per server; each server spans t*p GPUs",
        )
    )
