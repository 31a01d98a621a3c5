"""What `lorabus up` decides about inference servers, without starting any."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.config.loader import load_config
from services.local import inference_servers
from services.local.launcher import child_commands

ROOT = Path(__file__).resolve().parents[2]


def cfg(*overrides: str):
    return load_config(ROOT / "examples" / "tiny_vllm.yaml", list(overrides))


def test_vllm_without_urls_gets_one_server_per_replica_without_preloaded_v0(tmp_path):
    c = cfg("rollout.replicas=2", "rollout.device=cpu")
    assert inference_servers.needs_servers(c)
    plans = inference_servers.plan_vllm_servers(c, tmp_path, "/venv/bin/python")
    assert [p.replica for p in plans] == ["rollout-0", "rollout-1"]
    assert len({p.url for p in plans}) == 2 and len({p.adapter_dir for p in plans}) == 2
    for p in plans:
        assert p.argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
        assert "--lora-modules" not in p.argv  # preload_v0: false
        assert p.argv[p.argv.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert p.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and p.env["VLLM_TARGET_DEVICE"] == "cpu"
    # each sidecar is told its own server and directory, ahead of --replica
    children = child_commands(c, "x.yaml", [], tmp_path, False, plans)
    for child, plan in zip([ch for ch in children if ch.name.startswith("rollout-")], plans):
        assert child.argv[-2:] == ["--replica", plan.replica]
        assert f"rollout.server_urls=[{plan.url}]" in child.argv
        assert f"rollout.adapter_dir={plan.adapter_dir}" in child.argv


def test_given_urls_or_embedded_need_no_servers():
    assert not inference_servers.needs_servers(cfg("rollout.server_urls=[http://127.0.0.1:8000]"))
    assert not inference_servers.needs_servers(cfg("rollout.engine=embedded"))


def test_sglang_without_urls_gets_sglang_servers_with_its_site_on_their_path_only(tmp_path):
    c = cfg("rollout.engine=sglang", "sglang.max_lora_rank=8", "rollout.replicas=2")
    assert inference_servers.needs_servers(c)
    python = inference_servers.server_python(c, None, None)
    assert python == "python3"
    (tmp_path / "site" / "sglang").mkdir(parents=True)
    plans = inference_servers.plan_servers(c, tmp_path, python, str(tmp_path / "site"))
    assert [p.name for p in plans] == ["sglang-0", "sglang-1"]
    for p in plans:
        assert p.argv[:3] == ["python3", "-m", "sglang.launch_server"] and "--enable-lora" in p.argv
        assert p.env["PYTHONPATH"].split(":")[0] == str(tmp_path / "site")
        assert "VLLM_TARGET_DEVICE" not in p.env
    with pytest.raises(inference_servers.CannotStartServers, match="--server-site: .* holds no sglang package"):
        inference_servers.plan_servers(c, tmp_path, python, str(tmp_path))
    with pytest.raises(inference_servers.CannotStartServers, match="--sglang-python: /nope"):
        inference_servers.server_python(c, None, "/nope/python")
    with pytest.raises(inference_servers.CannotStartServers, match="--vllm-python: /nope"):
        inference_servers.vllm_python("/nope/python")


def test_launcher_exits_2_before_starting_anything_for_a_missing_server_python(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.local.launcher",
            "--config",
            "examples/tiny.yaml",
            "--sglang-python",
            "/nope/python",
            f"run_dir={tmp_path}/run",
            "rollout.engine=sglang",
            "sglang.max_lora_rank=8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert "--sglang-python: /nope/python does not exist" in out.stderr
    assert not (tmp_path / "run").exists()
