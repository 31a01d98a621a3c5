from __future__ import annotations

import pytest

from services.config.loader import config_from_dict
from services.rollout.server_cmd import server_command, server_env, sglang_command, shell_line, vllm_command


def cfg(engine: str, **sections):
    tree = {
        "gconfig": {"lora_name": "tiny_lora"},
        "actor": {"path": "/models/tiny", "lora_rank": 8},
        "rollout": {"engine": engine, "adapter_dir": "/shared/adapters", "max_head_offpolicyness": 2},
        "train_dataset": {"path": "builtin:arith"},
        **sections,
    }
    return config_from_dict(tree)


def flag(argv: list[str], name: str) -> list[str]:
    """The values after `name`, up to the next flag."""
    i = argv.index(name) + 1
    out = []
    while i < len(argv) and not argv[i].startswith("--"):
        out.append(argv[i])
        i += 1
    return out


def test_vllm_slot_flags_and_autofilled_v0():
    c = cfg("vllm", vllm={"max_loras": 3, "max_lora_rank": 16, "extra_args": ["--enforce-eager"]})
    argv = vllm_command(c, host="127.0.0.1", port=8123, python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == ["/models/tiny"]
    assert flag(argv, "--port") == ["8123"] and flag(argv, "--host") == ["127.0.0.1"]
    assert "--enable-lora" in argv
    assert flag(argv, "--max-lora-rank") == ["16"]
    assert flag(argv, "--max-loras") == ["3"]
    assert flag(argv, "--max-cpu-loras") == ["4"]  # back-filled: keep (3) + 1
    assert flag(argv, "--lora-modules") == ["tiny_lora-v0=/shared/adapters/tiny_lora-v0"]
    assert flag(argv, "--logprobs-mode") == ["processed_logprobs"]
    assert argv[-1] == "--enforce-eager"
    assert server_env(c) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def test_vllm_v0_path_is_the_servers_view():
    c = cfg("vllm", rollout={"engine": "vllm", "adapter_dir": "/local/a", "server_adapter_dir": "/mnt/a"})
    assert flag(vllm_command(c), "--lora-modules") == ["tiny_lora-v0=/mnt/a/tiny_lora-v0"]


def test_sglang_slot_flags():
    c = cfg(
        "sglang",
        sglang={
            "max_loaded_loras": 5,
            "max_loras_per_batch": 3,
            "lora_backend": "triton",
            "lora_target_modules": ["q_proj", "v_proj"],
        },
    )
    argv = sglang_command(c, port=30001)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == ["/models/tiny"]
    assert flag(argv, "--max-loras-per-batch") == ["3"]
    assert flag(argv, "--max-loaded-loras") == ["5"]
    assert flag(argv, "--lora-backend") == ["triton"]
    assert flag(argv, "--lora-target-modules") == ["q_proj", "v_proj"]
    assert flag(argv, "--lora-paths") == ["tiny_lora-v0=/shared/adapters/tiny_lora-v0"]
    assert server_env(c) == {}


def test_embedded_has_no_server_command():
    with pytest.raises(ValueError, match="rollout.engine: 'embedded' runs in-process"):
        server_command(cfg("embedded"))


def test_shell_line_quotes():
    assert shell_line(["a b", "c"], {"K": "v w"}) == "K='v w' 'a b' c"
