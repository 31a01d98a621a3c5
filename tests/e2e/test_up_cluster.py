"""Issue 30, a replicated bus: `lorabus up` on the tiny task over a three-node JetStream cluster
on loopback (`services.local.nats_server.start_nats_cluster`; streams and KV buckets with
`bus.stream_replicas=3`, every client given all three URLs). One node is SIGKILLed mid-run and
started again; once it is back, another is killed and started again. Each fault is gated on the
run's state (tests/chaos/faults.py: it fires at an exported version, with the trainer held while
it is injected, and two more versions must be exported before the next), so all four fire however
loaded the machine is.

The run must finish on its own (exit 0, no service restarted: a lost node is a reconnect, not a
crash), learn as the clean run does, and lose and duplicate nothing: the chaos tier's checks
(`check_run`): each accepted trajectory stored once, exactly the ones accepted, every one trained
or still queued, and a summary that says what the streams hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.local.nats_server import NatsCluster, start_nats_cluster
from tests.chaos.faults import Fault, Run, read_streams
from tests.chaos.test_chaos import check_run, fired_all, table
from tests.fixtures.waiting import until

STEPS = 24
"""enough for the learning check (`check_run`: held-out up by 0.06) to pass with room to spare:
at 14 steps the gain was 0.056-0.086 over 11 runs here, one under the bar"""
CAUGHT_UP_BOUND_S = 60.0
"""the longest a restarted node may take to catch up (seconds on loopback)"""

pytestmark = pytest.mark.timeout(600)


def kill_node(cluster: NatsCluster, i: int) -> Callable[[Path], str]:
    def act(run_dir: Path) -> str:
        node = cluster.nodes[i]
        node.kill()
        return f"killed n{i} (pid {node.proc.pid if node.proc else '?'}, {node.url})"

    return act


def start_node(cluster: NatsCluster, i: int) -> Callable[[Path], str]:
    def act(run_dir: Path) -> str:
        cluster.nodes[i].start()
        started = time.monotonic()
        # "back" is caught up, not just rejoined: else the next kill takes the quorum with it
        until(cluster.current, CAUGHT_UP_BOUND_S, f"n{i} caught up in every stream and consumer", interval=0.2)
        return f"n{i} back at {cluster.nodes[i].url}, caught up in {time.monotonic() - started:.1f} s"

    return act


def test_a_run_on_a_three_node_cluster_survives_two_nodes_killed_in_turn(tmp_path: Path) -> None:
    with start_nats_cluster(tmp_path / "nats") as cluster:
        faults = [
            Fault("SIGKILL nats node n0", 3, kill_node(cluster, 0)),
            Fault("n0 started again", 5, start_node(cluster, 0)),
            Fault("SIGKILL nats node n1", 7, kill_node(cluster, 1)),
            Fault("n1 started again", 9, start_node(cluster, 1)),
        ]
        run = Run(tmp_path / "run", STEPS, overrides=["bus.stream_replicas=3"], faults=faults, bus_url=cluster.url)
        proc, elapsed = run.go()
        print(proc.stdout[-3000:])
        print(table("three-node cluster, replicas 3", faults, {}, elapsed))
        fired_all(run)
        streams = read_streams(run.run_dir, cluster.url)
        summary = check_run(run, proc, streams)
    assert summary["restarts"] == {}, summary["restarts"]
