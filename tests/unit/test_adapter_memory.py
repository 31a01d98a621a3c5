"""A run's adapter memory (services/common/adapter_memory.py) against what the trainer really
allocates: peft's LoRA parameters on tiny Llama/Qwen2/Qwen3 models built from their configs,
with the trainer's own wrapping (fp32 masters) and optimizer, after one step; and the budget
check over a fleet's live runs."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from services.common import adapter_memory, base_config
from services.config import runconfig
from services.config.loader import ConfigError, backfill, load_config
from services.config.schema import LorabusConfig
from services.trainer import lora
from services.trainer.engines.base import make_optimizer
from tests.fixtures.tiny import tiny_qwen2, tiny_qwen3

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"


def cfg(run: str, rank: int = 8, targets: list[str] | None = None, optimizer: str = "adamw", **fleet) -> LorabusConfig:
    tree = {
        "run": run,
        "actor": {"lora_rank": rank, "target_modules": targets or [], "optimizer": {"type": optimizer}},
        "fleet": fleet,
    }
    return backfill(msgspec.convert(tree, LorabusConfig))


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))


MODELS = {
    "llama (examples/tiny)": (tiny_llama, lambda: json.loads((TINY / "config.json").read_text())),
    "qwen2 (kv heads < heads)": (tiny_qwen2, lambda: tiny_qwen2().config.to_dict()),
    "qwen3 (head_dim set)": (tiny_qwen3, lambda: tiny_qwen3().config.to_dict()),
}
SHAPES = [
    (8, []),
    (4, ["q_proj", "v_proj"]),
    (2, ["o_proj", "down_proj"]),
    (16, ["all-linear"]),
    (3, ["gate_proj", "up_proj", "lm_head"]),
]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize(("rank", "targets"), SHAPES)
def test_parameters_equal_peft_lora_on_the_model(model, rank, targets):
    build, config = MODELS[model]
    run = cfg("r", rank, targets)
    wrapped = lora.wrap_lora(build(), run.actor)
    expected = sum(p.numel() for _, p in lora.lora_parameters(wrapped))
    got = adapter_memory.run_memory(run, adapter_memory.base_shape(config()))
    assert got.params == expected


@pytest.mark.parametrize(("optimizer", "moments"), [("adamw", 2), ("adam", 2), ("sgd", 0)])
def test_bytes_equal_the_trainers_masters_grads_and_optimizer_state_after_a_step(optimizer, moments):
    run = cfg("r", 4, ["q_proj", "v_proj", "down_proj"], optimizer)
    model = lora.wrap_lora(tiny_llama(), run.actor)
    params = [p for _, p in lora.lora_parameters(model)]
    opt = make_optimizer(params, run)
    for p in params:  # B starts at zero; non-zero, every gradient and moment is a real one
        torch.nn.init.normal_(p, std=0.01)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    moments_held = [v for p in params for k, v in opt.state[p].items() if k in ("exp_avg", "exp_avg_sq")]
    got = adapter_memory.run_memory(run, adapter_memory.base_shape(json.loads((TINY / "config.json").read_text())))
    assert got.param_bytes == nbytes(params)  # fp32 masters although the model could be bf16
    assert got.grad_bytes == nbytes(p.grad for p in params if p.grad is not None)
    assert got.optimizer_bytes == nbytes(moments_held) and len(moments_held) == moments * len(params)
    assert got.total == got.param_bytes * (2 + moments)


def test_a_7b_shape_reads_as_its_published_adapter_size():
    # Qwen2.5-7B: 28 layers, hidden 3584, intermediate 18944, 28 heads, 4 kv heads; its rank-16
    # all-linear adapter is 40,370,176 parameters (peft's print_trainable_parameters)
    shape = adapter_memory.base_shape(
        {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
         "num_hidden_layers": 28, "vocab_size": 152064}
    )  # fmt: skip
    mem = adapter_memory.adapter_memory(shape, 16, ["all-linear"], "adamw")
    assert mem.params == 40_370_176 and mem.total == 16 * 40_370_176


def test_the_budget_sums_the_live_runs_and_refuses_with_every_figure():
    shape = adapter_memory.base_shape(json.loads((TINY / "config.json").read_text()))
    own, other, new = cfg("f"), cfg("r2", 4), cfg("big", 64)
    sizes = {c.run: adapter_memory.run_memory(c, shape).total for c in (own, other, new)}
    live_total = sizes["f"] + sizes["r2"]
    fits = live_total + sizes["big"]
    fleet = cfg("f", max_adapter_memory_gib=fits / adapter_memory.GIB)
    assert adapter_memory.problems(fleet, new, [own, other], shape) == []
    tight = cfg("f", max_adapter_memory_gib=(fits - 1) / adapter_memory.GIB)
    [refusal] = adapter_memory.problems(tight, new, [own, other], shape)
    assert refusal.startswith(f"fleet.max_adapter_memory_gib: {(fits - 1) / adapter_memory.GIB:g} (")
    assert "), too little for run 'big': its adapter (rank 64, adamw)" in refusal
    assert "run 'big'" in refusal and f"({sizes['big']} bytes" in refusal
    assert f"the live runs (f, r2) hold {adapter_memory.human(live_total)}" in refusal
    assert "; stop a run, lower its actor.lora_rank" in refusal
    offered = float(refusal.rsplit(">= ", 1)[1])  # the setting offered takes the run
    assert adapter_memory.problems(cfg("f", max_adapter_memory_gib=offered), new, [own, other], shape) == []
    # unset: unbounded, and nothing about the base is needed
    assert adapter_memory.problems(cfg("f"), new, [own, other] * 100, shape) == []


def test_configs_it_cannot_size_say_what_to_do():
    with pytest.raises(adapter_memory.AdapterMemoryError, match=r"^actor.path: config.json has no integer"):
        adapter_memory.base_shape({"model_type": "gpt2", "n_embd": 768})
    shape = adapter_memory.base_shape(json.loads((TINY / "config.json").read_text()))
    with pytest.raises(adapter_memory.AdapterMemoryError, match=r"^actor.target_modules: \['c_attn'\] are not"):
        adapter_memory.adapter_memory(shape, 4, ["c_attn"], "adamw")
    fleet = cfg("f", max_adapter_memory_gib=1.0)
    assert adapter_memory.problems(fleet, cfg("x", targets=["c_attn"]), [fleet], shape)[0].startswith(
        "actor.target_modules: ['c_attn']"
    )


def test_a_multimodal_config_is_read_from_its_text_config():
    text = json.loads((TINY / "config.json").read_text())
    assert adapter_memory.base_shape({"model_type": "vl", "text_config": text}) == adapter_memory.base_shape(text)


def test_base_config_reads_a_directory_or_the_hub_cache_and_names_where_it_looked(tmp_path, monkeypatch):
    assert base_config.read(str(TINY))["model_type"] == "llama"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123\n")
    assert base_config.read("org/tiny") == {"model_type": "llama"}
    with pytest.raises(base_config.BaseConfigError, match=r"^actor.path: 'org/missing' has no config.json here"):
        base_config.read("org/missing")


def test_the_budget_is_the_fleets_setting_and_must_be_positive():
    with pytest.raises(ConfigError, match=r"fleet.max_adapter_memory_gib: 0.0 must be > 0"):
        load_config("examples/tiny.yaml", ["fleet.max_adapter_memory_gib=0"])
    fleet_path = "examples/tiny.yaml"
    fleet = load_config(fleet_path, ["fleet.max_adapter_memory_gib=2"])
    assert fleet.fleet.max_adapter_memory_gib == 2.0
    with pytest.raises(ConfigError) as err:
        runconfig.run_config(
            fleet, runconfig.fleet_tree(fleet_path), {"run": "x", "fleet": {"max_adapter_memory_gib": 9}}
        )
    assert any(p.startswith("fleet.max_adapter_memory_gib: 9 is a fleet setting") for p in err.value.problems)
