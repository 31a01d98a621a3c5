"""The XCCL weight-sync group with real processes over gloo: join, broadcast, swap, re-form,
and SIGKILL of a replica or of the trainer in the middle of a broadcast.

Replicas (and, for the trainer-death case, the trainer) are child processes running this file
(`python test_xccl_group.py replica|trainer ...`) driven by JSON lines on stdin/stdout; each
replica holds a real `LoraSlots` pool on a small model, so "serves version v" is checked on the
slot contents themselves (the head slot's A/B re-read and hashed), not on a flag; with `--adopt`
its slot is the staging set the version landed in (`XcclReceiver.adopt`), re-read alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
from torch import nn

from tests.fixtures.faults import KillAtBroadcast
from tests.fixtures.waiting import until

ROOT = Path(__file__).resolve().parents[2]
LAYERS, DIM, RANK = 4, 64, 8
BUCKET = 2048  # bytes: 4 KiB of A and B per layer -> a dozen buckets per version
TIMEOUT_S = 4.0

pytestmark = pytest.mark.timeout(120)


def adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        out[f"base_model.model.l{i}.lora_A.weight"] = torch.randn(RANK, DIM, generator=g)
        out[f"base_model.model.l{i}.lora_B.weight"] = torch.randn(DIM, RANK, generator=g)
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- child processes ---------------------------------------------------------------------------


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def replica_main(name: str, kill_after: int | None, adopt: bool = False) -> None:
    from proto.messages import XcclPayload
    from services.common import xccl
    from services.rollout.lora_slots import LoraSlots
    from services.rollout.xccl_receiver import XcclReceiver

    if kill_after is not None:
        real = xccl.new_group
        xccl.new_group = lambda *a, **k: KillAtBroadcast(real(*a, **k), kill_after)
    model = nn.Module()
    for i in range(LAYERS):
        setattr(model, f"l{i}", nn.Linear(DIM, DIM, bias=False))
    slots = LoraSlots(model, [f"l{i}" for i in range(LAYERS)], RANK, slots=3)
    import logging

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(message)s")
    rx = XcclReceiver(name, timeout_s=TIMEOUT_S)
    adopted: tuple[int, dict[str, torch.Tensor]] | None = None
    """--adopt: the version served and its slot, the staging set it landed in"""
    _emit({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "event":
            payload = msgspec.json.decode(json.dumps(cmd["payload"]).encode(), type=XcclPayload)
            v = cmd["version"]
            rx.observe(payload, v)
            got = rx.take(v, payload)
            if got is None:
                _emit({"version": v, "via": "none"})
                continue
            sha = digest(got)
            if adopt:
                previous, adopted = adopted, (v, got)
                rx.adopt(v)
                if previous is not None:
                    rx.release(previous[0])
                _emit({"version": v, "via": "xccl", "sha": sha})
                continue
            for old in [x for x in slots.versions() if x != slots.head]:
                slots.unload(old)
            slots.load(v, got, 1.0)
            slots.set_head(v)
            rx.release(v)
            _emit({"version": v, "via": "xccl", "sha": sha})
        elif cmd["cmd"] == "wait_joined":
            deadline = time.monotonic() + 10
            while rx.joined is None or rx.joined[1] != cmd["port"]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            _emit({"joined": rx.joined})
        elif cmd["cmd"] == "status":
            head = slots.head
            held: dict[str, torch.Tensor] = {}
            if adopt and adopted is not None:
                head, held = adopted
            elif head is not None:
                s = slots.table.slot_of(head)
                for path, layer in slots.layers.items():
                    held[f"base_model.model.{path}.lora_A.weight"] = layer.a[s, :RANK].clone()
                    held[f"base_model.model.{path}.lora_B.weight"] = layer.b[s, :, :RANK].clone()
            _emit(
                {
                    "head": head,
                    "head_sha": digest(held) if held else None,
                    "group": rx.group,
                    "staged": sorted(rx._staged),
                }
            )


def trainer_main(kill_after: int | None, kill_version: int | None) -> None:
    from services.trainer.xccl_sender import XcclSender

    sender = XcclSender(address="127.0.0.1", port=0, backend="gloo", bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
    _emit({"port": sender.port})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["version"] == kill_version and sender.pg is not None:
            sender.pg = KillAtBroadcast(sender.pg, kill_after)
        payload = sender.send(cmd["version"], adapter(cmd["seed"]))
        _emit({"payload": json.loads(msgspec.json.encode(payload)), "error": sender.stats.error})


class Child:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.environ.get("XCCL_CHILD_LOG", os.devnull), "a"),
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.first = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"child {self.proc.args[2:]} exited ({self.proc.poll()})")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def event(self, version: int, payload) -> dict:
        return self.ask(cmd="event", version=version, payload=as_json(payload))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def as_json(payload) -> dict:
    return payload if isinstance(payload, dict) else json.loads(msgspec.json.encode(payload))


@pytest.fixture
def children():
    made: list[Child] = []

    def spawn(*args: str) -> Child:
        made.append(Child(*args))
        return made[-1]

    yield spawn
    for c in made:
        c.stop()


def wait_joins(sender, n: int, timeout: float = 10.0) -> None:
    """Until `n` joins were registered in the sender's store (joins are asynchronous)."""
    until(lambda: sender.store.add("join_seq", 0) >= n, timeout, f"{n} replicas to join", interval=0.02)


