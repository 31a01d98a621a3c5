"""Timing on the CPU or a CUDA device, the one way every benchmark takes it.

Invariant: a clock is read only once the device's queued work is done (`sync` before and after),
so a CUDA figure is the work's time and never just its launch; medians are reported in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn()` takes on `device`, its queued work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median_ms(seconds: Iterable[float]) -> float:
    return statistics.median(seconds) * 1e3


def device_name(device: torch.device) -> str:
    """The GPU's name for a results file, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def tiny_or_cuda(tiny: bool) -> tuple[torch.device, torch.dtype] | None:
    """Where an engine benchmark runs: the CPU in float32 with `--tiny`, else the GPU in bf16;
    None, said on stderr, where `--tiny` is missing and there is no GPU."""
    if not tiny and not torch.cuda.is_available():
        print("no CUDA device: use --tiny for a CPU run", file=sys.stderr)
        return None
    return (torch.device("cpu"), torch.float32) if tiny else (torch.device("cuda"), torch.bfloat16)


def write_results(path: Path, device: torch.device, args: argparse.Namespace, results: dict) -> None:
    """The results file: the device, torch, every argument and the results."""
    out = {"device": device_name(device), "torch": torch.__version__, **vars(args) | {"out": str(path)}, **results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


def one_way(name: str, seconds: float, tokens: int, **extra: float) -> dict:
    """One way's figures (its new tokens in `seconds`, and `extra`), printed as one line."""
    more = "".join(f", {k.replace('_', ' ')} {v}" for k, v in extra.items())
    print(f"{name:>10}: {tokens:,} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s{more}", flush=True)
    return {"seconds": round(seconds, 3), "new_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1), **extra}


def two_ways(results: dict, new: str, old: str, tokens: dict[str, list]) -> dict:
    """Adds to `results` whether way `new` sampled the same tokens as way `old` (each a list of
    samples' token ids, same seeds, same order), the share of identical samples and `new`'s
    tokens per second over `old`'s, and prints them."""
    agree = [a == b for a, b in zip(tokens[new], tokens[old], strict=True)]
    results["same_tokens"] = all(agree)
    results["identical_samples"] = round(sum(agree) / len(agree), 3)
    ratio = results[f"{new}_vs_{old}"] = round(results[new]["tokens_per_s"] / results[old]["tokens_per_s"], 3)
    print(f"{new} / {old}: {ratio:.3f}; identical samples: {results['identical_samples']:.1%}")
    return results
