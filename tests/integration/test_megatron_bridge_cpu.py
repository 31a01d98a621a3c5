"""The Megatron engine on megatron-bridge's real LoRA, without Transformer Engine, on CPU (gloo):
a random Qwen3 (dense) / Qwen3 MoE checkpoint -> AutoBridge -> megatron-core's local layer spec
-> `LoRA(linear_qkv, linear_proj, linear_fc1, linear_fc2)` -> GRPO steps -> the adapter published
(object + `AdapterReady` on a real nats-server) -> read back, checked against its sha256,
converted PEFT loaded by peft onto the HF model -> logits equal to Megatron's.

It runs `benchmarks/megatron_bridge_step.py` (the same script the GPU runs) in a child process
whose PYTHONPATH starts with the megatron-bridge site `make megatron-env` builds
(.cache/megatron-site: megatron-bridge 0.6.2, megatron-core 0.19.2, transformers 5.17.0): the
venv's own transformers is newer than megatron-bridge imports with. Skipped only where that site
is missing (`make test` builds it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.nats import nats_server, nats_url  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("LORABUS_MEGATRON_SITE", ROOT / ".cache" / "megatron-site"))
pytestmark = pytest.mark.skipif(
    not (SITE / "megatron" / "bridge").is_dir(), reason=f"no megatron-bridge site at {SITE} (make megatron-env)"
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["dense", "moe", "moe_bf16"])
def test_megatron_bridge_lora_step_publish_and_peft_logits(arch, tmp_path, nats_url):
    out = tmp_path / "out"
    dtype = "bfloat16" if arch.endswith("bf16") else "float32"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "megatron_bridge_step.py"), "--device", "cpu",
           "--dtype", dtype, "--shape", "tiny", "--layers", "2", "--groups", "2", "--samples", "4",
           "--prompt-len", "6", "--max-new", "10", "--steps", "2", "--out", str(out), "--label", arch,
           "--work", str(tmp_path / "work"), "--nats-url", nats_url]  # fmt: skip
    if arch.startswith("moe"):
        cmd += ["--moe", "--experts", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)])
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=540)
    report_path = out / f"megatron_bridge_step_{arch}.json"
    assert report_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    failed = {k: v.get("error") for k, v in report["stages"].items() if not v.get("ok")}
    assert not failed and proc.returncode == 0, (failed, proc.stderr[-3000:])
    st = report["stages"]

    # megatron-bridge ran as is, and Transformer Engine was never imported (not even the placeholder)
    assert st["versions"]["megatron-bridge"] == "0.6.2" and st["versions"]["te_in_sys_modules"] == []
    build = st["build_engine_and_lora"]
    bf16 = arch.endswith("bf16")
    assert build["transformer_engine"] is False and build["model"] == ("Float16Module" if bf16 else "GPTModel")
    # bridge's LoRALinear around megatron-core's own parallel linears, on every target
    wrappers = build["wrappers"]
    assert set(wrappers) == {"LoRALinear(ColumnParallelLinear)", "LoRALinear(RowParallelLinear)"}
    experts = 4 if arch.startswith("moe") else 0
    per_layer_mlp = 2 * experts if experts else 2  # SequentialMLP: one LoRA per expert linear
    assert sum(wrappers.values()) == 2 * (2 + per_layer_mlp)
    assert build["adapter_tensors"] == 2 * sum(wrappers.values())
    if experts:
        assert ".mlp.experts.local_experts." in build["expert_names"][0]

    steps = st["grpo_steps"]
    assert steps["adapter_max_abs_change"] > 0 and all(g > 0 for g in steps["grad_norm"])

    for label in ("trained", "random_b"):
        pub = st[f"publish_{label}"]
        assert pub["payloads"] == ["ObjectPayload"] and pub["dtype"] == ("torch.bfloat16" if bf16 else "torch.float32")
        assert pub["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        # q/k/v from qkv, gate/up from fc1: 7 HF modules per layer (per expert for gate/up/down)
        hf_modules = 2 * (4 + (3 * experts if experts else 3))
        assert pub["hf_tensors"] == 2 * hf_modules
        check = st[f"logits_check_{label}"]
        # the adapter moves the logits, and Megatron and HF + peft agree far below that
        assert check["adapter_effect_max_abs"] > 0.05
        if bf16:  # as close as HF in bf16 is to itself in float32 (the bound is twice that)
            assert 0 < check["hf_bf16_vs_fp32_max_abs"] and check["tolerance"] == 2 * check["hf_bf16_vs_fp32_max_abs"]
            assert check["max_abs_diff"] <= check["tolerance"]
        else:
            assert check["max_abs_diff"] < 1e-4 and check["argmax_agreement"] == 1.0