def in_process_sender():
    from services.trainer.xccl_sender import XcclSender

    return XcclSender(address="127.0.0.1", port=0, backend="gloo", bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)


def test_replicas_join_receive_every_version_exactly_idle_or_not_and_a_late_joiner_reforms(children):
    sender = in_process_sender()
    try:
        handle = sender.send(0, adapter(0))
        assert handle.ranks == {} and handle.world_size == 1  # nobody joined yet: a bare handle
        r0, r1 = children("replica", "r0"), children("replica", "r1")
        for r in (r0, r1):  # v0 reaches them by the object copy; seeing its handle = joining
            assert r.event(0, handle)["via"] == "none"
        wait_joins(sender, 2)
        for v in (1, 2, 3):
            if v == 3:  # members idle in the header receive longer than the bucket timeout
                time.sleep(TIMEOUT_S + 1)
            tensors = adapter(v)
            p = sender.send(v, tensors)
            assert set(p.ranks) == {"r0", "r1"} and p.world_size == 3, sender.stats
            assert sender.stats.reformed == (v == 1)
            for r in (r0, r1):
                out = r.event(v, p)
                assert out == {"version": v, "via": "xccl", "sha": digest(tensors)}
            assert r0.ask(cmd="status")["head_sha"] == digest(tensors)
        first_group = p.group_name

        r2 = children("replica", "r2")  # a late joiner: object copy for v3, then in the group
        assert r2.event(3, p)["via"] == "none"
        wait_joins(sender, 3)
        p4 = sender.send(4, adapter(4))
        assert sender.stats.reformed and p4.group_name != first_group
        assert set(p4.ranks) == {"r0", "r1", "r2"}
        for r in (r0, r1, r2):
            assert r.event(4, p4)["via"] == "xccl"
        # a replica in the event's ranks but asked about another group gets None (object copy)
        stale = msgspec.structs.replace(p4, group_name=first_group)
        assert r0.event(4, stale)["via"] == "none"
    finally:
        sender.close()


