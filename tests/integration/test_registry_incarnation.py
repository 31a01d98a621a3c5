"""Issue 30, against the real registry process and a real nats-server: a replica killed and
back at once, with a new incarnation in its heartbeats, loses its old self's grants within a
heartbeat's delivery, long before the silence window (4 x heartbeat_s = 120 s here) or the lease
(60 s) could free them, even though its host's clock is behind the dead process's; the dead
process's late heartbeat changes nothing, and the new process's grants stay."""

from __future__ import annotations

import time
import uuid

import pytest

from proto import subjects
from proto.messages import AdmissionDeny, AdmissionGrant, AdmissionReply, AdmissionRequest, ReplicaHeartbeat
from services.common.bus import Bus
from services.config.schema import BusConfig
from tests.integration.test_registry_service import ready, start_registry, wait_status


@pytest.fixture
def run() -> str:
    return f"inc{uuid.uuid4().hex[:8]}"


@pytest.fixture
def registry(tmp_path, nats_url, run):
    reg = start_registry(
        tmp_path,
        nats_url,
        run,
        "  max_head_offpolicyness: 1\n  consumer_batch_size: 4\n  max_concurrent_rollouts: 8\n"
        "  lease_seconds: 60\n  heartbeat_s: 30\n",
    )
    yield reg
    reg.stop()


@pytest.fixture
async def bus(nats_url, run):
    bus = await Bus.connect(BusConfig(url=nats_url), run=run, service="tester")
    await bus.ensure_streams()
    yield bus
    await bus.close()


async def heartbeat(bus: Bus, incarnation: str, started_at: float, loaded: list[int]) -> None:
    beat = ReplicaHeartbeat(run=bus.run, replica="r1", engine="embedded", loaded_versions=loaded, in_flight=0,
                            sent_at=time.time(), started_at=started_at, incarnation=incarnation)  # fmt: skip
    await bus.publish(subjects.rollout_report(bus.run, "r1", "heartbeat"), beat)


def incarnation(st) -> str | None:
    """r1's incarnation in a status; None until its first heartbeat is in (a status can be
    answered before the registry has read it)."""
    replica = st.ledger.replicas.get("r1")
    return None if replica is None else replica.incarnation


async def admit(bus: Bus, started_at: float) -> str:
    req = AdmissionRequest(run=bus.run, replica="r1", request_id=uuid.uuid4().hex, loaded_versions=[0],
                           started_at=started_at)  # fmt: skip
    reply: AdmissionGrant | AdmissionDeny = await bus.request(
        subjects.admission(bus.run), req, AdmissionReply, timeout=5.0
    )
    assert isinstance(reply, AdmissionGrant), reply
    return reply.grant_id


async def test_a_replica_back_with_a_new_incarnation_loses_its_old_grants_at_once(bus, registry, run):
    await bus.publish(subjects.adapter_ready(run, 0), ready(run, 0), msg_id="v0")
    await wait_status(bus, registry, lambda s: s.ledger.head == 0)
    old_start = time.time()
    await heartbeat(bus, "old-self-0001", old_start, [0])
    await wait_status(bus, registry, lambda s: incarnation(s) == "old-self-0001")
    old = {await admit(bus, old_start) for _ in range(3)}

    # killed and back at once, on a host whose clock is 30 s behind: the start-time rule alone
    # would read the new process as an old one and keep the dead one's grants
    new_start = old_start - 30.0
    mine = await admit(bus, new_start)  # its first request can come before its first heartbeat
    st = await wait_status(bus, registry, lambda s: len(s.ledger.grants) == 4)
    t0 = time.monotonic()
    await heartbeat(bus, "new-self-0002", new_start, [0])
    st = await wait_status(bus, registry, lambda s: incarnation(s) == "new-self-0002")
    freed_after = time.monotonic() - t0
    assert {g.started_at for g in st.ledger.grants.values()} == {new_start}, st.ledger.grants
    assert st.ledger.running == 1 and freed_after < 5.0  # nowhere near 120 s of silence or a 60 s lease
    assert st.ledger.replicas["r1"].replaced == ["old-self-0001"]

    # the dead process's late heartbeat (saying it has nothing loaded) changes nothing
    await heartbeat(bus, "old-self-0001", old_start, [])
    also_mine = await admit(bus, new_start)
    st = await wait_status(bus, registry, lambda s: s.ledger.running == 2)
    assert st.ledger.replicas["r1"].incarnation == "new-self-0002"
    assert st.ledger.replicas["r1"].loaded == {0}
    assert old.isdisjoint({mine, also_mine}) and registry.alive()
    assert "r1" in st.ledger.versions[0].loaded_by
