"""An inference server's AReaL section (`vllm:` or `sglang:`) as a table: the fields copied under
the same name, the LoRA list lorabus fills itself, and the fields passed to the server as
command-line flags. Only the section of the engine in use is translated; the other has no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.config.areal.translator import Row, Translator, set_at


@dataclass(frozen=True)
class Server:
    """How one inference server's AReaL section translates."""

    label: str
    """the server's name in a reason (vLLM, SGLang)"""
    fields: tuple[tuple[str, Any], ...]
    """(name, AReaL's default or ... for none) copied under the same name"""
    auto: str
    """the LoRA list lorabus fills in itself"""
    flags: tuple[tuple[str, str], ...]
    """(name, command-line flag) passed through as `flag=value` where set"""
    switches: tuple[tuple[str, str], ...] = ()
    """(name, command-line flag) passed as the bare flag where true"""


SERVERS = {
    "vllm": Server(
        "vLLM",
        (
            ("model", ...),
            ("dtype", ...),
            ("max_model_len", ...),
            ("enable_lora", ...),
            ("max_lora_rank", 16),
            ("max_loras", 8),
        ),
        "lora_modules",
        (
            ("seed", "--seed"),
            ("gpu_memory_utilization", "--gpu-memory-utilization"),
            ("max_num_seqs", "--max-num-seqs"),
            ("block_size", "--block-size"),
        ),
        (("enforce_eager", "--enforce-eager"),),
    ),
    "sglang": Server(
        "SGLang",
        (
            ("model_path", ...),
            ("enable_lora", ...),
            ("max_lora_rank", ...),
            ("max_loaded_loras", 8),
            ("lora_backend", "triton"),
        ),
        "lora_paths",
        (
            ("random_seed", "--random-seed"),
            ("dtype", "--dtype"),
            ("context_length", "--context-length"),
            ("mem_fraction_static", "--mem-fraction-static"),
            ("max_running_requests", "--max-running-requests"),
        ),
    ),
}


def servers(x: Translator) -> None:
    engine = x.t.tree.get("rollout", {}).get("engine")
    if engine not in SERVERS:
        return
    s, server = engine, SERVERS[engine]
    flags: list[str] = list(x.server_flags)
    for name, default in server.fields:
        x.to(f"{s}.{name}", f"{s}.{name}", default=default)
    x.noop(f"{s}.{server.auto}", "auto-filled with {lora_name}-v0, as in AReaL")
    for name, flag in server.flags:
        if x.get(f"{s}.{name}") is not None:
            flags.append(f"{flag}={x.get(f'{s}.{name}')}")
            x.t.rows.append(Row(f"{s}.{name}", x.get(f"{s}.{name}"), f"{s}.extra_args += {flags[-1]}"))
            x.used.add(f"{s}.{name}")
        x.noop(f"{s}.{name}", f"unset: {server.label}'s default")
    for name, flag in server.switches:
        if x.get(f"{s}.{name}"):
            flags.append(flag)
            x.t.rows.append(Row(f"{s}.{name}", True, f"{s}.extra_args += {flag}"))
        x.used.add(f"{s}.{name}")
    x.noop(s, f"server tuning lorabus passes through only for the fields above; the rest are {server.label}'s defaults")
    for other in SERVERS:
        if other != s:
            x.noop(other, f"rollout.backend is {s}")
    set_at(x.t.tree, f"{s}.extra_args", flags)