def test_a_replica_killed_mid_broadcast_does_not_hang_the_trainer_and_the_survivor_keeps_up(children):
    sender = in_process_sender()
    try:
        handle = sender.send(0, adapter(0))
        victim = children("replica", "victim", "--kill-after", "3")  # dies inside the 1st send
        survivor = children("replica", "survivor")
        for r in (victim, survivor):
            r.event(0, handle)
        wait_joins(sender, 2)
        t0 = time.monotonic()
        p1 = sender.send(1, adapter(1))
        took = time.monotonic() - t0
        assert victim.proc.wait(timeout=5) == -signal.SIGKILL
        assert p1.ranks == {} and sender.stats.error, sender.stats  # nobody is told to swap v1
        assert took < TIMEOUT_S * 3, f"the trainer was held {took:.1f}s"
        # the survivor got no partial v1: it serves nothing new and falls back for v1
        assert survivor.event(1, p1)["via"] == "none"
        assert survivor.ask(cmd="status")["staged"] == []
        # it re-joins on its own (2nd join); the next version reaches it by broadcast again
        wait_joins(sender, 3)
        tensors = adapter(2)
        p2 = sender.send(2, tensors)
        assert set(p2.ranks) == {"survivor"}, sender.stats
        assert survivor.event(2, p2) == {"version": 2, "via": "xccl", "sha": digest(tensors)}
    finally:
        sender.close()


@pytest.mark.parametrize("slot", ["copy", "adopt"])
def test_a_trainer_killed_mid_broadcast_leaves_the_replica_on_its_previous_version(children, slot):
    """Copied into a LoraSlots slot or adopted as the slot: the torn v2 lands in a free staging
    set, is never staged and never handed over, even to an event that names this replica."""
    trainer = children("trainer", "--kill-version", "2", "--kill-after", "2")
    replica = children("replica", "r0", *(["--adopt"] if slot == "adopt" else []))
    handle = trainer.ask(version=0, seed=0)["payload"]
    replica.event(0, handle)
    assert replica.ask(cmd="wait_joined", port=handle["master_port"])["joined"]
    v1 = adapter(1)
    p1 = trainer.ask(version=1, seed=1)["payload"]
    assert replica.event(1, p1) == {"version": 1, "via": "xccl", "sha": digest(v1)}

    trainer.proc.stdin.write(json.dumps({"version": 2, "seed": 2}) + "\n")
    trainer.proc.stdin.flush()
    assert trainer.proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 3 * TIMEOUT_S
    while (status := replica.ask(cmd="status"))["group"] is not None and time.monotonic() < deadline:
        time.sleep(0.1)  # the receiver notices the dead peer and drops the partial v2
    assert status["head"] == 1 and status["head_sha"] == digest(v1), status
    # an adopted v1 stays with the replica (its set is its slot); nothing else is staged
    assert status["staged"] == ([1] if slot == "adopt" else []) and status["group"] is None, status
    assert replica.event(2, p1)["via"] == "none"  # an event naming r0 for the torn v2: refused

    # a restarted trainer has a new handle: the replica joins it from the next event
    trainer2 = children("trainer")
    h2 = trainer2.ask(version=2, seed=22)["payload"]
    assert replica.event(2, h2)["via"] == "none"  # v2 of the new trainer: the object copy
    assert replica.ask(cmd="wait_joined", port=h2["master_port"])["joined"]
    v3 = adapter(3)
    p3 = trainer2.ask(version=3, seed=3)["payload"]
    assert p3["ranks"] == {"r0": 1}
    assert replica.event(3, p3) == {"version": 3, "via": "xccl", "sha": digest(v3)}


