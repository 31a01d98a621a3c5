"""One `LoraSpec` builder for both trainers (`engines.base.lora_spec`), and both publish the
adapter in the serving dtype it names, cast once from the fp32 masters (docs/design.md)."""

from __future__ import annotations

import types

import torch
import yaml

from services.common import adapter_io
from services.config.loader import load_config
from services.config.schema import ActorConfig
from services.trainer.engines.base import lora_spec
from services.trainer.lora import lora_spec as fsdp2_spec
from services.trainer.lora import wrap_lora
from tests.fixtures.tiny import tiny_qwen2
from tests.unit.test_megatron_engine import R, fake_megatron  # noqa: F401 (the fixture)


def test_the_builder_names_the_serving_dtype_and_the_base():
    actor = ActorConfig(path="org/base", lora_rank=4, lora_alpha=8, dtype="bfloat16")
    spec = lora_spec(actor, ["q_proj", "v_proj"])
    assert (spec.rank, spec.alpha, spec.target_modules, spec.dtype, spec.base_model) == (
        4,
        8.0,
        ["q_proj", "v_proj"],
        "bfloat16",
        "org/base",
    )
    assert lora_spec(actor, ["q_proj"], base_model="other").base_model == "other"
    model = wrap_lora(tiny_qwen2(), ActorConfig(path="tiny", lora_rank=2, target_modules=["q_proj", "v_proj"]))
    assert fsdp2_spec(model, actor) == spec  # the FSDP2 engine's spec is the builder's


def test_megatron_publishes_in_the_serving_dtype(fake_megatron, tmp_path, monkeypatch):
    config = tmp_path / "trainer.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "experiment_name": "m",
                "trial_name": "t",
                "run": "m",
                "run_dir": str(tmp_path / "run"),
                "actor": {
                    "backend": "megatron",
                    "path": "fake/qwen2",
                    "device": "cpu",
                    "dtype": "bfloat16",
                    "lora_rank": R,
                    "lora_alpha": 8,
                    "target_modules": ["linear_fc1", "linear_fc2"],
                    "megatron": {"bridge_type": "megatron-bridge"},
                },
                "train_dataset": {"path": "builtin:arith", "reward_fn": "services.common.rewards:arith_reward"},
            }
        )
    )
    engine = fake_megatron.MegatronEngine(load_config(str(config)))
    spec = engine.lora_spec()
    assert spec == lora_spec(engine.actor, spec.target_modules) and spec.dtype == "bfloat16"
    published = engine.adapter_state()
    assert published and {t.dtype for t in published.values()} == {torch.bfloat16}
    masters = engine.bridge_adapter_state()
    assert {t.dtype for t in masters.values()} == {torch.float32}  # the masters stay fp32
    # a checkpoint of the published copy resumes: the masters' cast reproduces it exactly
    one_rank = types.SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda: 1, barrier=lambda: None)
    monkeypatch.setattr(fake_megatron, "dist", one_rank)
    engine.load_state(adapter_io.from_bytes(adapter_io.to_bytes(published)), engine.optimizer_state(), 0)
