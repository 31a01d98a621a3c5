"""LoRA target names (services.common.lora_targets): the config's vocabulary per trainer backend
and the Megatron -> HF mapping that the config, the trainers and the exporter share."""

from __future__ import annotations

import pytest

from services.common.lora_targets import for_backend, problems, to_hf

MEGATRON_LINEAR = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_all_linear_per_backend():
    assert for_backend([], "fsdp2") == "all-linear"
    assert for_backend(["all-linear"], "fsdp2") == "all-linear"
    assert for_backend(["q_proj"], "fsdp2") == ["q_proj"]
    assert for_backend([], "megatron") == for_backend(["all-linear"], "megatron") == MEGATRON_LINEAR
    assert for_backend(["linear_qkv", "linear_fc2", "linear_qkv"], "megatron") == ["linear_qkv", "linear_fc2"]


@pytest.mark.parametrize(
    "targets,backend,message",
    [
        (["all-linear", "q_proj"], "fsdp2", "actor.target_modules: ['all-linear', 'q_proj'] mixes 'all-linear'"),
        (["linear_fc1"], "fsdp2", "actor.target_modules: 'linear_fc1' is a Megatron module name"),
        (["q_proj"], "megatron", "actor.target_modules: 'q_proj' is not a Megatron linear layer"),
    ],
)
def test_names_the_backend_lacks_raise(targets, backend, message):
    assert problems(targets, backend)[0].startswith(message)
    with pytest.raises(ValueError, match="actor.target_modules"):
        for_backend(targets, backend)


def test_to_hf():
    assert to_hf(["linear_qkv"]) == ["k_proj", "q_proj", "v_proj"]
    assert to_hf(["linear_proj", "linear_fc1", "linear_fc2"]) == ["down_proj", "gate_proj", "o_proj", "up_proj"]
    assert (
        to_hf([])
        == to_hf(["all-linear"])
        == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    )
    assert to_hf(for_backend(["linear_qkv", "linear_fc1"], "megatron")) == [
        "gate_proj",
        "k_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert to_hf(["q_proj", "linear_proj"]) == ["o_proj", "q_proj"]
    with pytest.raises(ValueError, match="actor.target_modules: 'linear_foo' is neither"):
        to_hf(["linear_foo"])
