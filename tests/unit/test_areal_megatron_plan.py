"""AReaL 1.0.4's Megatron + vLLM GSM8K GRPO LoRA example, as `lorabus up --config FILE` loads
and plans it, offline: `openai/gsm8k` and `Qwen/Qwen3-0.6B` (its tokenizer, a tiny one with a
chat template) from a Hugging Face cache made here, the hub never asked.

This checks everything `lorabus up` decides before it starts anything, for the file's own
layout (`megatron:d4p1t1`, `vllm:d4p1t1`): the data read and epochs counted, the processes and
the servers' flags. The run itself, on the smallest layout of the same kind, is
tests/e2e/test_up_areal_megatron.py (megatron-bridge from `make megatron-env`'s site, the vLLM
CPU server from `make vllm-env`).
"""

from __future__ import annotations

import pytest

from services.config import areal
from services.config.loader import load_config
from services.local import inference_servers, launcher
from tests.fixtures import gsm8k

EXAMPLE = "tests/fixtures/areal/gsm8k_grpo_megatron_lora.yaml"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    home = tmp_path / "hf"
    gsm8k.hf_cache(home)
    gsm8k.hf_model(home, "Qwen/Qwen3-0.6B")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    # read at import, so set where it is read: with only the variable, a hub id's tokenizer is
    # asked of the hub first (minutes of retries offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_megatron_vllm_example_loads_and_plans_offline(offline_hub, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(areal.REPORTED_ENV, raising=False)
    # the fixture's 12 GSM8K rows make no batch of 256: shortened in AReaL's key, as e2e does
    cfg = load_config(EXAMPLE, ["train_dataset.batch_size=2"])
    table = capsys.readouterr().err
    assert "total_train_steps = 60 (10 x (12 prompts // batch 2) = 60)" in table
    assert "actor.backend = 'megatron', actor.nproc_per_node = 4" in table
    assert "rollout.engine = 'vllm', rollout.replicas = 4" in table
    # prompts as AReaL builds them, from the cached tokenizer (tokenizer_path: ${actor.path})
    assert cfg.train_dataset.tokenizer_path == "Qwen/Qwen3-0.6B" and cfg.train_dataset.chat_template
    assert launcher.trainer_launcher(cfg)[-3:] == ["--standalone", "--nproc_per_node=4", "-m"]
    assert (cfg.actor.backend, cfg.actor.megatron.bridge_type, cfg.actor.weight_update_mode) == (
        "megatron",
        "megatron-bridge",
        "xccl",
    )
    plans = inference_servers.plan_servers(cfg, tmp_path / "run", "python3")
    assert [p.name for p in plans] == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
    for plan in plans:
        argv = " ".join(plan.argv)
        for flag in (
            "--model Qwen/Qwen3-0.6B",
            "--dtype bfloat16",
            "--max-model-len 32768",
            "--enable-lora",
            "--max-lora-rank 16",
            "--max-loras 8",
            "--seed=1",
            "--gpu-memory-utilization=0.9",
            "--enforce-eager",
        ):
            assert flag in argv, (flag, argv)


MOE_EXAMPLE = "tests/fixtures/areal/gsm8k_grpo_megatron_lora_moe.yaml"


def test_megatron_moe_example_loads_and_plans_as_written(offline_hub, tmp_path, monkeypatch, capsys):
    """AReaL's MoE example as written: `megatron:(attn:d1p6t1c1|ffn:d1p6t1e1)` is six pipeline
    stages under torchrun, one rank each, experts unsplit; one vLLM server over two GPUs."""
    gsm8k.hf_model(offline_hub, "Qwen/Qwen3-30B-A3B-Base")  # its tokenizer, offline
    monkeypatch.delenv(areal.REPORTED_ENV, raising=False)
    cfg = load_config(MOE_EXAMPLE, ["train_dataset.batch_size=2"])
    table = capsys.readouterr().err
    assert (
        "actor.backend = 'megatron', actor.nproc_per_node = 6, actor.megatron tensor/pipeline/expert sizes 1/6/1"
        in table
    )
    m = cfg.actor.megatron
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size) == (1, 6, 1)
    assert launcher.trainer_launcher(cfg)[-3:] == ["--standalone", "--nproc_per_node=6", "-m"]
    plans = inference_servers.plan_servers(cfg, tmp_path / "run", "python3")
    assert [p.name for p in plans] == ["vllm-0"]
    assert "--tensor-parallel-size=2" in plans[0].argv
