"""The Megatron engine's parallel layouts: which grids the config accepts, and the whole adapter
put together from pipeline stages, expert ranks and tensor-parallel slices (pure tensor code)."""

from __future__ import annotations

import pytest
import torch

from services.config.megatron_layout import layout_problems, model_problems
from services.config.schema import MegatronConfig
from services.trainer.engines.megatron.layout import assemble, globalize, layer_offset
from services.trainer.engines.megatron.state import AdapterStateError, merge_tp, tp_split

QKV_IN = "decoder.layers.{}.self_attention.linear_qkv.adapter.linear_in.weight"
EXPERT_OUT = "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.adapter.linear_out.weight"


def mc(tp: int = 1, pp: int = 1, ep: int = 1) -> MegatronConfig:
    return MegatronConfig(
        bridge_type="megatron-bridge",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )


def test_layouts_megatron_core_and_the_engine_run_are_accepted():
    assert layout_problems(mc(pp=6), 6) == []
    assert layout_problems(mc(tp=2, pp=2), 8) == []  # d2 t2 p2
    assert layout_problems(mc(ep=2), 2) == []  # experts split over two data-parallel replicas
    assert layout_problems(mc(pp=2, ep=2), 4) == []


def test_layouts_that_cannot_run_name_the_field_and_the_fix():
    (p,) = layout_problems(mc(pp=6), 4)
    assert p.startswith("actor.nproc_per_node: 4 is not a multiple of tensor x pipeline size 1 x 6 = 6;")
    (p,) = layout_problems(mc(pp=2, ep=3), 4)
    assert p.startswith("actor.megatron.expert_model_parallel_size: 3 does not fit 4 ranks")
    assert "use an expert size dividing 2" in p
    (p,) = layout_problems(mc(tp=2, ep=2), 4)
    assert "expert adapters under tensor parallelism are not supported" in p
    (p,) = layout_problems(mc(pp=0), 1)
    assert p == "actor.megatron.pipeline_model_parallel_size: 0 must be >= 1"
    (p,) = model_problems(mc(pp=3), layers=4, experts=None)
    assert p.startswith("actor.megatron.pipeline_model_parallel_size: 3 does not divide the model's 4 layers")
    (p,) = model_problems(mc(ep=2), layers=4, experts=None)
    assert "is a dense model" in p
    (p,) = model_problems(mc(ep=3), layers=4, experts=4)
    assert "does not divide the model's 4 experts" in p


def test_stage_and_expert_rank_names_become_the_full_models():
    state = {QKV_IN.format(0): torch.ones(1), EXPERT_OUT.format(1, 0): torch.zeros(1)}
    out = globalize(state, layer_offset=2, expert_offset=4)
    assert sorted(out) == sorted([QKV_IN.format(2), EXPERT_OUT.format(3, 4)])
    # Float16Module's prefix is stripped before this; an unnumbered name passes unchanged
    assert globalize({"output_layer.weight": torch.ones(1)}, 2) == {"output_layer.weight": torch.ones(1)}


def test_layer_offset_reads_megatron_cores_global_layer_numbers():
    assert layer_offset([3, 4]) == 2
    with pytest.raises(AdapterStateError, match="not contiguous"):
        layer_offset([1, 3])
    with pytest.raises(AdapterStateError, match="holds no transformer layer"):
        layer_offset([])


def test_assemble_joins_stages_takes_replicas_once_and_merges_tp_slices():
    g = torch.Generator().manual_seed(0)
    full = {QKV_IN.format(i): torch.randn(4, 6, generator=g) for i in range(4)}
    parts = []
    for stage in range(2):  # pp 2 x tp 2, each grid point twice (a data-parallel replica)
        for tp_rank in range(2):
            mine = {n: tp_split(n, t, 2)[tp_rank] for n, t in full.items() if int(n.split(".")[2]) // 2 == stage}
            parts += [(tp_rank, mine), (tp_rank, {n: t.clone() for n, t in mine.items()})]
    got = assemble(parts, tp_size=2)
    assert got.keys() == full.keys() and all(torch.equal(got[n], full[n]) for n in full)
    assert merge_tp([assemble(parts[:1], 1)]).keys() == {QKV_IN.format(0), QKV_IN.format(1)}


def test_replicas_that_drifted_apart_are_an_error():
    a = {QKV_IN.format(0): torch.zeros(2, 2)}
    b = {QKV_IN.format(0): torch.ones(2, 2)}
    with pytest.raises(AdapterStateError, match="two replicas of TP rank 0 hold different values"):
        assemble([(0, a), (0, b)], tp_size=1)
