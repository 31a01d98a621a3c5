"""`lorabus up` with vLLM rollouts: the launcher starts a real vLLM OpenAI server (the CPU build
in .cache/vllm-venv) for its replica, and the RL loop must learn as with the embedded engine.

Same bar as tests/e2e/test_up.py (read it for why the margin cannot be met by chance): the
greedy held-out score of the best of the last three versions >= v0 + 0.06, every version
evaluated, zero stale trajectories accepted, every accepted trajectory trained on or waiting.
The behaviour logprobs come from vLLM (`--logprobs-mode processed_logprobs`), the importance
weights of the loss from the trainer's own forward: a mismatch would show as masked tokens and
no gain.

In the disk run the server hangs mid-run (SIGSTOP: it keeps its port and stops answering):
the launcher's server watch finds it lost, kills and restarts it, and restarts its sidecar once
the new server is ready (a new incarnation: its old grants are freed, and it loads the keep
window into the fresh server); the run finishes and learns all the same, and the restarted
server served the versions after the hang.

With `actor.weight_update_mode=xccl` the sidecar joins the trainer's broadcast group and has the
server load each version from the broadcast (docs/xccl.md): the same bar, and most versions must
have arrived that way, so the gain is not the object path's doing.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.e2e.up_run import ROOT, check_learned, run_up
from tests.fixtures.waiting import until

STEPS = 40
VLLM_VENV = ROOT / ".cache" / "vllm-venv"

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.mark.parametrize("mode", ["disk", "xccl"])
def test_up_with_vllm_server_improves_heldout_score(tmp_path, mode):
    if not (VLLM_VENV / ".installed").exists():
        pytest.skip(f"{VLLM_VENV}/.installed missing: build the vLLM CPU venv with `make vllm-env`")
    run_dir = tmp_path / "run"
    summary = run_up(
        "examples/tiny_vllm.yaml",
        run_dir,
        STEPS,
        f"actor.weight_update_mode={mode}",
        beside=hang_the_server if mode == "disk" else None,
    )
    check_learned(summary, STEPS)
    # the rollouts really went through the server: its log has the runtime loads
    log = (run_dir / "vllm-0.log").read_text(errors="replace")
    assert f"name 'tiny_lora-v{STEPS}'" in log, "the last version was not loaded into the server"
    # one /v1/completions request per group (n = 8 completions each)
    assert log.count('"POST /v1/completions HTTP/1.1" 200') >= summary["trajectories"]["accepted"]
    assert json.loads((run_dir / "pids.json").read_text()).keys() >= {"vllm-0", "rollout-0"}
    via = dict(re.findall(r"loaded \S+-v(\d+) via (xccl|object)", (run_dir / "rollout-0.log").read_text()))
    if mode == "xccl":  # v0 precedes the join; every later version came by broadcast
        assert via["0"] == "object" and sum(v == "xccl" for v in via.values()) >= STEPS - 2, via
        return
    assert set(via.values()) == {"object"}, via
    assert summary["restarts"] == {"vllm-0": 1, "rollout-0": 1}, summary["restarts"]
    up = (run_dir / "up.log").read_text()
    assert re.search(r"vllm-0 lost: 3 health probes in a row failed, the last: no answer", up), up[-3000:]
    assert "vllm-0 is ready again: restarted its sidecar rollout-0" in up
    # the second server process loaded versions after the hang (its log follows the first's)
    starts = [m.start() for m in re.finditer(r"Starting vLLM server on", log)]
    assert len(starts) == 2, f"{len(starts)} server starts in vllm-0.log"
    after = re.findall(r"name 'tiny_lora-v(\d+)'", log[starts[1] :])
    assert after and min(map(int, after)) >= HANG_AT - 2, after  # the keep window, not the stream's start


HANG_AT = 8


def hang_the_server(run_dir) -> None:
    """Once v{HANG_AT} is exported, SIGSTOP the vLLM server: it keeps its port, nothing answers."""
    until(lambda: (run_dir / "export" / f"v{HANG_AT}").is_dir(), 300, f"v{HANG_AT} to be exported", interval=0.5)
    os.kill(json.loads((run_dir / "pids.json").read_text())["vllm-0"], signal.SIGSTOP)
