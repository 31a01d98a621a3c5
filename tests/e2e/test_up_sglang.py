"""`lorabus up` with SGLang rollouts: the RL loop against the SGLang 0.5.17 protocol server
(tests/fixtures/sglang_server.py: SGLang's documented LoRA endpoints, generating with
transformers + the real peft adapter from the path the sidecar gives it). Real SGLang needs
CUDA; this checks the sidecar's side of the protocol over a whole run, not SGLang itself.

The protocol server is started here and handed to the launcher through `rollout.server_urls` (the
launcher would start real SGLang, `--sglang-python`). Same bar as tests/e2e/test_up.py.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.e2e.up_run import check_learned, run_up
from tests.fixtures.sglang_server import ServerArgs, SglangProtocolServer
from tests.fixtures.vllm import TINY_MODEL

STEPS = 40

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def sglang_url():
    """The protocol server on its own event loop in a thread, for the length of the test."""
    import torch

    torch.set_num_threads(1)  # the run's processes share the machine's cores
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = SglangProtocolServer(ServerArgs(model_path=str(TINY_MODEL), max_lora_rank=8))
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    try:
        yield url, server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_up_with_sglang_protocol_server_improves_heldout_score(tmp_path, sglang_url):
    url, server = sglang_url
    summary = run_up(
        "examples/tiny.yaml",
        tmp_path / "run",
        STEPS,
        "rollout.engine=sglang",
        f"rollout.server_urls=[{url}]",
        "rollout.preload_v0=false",
        # one sidecar per server (two would unload each other's versions); its batches carry
        # the work of tiny.yaml's two embedded replicas
        "rollout.replicas=1",
        "rollout.batch_groups=4",
        "sglang.max_lora_rank=8",
    )
    check_learned(summary, STEPS)
    # the versions went through the server's load/unload: only the keep window is left
    loaded = sorted(server.loaded_adapters())
    assert f"tiny_lora-v{STEPS}" in loaded and len(loaded) <= 4, loaded
