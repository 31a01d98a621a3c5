"""Time a slot pool's group forwards shape by shape, and choose the fused kernel's tiles.

A model's groups come in a few shapes (Qwen2: q/k/v, o, gate/up, down), each repeated once per
decoder layer. For every shape, one captured CUDA graph runs the forwards of that shape's groups
in every layer, so that weights come from HBM as in a decode step rather than from L2, under:
  matmul        no row corrected: the layer's cuBLAS matmul alone (the head-only cost)
  two_kernels   cuBLAS + the split-K shrink on a side stream + the expand (`correction="triton"`)
  torch         cuBLAS + the torch reference correction, shrink on the side stream
  stacked       one cuBLAS matmul over W with the slots' A rows stacked under it, then one
                expand kernel (`correction="stacked"`)
  fused <tiles> `lora_kernels.linear_fused` with those tiles, one kernel per group
and reports microseconds per group forward (median of the replays). `tune` writes the fastest
of them for each shape into `lora_kernels.TUNED` (what `correction="auto"` then runs).
On CPU (`--tiny` under TRITON_INTERPRET=1) each forward runs once, eagerly: a smoke run of the
same code, whose figures mean nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch

from services.rollout import lora_kernels
from services.rollout.lora_kernels import Choice, FusedConfig, Key
from services.rollout.lora_slots import LoraSlots, SlotGroup

TILES = [(16, 128, 4, 3), (16, 256, 4, 2), (32, 64, 4, 4), (32, 128, 4, 2), (32, 128, 4, 4), (64, 64, 4, 3),
         (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)]  # fmt: skip
"""(columns, input features, warps, stages) per candidate; rows come from the batch. Stages are
cut to what shared memory holds; those of 112 KB or less let two programs share a
multiprocessor."""

PATHS: dict[str, Choice] = {"two_kernels": "triton", "torch": "torch", "stacked": "stacked"}
"""the measured variants that are not fused tiles, by the name they are reported under"""


def label(config: FusedConfig) -> str:
    return f"fused {config.bm}x{config.bn}x{config.bk} w{config.warps} s{config.stages}"


def candidates(rows: int, n: int, sr: int) -> list[FusedConfig]:
    """The heuristic's tiles first, then the grid of TILES at the heuristic's row block."""
    first = lora_kernels.default_config(rows, n, sr)
    out = [first]
    for bn, bk, warps, stages in TILES:
        config = lora_kernels.with_stages(FusedConfig(first.bm, bn, bk, warps), sr, budget=200 * 1024)
        config = config._replace(stages=min(stages, config.stages))
        if config not in out:
            out.append(config)
    return out


def shapes(slots: LoraSlots) -> dict[str, list[SlotGroup]]:
    """Groups by shape, named after the first layer's members (e.g. 'q_proj+k_proj+v_proj')."""
    names: dict[int, list[str]] = {}
    for path, layer in slots.layers.items():
        names.setdefault(id(layer.group), []).append(path.rsplit(".", 1)[-1])
    by_shape: dict[tuple[int, int, int], list[SlotGroup]] = {}
    for group in slots.groups:
        by_shape.setdefault((group.segs[-1], group.in_features, len(group.segs) - 1), []).append(group)
    return {"+".join(names[id(groups[0])]): groups for groups in by_shape.values()}


def time_forwards(groups: Sequence[SlotGroup], x: torch.Tensor, capture: bool, replays: int = 10) -> float:
    """Microseconds per group forward: one graph holding every group's forward, replayed."""
    if not capture:
        t0 = time.perf_counter()
        for group in groups:
            group._forward(x)
        return 1e6 * (time.perf_counter() - t0) / len(groups)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for group in groups:
            group._forward(x)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return 1000 * statistics.median(times) / len(groups)


STACKED_TILES = [(32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8)]
"""(columns, warps) per `expand_stacked` program, the candidates of `sweep_stacked`"""


def sweep_stacked(slots: LoraSlots, mix: Sequence[int], device: torch.device, capture: bool) -> dict:
    """Time the stacked correction of every shape under each of STACKED_TILES and keep the
    tiles with the lowest sum over the shapes (one decoder layer's cost) in lora_kernels."""
    rows = len(mix)
    was = slots.routing.correction
    by_tile: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    try:
        slots.routing.correction = "stacked"
        for bn, warps in STACKED_TILES:
            lora_kernels.STACKED_BN, lora_kernels.STACKED_WARPS = bn, warps
            name = f"bn{bn} w{warps}"
            us = by_tile[name] = {}
            for shape, groups in shapes(slots).items():
                x = torch.randn(rows, groups[0].in_features, device=device, dtype=groups[0].weight.dtype)
                with slots.route(mix):
                    measure(us, errors, shape, groups, x, capture, lambda: None)
    finally:
        slots.routing.correction = was
    totals = {name: sum(us.values()) for name, us in by_tile.items() if len(us) == len(shapes(slots))}
    best = min(totals, key=totals.__getitem__)
    lora_kernels.STACKED_BN, lora_kernels.STACKED_WARPS = STACKED_TILES[list(by_tile).index(best)]
    for name, total in totals.items():
        kept = "  <- kept" if name == best else ""
        print(f"stacked expand {name:<10} us per layer {total:6.1f}{kept}", flush=True)
    return {"rows": rows, "us_per_group_forward": by_tile, "us_per_layer": totals, "kept": best, "errors": errors}