def test_deliver_announces_right_after_the_broadcast_and_seals_the_verified_copy_behind_it(tmp_path):
    """publish.deliver's order: nobody in the group -> object stored (and marker sealed) before
    the event, which carries the sha256; members -> the event once they hold it, with the
    `announced` marker pending and nothing serialised yet (no sha256 in the event); the copy
    then lands in the background, serialised from the broadcast buckets, and readers verify it
    against the sealed marker."""
    import asyncio

    from services.common import adapter_io, durable
    from services.common.store import ObjectNotFound, open_store
    from services.config.schema import StoreConfig
    from services.rollout.xccl_receiver import XcclReceiver
    from services.trainer import publish as pub

    store = open_store(StoreConfig(uri=f"file://{tmp_path / 'store'}"))
    sender = in_process_sender()
    rx = XcclReceiver("r0", timeout_s=TIMEOUT_S)
    seen: list[tuple] = []

    def deliver(version: int, tensors: dict[str, torch.Tensor]):
        async def publish(payloads):
            marker = store.get_bytes(store.uri_for(pub.announced_key("run", version)))
            seen.append((version, payloads, store.exists(pub.adapter_key("run", version)), marker))

        asyncio.run(pub.deliver(store, run="run", version=version, tensors=tensors, publish=publish, sender=sender))

    try:
        deliver(0, adapter(0))
        v, payloads, stored, marker = seen[-1]
        w0 = adapter_io.to_bytes(adapter(0))
        assert payloads[1].ranks == {} and stored and marker == adapter_io.sha256(w0).encode()
        assert payloads[0].sha256 == adapter_io.sha256(w0)  # the object path's order
        rx.observe(payloads[1], 0)
        wait_joins(sender, 1)
        v1 = adapter(1)
        deliver(1, v1)
        for t in v1.values():  # the trainer trains on right after the event: the copy must not care
            t.zero_()
        v, payloads, stored, marker = seen[-1]
        obj, xp = payloads
        w1 = adapter_io.to_bytes(adapter(1))
        assert xp.ranks == {"r0": 1} and marker == durable.PENDING and not stored
        assert obj.sha256 is None and obj.bytes == len(w1)
        assert obj.uri == store.uri_for(pub.adapter_key("run", 1))
        got = rx.take(1, xp)
        assert got is not None and digest(got) == digest(adapter(1))
        rx.release(1)
        sender.durable.result(timeout=10)  # the background copy lands, sealed
        assert durable.stored_digest(store, obj.uri) == adapter_io.sha256(w1)
        assert durable.read(store, obj) == w1
        # a reader that finds the marker pending waits; one that finds other bytes fails
        store.put_bytes(pub.announced_key("run", 1), durable.PENDING)
        with pytest.raises(ObjectNotFound):
            durable.read(store, obj)
        store.put_bytes(pub.announced_key("run", 1), adapter_io.sha256(w0).encode())
        with pytest.raises(Exception, match="sha256 mismatch"):
            durable.read(store, obj)
        # the marker counts as a taken number for a resuming trainer
        assert pub.parse_adapter_version("run", pub.announced_key("run", 7)) == 7
    finally:
        sender.close()
        rx.close()


