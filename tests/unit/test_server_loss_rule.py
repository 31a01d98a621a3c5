"""When `lorabus up` counts an inference server as lost (`server_watch.on_probe`): pure rules."""

from __future__ import annotations

from services.local.server_watch import ServerState, WatchPolicy, on_probe

POLICY = WatchPolicy(every_s=1.0, timeout_s=1.0, misses=3, start_timeout_s=100.0)


def test_a_ready_server_is_lost_after_misses_in_a_row_and_an_answer_resets_the_count():
    st = ServerState(pid=1, started_at=0.0, ready=True)
    assert on_probe(st, "no answer to GET /health within 1 s", 1.0, POLICY) is None
    assert on_probe(st, "GET /health: HTTP 503", 2.0, POLICY) is None
    assert on_probe(st, None, 3.0, POLICY) is None and st.missed == 0  # answered: counting starts over
    assert on_probe(st, "x", 4.0, POLICY) is None
    assert on_probe(st, "x", 5.0, POLICY) is None
    why = on_probe(st, "no answer to GET /health within 1 s", 6.0, POLICY)
    assert why == "3 health probes in a row failed, the last: no answer to GET /health within 1 s"


def test_a_starting_server_has_its_start_timeout_not_the_miss_count():
    st = ServerState(pid=2, started_at=0.0)
    for t in range(1, 100):  # a vLLM server takes 40 s here, 157 s on the H200: no misses counted
        assert on_probe(st, "GET /health: ConnectError", float(t), POLICY) is None
    assert (
        on_probe(st, "GET /health: ConnectError", 101.0, POLICY)
        == "not ready 100 s after its start (GET /health: ConnectError)"
    )


def test_the_first_answer_makes_it_ready():
    st = ServerState(pid=3, started_at=0.0)
    assert on_probe(st, None, 50.0, POLICY) is None and st.ready


def test_a_probe_of_sglang_outwaits_its_own_health_verdict():
    """SGLang's /health answers after a generation step, up to its own 20 s timeout; a probe that
    gives up sooner kills busy, healthy servers (seen on the H100)."""
    from services.config.loader import load_config
    from services.rollout.server_cmd import health_timeout_s

    sglang = load_config("examples/tiny.yaml", ["rollout.engine=sglang", "sglang.max_lora_rank=8"])
    vllm = load_config("examples/tiny_vllm.yaml", [])
    assert health_timeout_s(vllm, {}) == 5.0
    assert health_timeout_s(sglang, {}) == 30.0
    assert health_timeout_s(sglang, {"SGLANG_HEALTH_CHECK_TIMEOUT": "60"}) == 70.0
