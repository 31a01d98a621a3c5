"""`lorabus up` with `actor.weight_update_mode=xccl`: adapters reach the replicas by gloo
broadcast from the trainer, and the run must learn exactly as well as over the object store.

Same held-out criterion as test_up.py (best of the last three versions >= v0 + MARGIN). On top:
- most versions were swapped in from the broadcast ("via xccl" in the replicas' logs), so the
  gain is not the object path's doing;
- a replica SIGKILLed mid-run breaks the group; the trainer must neither hang nor lose the
  version (its timeout is set to 5 s here), the survivor re-joins and takes the later versions
  by broadcast again, the replacement replica catches up and the run finishes. (The late
  joiner's way into the group is tested in tests/integration/test_xccl_group.py: here the
  40 steps take ~15 s, about what the replacement needs to start on 2 busy cores.)
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from test_up import MARGIN, STEPS, finish, launch

from tests.fixtures.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def loads_by_path(log_text: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {"xccl": set(), "object": set()}
    for version, via in re.findall(r"loaded \S+-v(\d+) via (xccl|object)", log_text):
        out[via].add(int(version))
    return out


def test_up_xccl_matches_the_object_path_gain_and_survives_a_killed_replica(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "actor.weight_update_mode=xccl", "actor.xccl_timeout_s=5")
    try:
        until(lambda: (run_dir / "export" / "v4").is_dir(), 600, "v4 to be exported", interval=0.5)
        pids = __import__("json").loads((run_dir / "pids.json").read_text())
        os.kill(pids["rollout-0"], signal.SIGKILL)
        summary = finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()

    evals = {int(v): s for v, s in summary["eval_by_version"].items()}
    assert set(range(STEPS + 1)) <= set(evals), f"versions not evaluated: {evals}"
    best_late = max(evals[v] for v in (STEPS - 2, STEPS - 1, STEPS))
    assert best_late >= evals[0] + MARGIN, f"held-out score did not rise: {evals}"
    assert summary["max_accepted_staleness"] <= summary["max_head_offpolicyness"]
    assert summary["restarts"].get("rollout-0") == 1
    assert summary["loaded"]["rollout-0"] >= STEPS - 1, summary["loaded"]

    survivor = loads_by_path((run_dir / "rollout-1.log").read_text())
    # v0 precedes every join; around the kill a version or two fall back to the object copy
    assert 0 in survivor["object"], survivor
    assert len(survivor["xccl"]) >= STEPS - 8, survivor
    assert {STEPS - 1, STEPS} <= survivor["xccl"], survivor  # back in a re-formed group
    trainer_log = (run_dir / "trainer.log").read_text()
    assert "not this adapter's layout" not in trainer_log  # the engine wrote into the send sets
    assert re.search(r"group \S+-g1 formed", trainer_log) and re.search(r"group \S+-g[2-9] formed", trainer_log)