def test_versions_written_into_the_send_sets_arrive_like_packed_ones_and_the_copy_waits_for_the_swap(tmp_path):
    """The fast path against the reference: a version the trainer wrote into `fill_views`
    (no pack) reaches the member bit for bit like a packed one, the two send sets take turns
    so the set the durable copy reads is never the one being written, and the durable copy
    starts only when the member released the version (or its take came back None), or at the
    latest after `release_wait_s`: it is always stored, sealed and verifiable."""
    import asyncio

    from services.common import adapter_io, durable
    from services.common.store import open_store
    from services.config.schema import StoreConfig
    from services.rollout.xccl_receiver import XcclReceiver
    from services.trainer import publish as pub

    store = open_store(StoreConfig(uri=f"file://{tmp_path / 'store'}"))
    sender = in_process_sender()
    sender.release_wait_s = 30.0  # so a copy done within 10 s was released
    rx = XcclReceiver("r0", timeout_s=TIMEOUT_S)
    sent: list = []

    def deliver(version: int, tensors) -> tuple:
        async def publish(payloads):
            sent.append(payloads)

        asyncio.run(pub.deliver(store, run="run", version=version, tensors=tensors, publish=publish, sender=sender))
        return tuple(sent[-1])

    def filled(seed: int):
        views = sender.fill_views()
        assert views is not None
        for name, t in adapter(seed).items():
            views[name].copy_(t)
        return views

    def stored(version: int) -> bytes:
        obj = sent[-1][0]
        assert obj.uri == store.uri_for(pub.adapter_key("run", version))
        return durable.read(store, obj)

    try:
        assert sender.fill_views() is None  # no layout before the first version
        _, handle = deliver(0, adapter(0))
        rx.observe(handle, 0)
        wait_joins(sender, 1)

        v1 = filled(1)
        _, xp = deliver(1, v1)
        assert xp.ranks == {"r0": 1} and not sender.stats.packed and sender.stats.pack_s == 0
        time.sleep(0.3)
        assert not sender.durable.done()  # the member has not swapped yet
        got = rx.take(1, xp)
        assert got is not None and digest(got) == digest(adapter(1))
        rx.release(1)
        sender.durable.result(timeout=10)
        assert stored(1) == adapter_io.to_bytes(adapter(1))

        v2 = filled(2)  # the other set: writing it leaves v1's (what its copy read) as sent
        assert {t.data_ptr() for t in v2.values()}.isdisjoint(t.data_ptr() for t in sender.last_sent().values())
        assert digest(sender.last_sent()) == digest(adapter(1))
        _, xp2 = deliver(2, v2)
        # an event this member cannot use (other shapes): None, and the copy need not wait
        other = msgspec.structs.replace(
            xp2, tensors=[*xp2.tensors[:-1], msgspec.structs.replace(xp2.tensors[-1], shape=[1])]
        )
        assert rx.take(2, other) is None
        sender.durable.result(timeout=10)
        assert stored(2) == adapter_io.to_bytes(adapter(2))

        _, xp3 = deliver(3, adapter(3))  # the reference path: packed into the free set
        assert sender.stats.packed and xp3.ranks == {"r0": 1}
        got = rx.take(3, xp3)
        assert got is not None and digest(got) == digest(adapter(3))
        rx.release(3)
        sender.durable.result(timeout=10)
        assert stored(3) == adapter_io.to_bytes(adapter(3))

        sender.release_wait_s = 0.3
        deliver(4, filled(4))  # nobody ever takes v4: the copy lands anyway
        sender.durable.result(timeout=10)
        assert stored(4) == adapter_io.to_bytes(adapter(4))
    finally:
        sender.close()
        rx.close()


def test_an_adopted_staging_set_serves_as_the_slot_and_is_never_received_into_until_released():
    """`adopt` against the copy (the reference path): the adopted views hold exactly what a
    copy of them holds; the trainer hears the swap at `adopt`, not at `release`; while the
    caller holds sets, new versions land in other ones (a new set when it holds them all), so
    an adopted version is never overwritten; after `release` its set is received into again."""
    from services.rollout.xccl_receiver import XcclReceiver

    sender = in_process_sender()
    sender.release_wait_s = 5.0
    rx = XcclReceiver("r0", timeout_s=TIMEOUT_S)
    try:
        rx.observe(sender.send(0, adapter(0)), 0)
        wait_joins(sender, 1)
        held: dict[int, dict[str, torch.Tensor]] = {}
        for v in (1, 2, 3):
            xp = sender.send(v, adapter(v))
            assert xp.ranks == {"r0": 1}, sender.stats
            got = rx.take(v, xp)
            assert got is not None
            copied = {n: t.clone() for n, t in got.items()}  # the copying consumer's slot
            assert digest(got) == digest(copied) == digest(adapter(v))
            t0 = time.monotonic()
            rx.adopt(v)
            assert sender.wait_released(sender.epoch, v) and time.monotonic() - t0 < 2.0
            held[v] = got
        assert len(rx._sets) == 3  # the caller holds every set: one more was made for v3
        ptrs = {v: {t.data_ptr() for t in views.values()} for v, views in held.items()}
        assert ptrs[1].isdisjoint(ptrs[2]) and ptrs[2].isdisjoint(ptrs[3]) and ptrs[1].isdisjoint(ptrs[3])
        xp4 = sender.send(4, adapter(4))  # nobody takes v4: it lands in a fourth set, not a held one
        for v, views in held.items():
            assert digest(views) == digest(adapter(v)), f"adopted v{v} was overwritten"
        rx.release(1)
        rx.release(2)
        xp5 = sender.send(5, adapter(5))  # an unclaimed v4 and two released sets: any of them
        got5 = rx.take(5, xp5)
        assert got5 is not None and digest(got5) == digest(adapter(5))
        assert rx.take(4, xp4) is None  # older than a taken version and never claimed: gone
        assert digest(held[3]) == digest(adapter(3))
        rx.release(3)
        rx.release(5)
    finally:
        sender.close()
        rx.close()


