"""The device benchmarks give each inference server its own carried site: vLLM's and SGLang's
pin different transformers, so one server must never import the other's."""

from __future__ import annotations

from benchmarks.gpu_engines import server_pythonpath
from benchmarks.gpu_learning import sglang_override
from services.config.loader import load_config
from services.rollout import server_cmd


def test_each_server_gets_its_own_site_first_and_never_the_other():
    inherited = "/tmp/site:/tmp/vsite:/repo"
    assert server_pythonpath(inherited, "/tmp/vsite", "/tmp/ssite", "sglang") == "/tmp/ssite:/tmp/site:/repo"
    assert server_pythonpath(inherited, "/tmp/vsite", "/tmp/ssite", "vllm") == "/tmp/vsite:/tmp/site:/repo"
    assert server_pythonpath("/tmp/site:/repo", None, None, "vllm") == "/tmp/site:/repo"


def test_the_sglang_learning_run_asks_for_triton_attention_a_gpu_share_the_rollout_dtype_and_decode_graphs_only():
    override = sglang_override(["rollout.dtype=bfloat16"])
    cfg = load_config("examples/arith3_gpu.yaml", ["rollout.engine=sglang", "rollout.preload_v0=false", override])
    argv = server_cmd.server_command(cfg, host="127.0.0.1", port=1)
    tail = argv[argv.index("--lora-backend") + 2 :]
    assert tail == [
        "--lora-target-modules", "all",
        "--dtype", "bfloat16", "--attention-backend", "triton", "--mem-fraction-static", "0.3",
        "--cuda-graph-backend-prefill", "disabled",
    ]  # fmt: skip
