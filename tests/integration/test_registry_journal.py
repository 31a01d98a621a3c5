"""The registry's journal against a real nats-server: group commit, snapshots that compact the
journal, a restart that replays, a second writer detected, a grant held back until stored, and
on a three-node cluster a write retried while its first attempt is still being replicated."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from proto.messages import AdapterReady, AdmissionGrant, AdmissionRequest, LoraSpec, ObjectPayload
from services.common import streams
from services.common.bus import Bus
from services.config.schema import BusConfig
from services.local.nats_server import start_nats_cluster
from services.registry import persistence as j
from services.registry import policy as p

LORA = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"], base_model="tiny")
CFG = p.PolicyConfig(max_head_offpolicyness=2, consumer_batch_size=1000,
                     max_concurrent_rollouts=1000, lease_seconds=60.0)  # fmt: skip


@pytest.fixture
async def bus(nats_url):
    bus = await Bus.connect(BusConfig(url=nats_url), run=f"jr{uuid.uuid4().hex[:8]}", service="registry")
    yield bus
    await bus.close()


def ready(run: str, version: int) -> AdapterReady:
    return AdapterReady(
        run=run, trainer_epoch="e0", lora_name="lora", version=version, trainer_step=version, created_at=1.0,
        lora=LORA, payloads=[ObjectPayload(uri="file:///x", bytes=1, sha256="0" * 64)],
    )  # fmt: skip


def request(run: str, i: int) -> AdmissionRequest:
    return AdmissionRequest(run=run, replica="r1", request_id=f"q{i}", loaded_versions=[0])


async def open_journal(bus, cfg=CFG, snapshot_every=4) -> j.Journal:
    return await j.Journal.open(bus, streams.ledger_bucket(bus.run), bus.run, cfg,
                                snapshot_every=snapshot_every)  # fmt: skip


async def test_restart_replays_snapshot_and_entries_and_compacts(bus):
    run = bus.run
    journal = await open_journal(bus)
    journal.apply(j.AdapterOp(p.adapter_facts(ready(run, 0))))
    await journal.commit()
    # concurrent commits share writes: 30 admissions in 3 rounds, far fewer than 30 writes
    for round_ in range(3):

        async def one(i):
            journal.apply(j.AdmitOp(request(run, i), 10.0))
            await journal.commit()

        await asyncio.gather(*(one(round_ * 10 + i) for i in range(10)))
    assert journal.ledger.running == 30
    writes = journal.revision
    assert writes < 31
    # a snapshot every 4 entries drops the older messages: the stream stays short
    info = await bus.js.stream_info(journal.stream)
    assert info.state.messages <= 4, info.state

    again = await open_journal(bus)  # what a restart after kill -9 sees
    assert again.ledger == journal.ledger
    assert again.revision == journal.revision
    assert again.replayed == journal.entries_since_snapshot

    # the new writer took over: the old one's next write is refused and it stops
    journal.apply(j.AdmitOp(request(run, 99), 11.0))
    with pytest.raises(j.LedgerConflict, match="second registry"):
        await journal.commit()
    with pytest.raises(j.LedgerConflict):
        journal.apply(j.AdmitOp(request(run, 100), 11.0))
    # the new one carries on, and a third open sees the new one's state only
    grant = again.apply(j.AdmitOp(request(run, 200), 12.0))
    await again.commit()
    third = await open_journal(bus)
    assert isinstance(grant, AdmissionGrant) and grant.grant_id in third.ledger.grants
    assert third.ledger.grants[grant.grant_id].request_id == "q200"  # not the old one's q99
    assert third.ledger == again.ledger


async def test_reply_leaves_only_after_its_write(bus):
    run = bus.run
    journal = await open_journal(bus, snapshot_every=1000)
    seen: list[bytes] = []
    inbox = bus.nc.new_inbox()

    async def on_reply(msg):
        seen.append(msg.data)

    await bus.nc.subscribe(inbox, cb=on_reply)
    journal.apply(j.AdapterOp(p.adapter_facts(ready(run, 0))))
    journal.apply(j.AdmitOp(request(run, 1), 10.0))
    journal.send_after_commit(inbox, b"grant-1")
    seq_before = journal.seq
    assert not seen
    await journal.commit()
    await bus.nc.flush()
    for _ in range(50):
        if seen:
            break
        await asyncio.sleep(0.01)
    assert seen == [b"grant-1"]
    assert journal.seq == seq_before + 1  # both ops in one entry
    stored = await bus.js.get_msg(journal.stream, seq=journal.seq)
    assert [type(op).__name__ for op in j.decode_entry(stored.data).ops] == ["AdapterOp", "AdmitOp"]


async def test_config_change_is_recorded_before_new_entries(bus):
    run = bus.run
    first = await open_journal(bus)
    first.apply(j.AdapterOp(p.adapter_facts(ready(run, 0))))
    first.apply(j.AdapterOp(p.adapter_facts(ready(run, 3))))
    await first.commit()
    # k=2 at decision time: v0 is retired (3 - 0 > 2)
    assert first.ledger.versions[0].retired
    wider = p.PolicyConfig(max_head_offpolicyness=5, consumer_batch_size=1000,
                           max_concurrent_rollouts=1000, lease_seconds=60.0)  # fmt: skip
    second = await open_journal(bus, cfg=wider)
    # the replay used the config the entries were written under, not the new one
    assert second.ledger == first.ledger
    snap, _, _ = await j.read_snapshot(bus, streams.ledger_bucket(run))
    assert snap.cfg == wider


async def test_a_ledger_larger_than_a_message_is_stored_in_pieces_and_read_back(bus):
    """Issue 17: the ledger is stored in pieces that cannot outgrow a NATS message (two 800 KB
    heartbeats once made every later start fail with MaxPayloadError)."""
    run = bus.run
    big = p.PolicyConfig(max_head_offpolicyness=1, consumer_batch_size=2, max_concurrent_rollouts=4,
                         lease_seconds=60.0, seen_limit=20_000)  # fmt: skip
    first = await open_journal(bus, cfg=big, snapshot_every=2)
    first.apply(j.AdapterOp(p.adapter_facts(ready(run, 0))))
    first.ledger.seen.update(
        {f"t{i:06d}-" + "x" * 100: p.SeenDecision("accepted", "", f"g{i}", "r1", 0, 0, 1.0) for i in range(12_000)}
    )
    await first.commit()
    first.apply(j.ExpireOp(2.0))
    await first.commit()  # the second entry: a snapshot, now ~2 MB
    assert first.snapshots >= 2
    stored, _, slot = await j.read_snapshot(bus, streams.ledger_bucket(run))
    assert len(j.encode_snapshot(stored)) > 1024 * 1024 and stored.ledger == first.ledger
    again = await open_journal(bus, cfg=big)
    assert again.ledger == first.ledger and again.slot != slot  # its own snapshot went to the other slot


async def test_a_write_that_fails_for_good_stops_the_registry_loudly(bus, monkeypatch):
    """Issue 17: a fatal storage error reaches the service (which exits non-zero) instead of
    leaving a registry that fails every operation and never exits."""
    monkeypatch.setattr(j, "RETRY_FOR_S", 1.0)
    failures: list[BaseException] = []
    journal = await j.Journal.open(bus, streams.ledger_bucket(bus.run), bus.run, CFG, on_fatal=failures.append)
    await bus.js.delete_stream(journal.stream)  # the store is gone under it
    journal.apply(j.AdmitOp(request(bus.run, 1), 10.0, "tok"))
    journal.send_after_commit("_INBOX.nobody", b"reply")  # the admission path: no commit() awaited
    for _ in range(200):
        if failures:
            break
        await asyncio.sleep(0.05)
    assert failures and journal.fatal is failures[0]
    with pytest.raises(type(failures[0])):
        journal.apply(j.ExpireOp(11.0))


IN_PROCESS_S = 5.0
"""how long the ledger's stream leader is left without followers: its proposal stays
uncommitted (nats-server answers a retry of it 409 10158 from about 4 s on, the first attempts
time out at 2 s each) and well under the 10 s after which a leader without quorum steps down"""


async def test_a_write_retried_while_its_first_attempt_is_in_process_is_stored_once(tmp_path):
    """Issue 30: on a three-node cluster the ledger's stream leader loses both followers, so the
    write it proposed is neither stored nor refused; the registry's retry (same Nats-Msg-Id) is
    answered 409 "duplicate message id is in process", which used to stop the registry. It is
    waited out: once a follower is back the first attempt is stored and the retry answered as
    its duplicate, so the journal's sequence and the stream's agree, with one entry."""
    with start_nats_cluster(tmp_path / "nats") as cluster:
        run = f"jr{uuid.uuid4().hex[:8]}"
        bus = await Bus.connect(BusConfig(url=cluster.url, stream_replicas=3), run=run, service="registry")
        try:
            journal = await open_journal(bus, snapshot_every=1000)
            journal.apply(j.AdapterOp(p.adapter_facts(ready(run, 0))))
            await journal.commit()
            before = journal.seq
            leader = (await bus.js.stream_info(journal.stream)).cluster.leader
            answers: list[BaseException] = []
            publish_expect = bus.publish_expect

            async def recorded(*args, **kwargs) -> int:
                try:
                    return await publish_expect(*args, **kwargs)
                except Exception as exc:
                    answers.append(exc)
                    raise

            bus.publish_expect = recorded  # type: ignore[method-assign]
            followers = [node for node in cluster.nodes if node.cluster and node.cluster.server_name != leader]
            for node in followers:
                node.kill()
            journal.apply(j.AdmitOp(request(run, 1), 10.0, "tok"))
            commit = asyncio.create_task(journal.commit())
            await asyncio.sleep(IN_PROCESS_S)
            assert not commit.done(), f"the write ended without a quorum: {commit.exception()!r}"
            followers[0].spawn()
            await asyncio.wait_for(commit, j.RETRY_FOR_S)
            codes = [getattr(exc, "err_code", None) for exc in answers]
            assert 10158 in codes, [str(exc) for exc in answers]
            assert journal.seq == before + 1 == await bus.last_seq(journal.stream)
            entry = await bus.message(journal.stream, journal.seq)
            assert entry is not None and [type(op) for op in j.decode_entry(entry.data).ops] == [j.AdmitOp]
        finally:
            await bus.close()
