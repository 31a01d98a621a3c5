"""The Megatron engine's parallel layout: which tensor x pipeline x expert grids it runs.

Invariant: a layout this module accepts is one megatron-core's `initialize_model_parallel`
accepts for that many ranks and the lorabus Megatron engine trains and publishes; every other
one is a problem `field: value, problem; fix` before any process starts (the config loader
passes `actor.nproc_per_node`, the engine its real world size).

The grid, as docs/from-areal.md gives AReaL's allocation strings: ranks = D x T x P (data,
tensor, pipeline); the expert-parallel size E splits the MoE layers' experts over ranks that
are data-parallel replicas of the dense layers, so E x T x P must divide the ranks too
(megatron-core's expert grid, with the expert tensor size equal to T). What the engine lacks:
expert adapters under tensor parallelism (`state.merge_tp` refuses them). What the model must
allow (its depth divisible by P, its expert count by E) is checked by the engine once the
model's config is read.
"""

from __future__ import annotations

from services.config.schema import MegatronConfig

SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


def layout_problems(m: MegatronConfig, world: int, world_field: str = "actor.nproc_per_node") -> list[str]:
    out = [
        f"actor.megatron.{name}: {getattr(m, name)} must be >= 1"
        for name in SIZES
        if not isinstance(getattr(m, name), int) or getattr(m, name) < 1
    ]
    if out:
        return out
    tp, pp, ep = (getattr(m, name) for name in SIZES)
    if world % (tp * pp):
        out.append(
            f"{world_field}: {world} is not a multiple of tensor x pipeline size {tp} x {pp} = {tp * pp}; "
            f"ranks are data x tensor x pipeline (set it to a multiple of {tp * pp}, or change the sizes)"
        )
    elif world % (ep * tp * pp):
        out.append(
            f"actor.megatron.expert_model_parallel_size: {ep} does not fit {world} ranks: expert x tensor "
            f"x pipeline = {ep * tp * pp} must divide them (experts are split over data-parallel "
            f"replicas); use an expert size dividing {world // (tp * pp)}"
        )
    if ep > 1 and tp > 1:
        out.append(
            f"actor.megatron.expert_model_parallel_size: {ep} with tensor_model_parallel_size {tp}: "
            "expert adapters under tensor parallelism are not supported by the lorabus Megatron "
            "engine; use tensor_model_parallel_size 1 with expert parallelism"
        )
    return out


def model_problems(m: MegatronConfig, layers: int, experts: int | None) -> list[str]:
    """What the model read from actor.path allows (megatron-core splits evenly here)."""
    out = []
    pp, ep = m.pipeline_model_parallel_size, m.expert_model_parallel_size
    if layers % pp:
        out.append(
            f"actor.megatron.pipeline_model_parallel_size: {pp} does not divide the model's {layers} "
            "layers (megatron-core gives every stage the same depth); use a divisor of the depth"
        )
    if ep > 1 and not experts:
        out.append(
            f"actor.megatron.expert_model_parallel_size: {ep}, but actor.path is a dense model "
            "(no experts to split); use 1"
        )
    elif experts and experts % ep:
        out.append(
            f"actor.megatron.expert_model_parallel_size: {ep} does not divide the model's {experts} "
            "experts; use a divisor of the expert count"
        )
    return out