class Tuning(NamedTuple):
    report: dict
    """figures (us per group forward by shape and variant), choices and errors, for the JSON"""
    chosen: dict[Key, Choice]
    """what `tune` put in `lora_kernels.TUNED`: the fastest variant of every shape"""
    best_fused: dict[Key, FusedConfig]
    """the fastest fused tiles of every shape (for a run that fuses every shape)"""


def measure(
    us: dict[str, float],
    errors: dict[str, str],
    variant: str,
    groups: Sequence[SlotGroup],
    x: torch.Tensor,
    capture: bool,
    warm: Callable[[], object],
) -> None:
    """us[variant] = the groups' time under the routing as it is set now, or an error."""
    try:
        warm()  # compiles outside the capture
        us[variant] = time_forwards(groups, x, capture)
    except Exception as e:  # a tile that does not fit must not end the tuning
        errors[variant] = f"{type(e).__name__}: {str(e)[:300]}"


def tune(slots: LoraSlots, mix: Sequence[int], device: torch.device, capture: bool) -> Tuning:
    """Time every shape under every variant for a batch on the versions `mix` (some rows off
    the head) and fill `lora_kernels.TUNED` with the choice."""
    rows, sr = len(mix), slots.table.slots * slots.rank
    was = slots.routing.correction
    report: dict = {"rows": rows, "us_per_group_forward": {}, "chosen": {}, "best_fused": {}, "errors": {}}
    chosen: dict[Key, Choice] = {}
    best_fused: dict[Key, FusedConfig] = {}
    try:
        for name, groups in shapes(slots).items():
            g0 = groups[0]
            n, k, members = g0.segs[-1], g0.in_features, len(g0.segs) - 1
            key = (rows, n, k, members, sr)
            x = torch.randn(rows, k, device=device, dtype=g0.weight.dtype)
            us: dict[str, float] = {}
            errors: dict[str, str] = {}
            report["us_per_group_forward"][name] = us
            measure(us, errors, "matmul", groups, x, capture, lambda: None)  # no route: no correction
            with slots.route(mix):
                cols = slots.routing.cols
                assert cols is not None, "tune: every row of the mix is on the head; nothing to correct"
                slots.routing.correction = "triton"
                measure(us, errors, "two_kernels", groups, x, capture,
                        lambda: lora_kernels.correct_kernel_(g0.weight.new_zeros(rows, n), x, g0._a_all, g0._bt_all,
                                                             g0._segs_dev, cols, 1))  # fmt: skip
                slots.routing.correction = "torch"
                measure(us, errors, "torch", groups, x, capture, lambda: None)
                slots.routing.correction = "stacked"
                measure(us, errors, "stacked", groups, x, capture, lambda: None)
                slots.routing.correction = "fused"
                for config in candidates(rows, n, sr):
                    lora_kernels.TUNED[key] = config
                    measure(us, errors, label(config), groups, x, capture,
                            partial(lora_kernels.linear_fused, x, g0.weight, g0.bias, g0._a_all, g0._bt_all,
                                    g0._segs_dev, cols, 1, config))  # fmt: skip
                    if label(config) in us and (
                        key not in best_fused or us[label(config)] < us[label(best_fused[key])]
                    ):
                        best_fused[key] = config
            best = best_fused.get(key)
            options = {name: path for name, path in PATHS.items() if name in us}
            if best:
                options[label(best)] = best
            if options:
                fastest = min(options, key=lambda variant: us[variant])
                chosen[key] = options[fastest]
                report["chosen"][name] = fastest
            report["best_fused"][name] = label(best) if best else None
            if errors:
                report["errors"][name] = errors
            nan = float("nan")
            print(
                f"{name:<24} us per group: matmul {us.get('matmul', nan):6.1f}, two kernels "
                f"{us.get('two_kernels', nan):6.1f}, torch {us.get('torch', nan):6.1f}, stacked "
                f"{us.get('stacked', nan):6.1f}, best fused {us[label(best)] if best else nan:6.1f} "
                f"({report['best_fused'][name]}); chosen {report['chosen'].get(name)}; {len(errors)} errors",
                flush=True,
            )
    finally:
        slots.routing.correction = was
        lora_kernels.TUNED.clear()
    lora_kernels.TUNED.update(chosen)
    return Tuning(report, chosen, best_fused)