def test_a_resumed_trainer_stores_and_seals_a_copy_its_predecessor_announced_but_never_stored(tmp_path):
    import asyncio

    from proto.messages import AdapterReady, LoraSpec, ObjectPayload
    from services.common import adapter_io, durable
    from services.common.store import open_store
    from services.config.schema import StoreConfig
    from services.trainer import publish as pub

    store = open_store(StoreConfig(uri=f"file://{tmp_path / 'store'}"))
    tensors = adapter(3)
    w = adapter_io.to_bytes(tensors)
    store.put_bytes(pub.announced_key("run", 3), durable.PENDING)  # died inside the upload window
    obj = ObjectPayload(uri=store.uri_for(pub.adapter_key("run", 3)), bytes=len(w))
    lora = LoraSpec(rank=RANK, alpha=16.0, target_modules=["l"], base_model="m")
    ev = AdapterReady(
        run="run",
        trainer_epoch="e0",
        lora_name="l",
        version=3,
        trainer_step=3,
        created_at=1.0,
        lora=lora,
        payloads=[obj],
    )
    asyncio.run(pub._repair(store, ev, "run", 3, tensors, None))
    assert durable.read(store, obj) == w


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["replica", "trainer"])
    ap.add_argument("name", nargs="?", default="r0")
    ap.add_argument("--kill-after", type=int, default=None)
    ap.add_argument("--kill-version", type=int, default=None)
    ap.add_argument("--adopt", action="store_true")
    a = ap.parse_args()
    if a.role == "replica":
        replica_main(a.name, a.kill_after, a.adopt)
    else:
        trainer_main(a.kill_after, a.kill_version)


def test_a_trainer_that_closes_its_group_is_not_called_again_and_a_new_one_is_joined():
    """The trainer's close sends END naming no next group: the replica leaves and waits for a
    new handle instead of reconnecting to the closed address every RETRY_S (each attempt a
    connect timeout and c10d's stack trace in the log); a new trainer's handle is joined."""
    from services.rollout.xccl_receiver import RETRY_S, XcclReceiver

    sender = in_process_sender()
    rx = XcclReceiver("r0", timeout_s=TIMEOUT_S)
    try:
        rx.observe(sender.send(0, adapter(0)), 0)
        wait_joins(sender, 1)
        xp = sender.send(1, adapter(1))
        assert xp.ranks == {"r0": 1} and rx.take(1, xp) is not None
        rx.release(1)
        sender.close()
        until(lambda: rx._target is None, 10.0, "the replica to drop the closed trainer's address", interval=0.02)
        sessions = rx.sessions
        time.sleep(10 * RETRY_S)
        assert rx.sessions == sessions and rx.group is None
        successor = in_process_sender()
        try:
            rx.observe(successor.send(2, adapter(2)), 2)
            wait_joins(successor, 1)
            xp3 = successor.send(3, adapter(3))
            got = rx.take(3, xp3)
            assert xp3.ranks == {"r0": 1} and got is not None and digest(got) == digest(adapter(3))
            rx.release(3)
        finally:
            successor.close()
    finally:
        rx.close()
