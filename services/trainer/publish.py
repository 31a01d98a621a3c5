"""Announcing an adapter version: the durable safetensors copy plus `AdapterReady`.

Every event carries the run's trainer epoch (`trainer_epoch`: drawn at the run's first start,
kept in the store beside the adapters). The event's msg_id is `adapter-<epoch>-v<N>`, and
before publishing the trainer asks the ADAPTERS stream whether its own `adapter.v<N>.ready`
(of its epoch) is already there: a retry or a restarted trainer can therefore never announce
one version twice, even after JetStream's dedup window, and an event of another epoch on that
subject (someone announcing the trainer's next number first) does not stop it. That look-up
(a JetStream round trip per version) is skipped where it cannot find anything (`Announced`):
in steady state, past the first version a trainer announces after it starts.

Order (`deliver`):
- object path: serialise, upload, then the event (it never names an object that is not
  stored; it carries the sha256).
- XCCL with members: the broadcast, and beside it (on the send's thread, while the buckets
  are on the wire) the `announced` marker (content `pending`) that takes the version's
  number; then at once the event (the members hold the version, the event names the object's
  uri and size but no sha256); only then, in a background thread (`sender.durable`), once the
  members released the version (their swap is done; at most `xccl.RELEASE_WAIT_S`), the copy
  is serialised from the very send set that was broadcast, uploaded (the store's put hashes
  it), and the marker sealed with its sha256 (`services.common.durable`: readers wait for the
  sealed marker and verify against it, so a late joiner still gets a verified object).
  Nothing is serialised or hashed before the event. The marker keeps the store the
  ledger of taken version numbers (`parse_adapter_version` counts it), so a trainer dying
  inside the upload window resumes above N instead of re-using N for other weights; if it
  resumes at N (its checkpoint of N, the same weights), `publish_adapter` stores the missing
  object and seals the marker. The next version's `deliver` waits for this upload (the
  buckets it reads are the next broadcast's) and raises its failure.
- XCCL with nobody in the group (v0, after a failure): upload first, as the object path.

The version's canary is no part of that order: the event says `canary_follows`, and the
canary goes out as its own message (`publish_canary`, AdapterCanary on `canary.v<N>`) once it
is computed and the event is out, bound to the event by trainer epoch, version and the
object's sha256 where the event names one. A trainer that dies between the two publishes it on
restart when it re-announces the version from its checkpoint (`ensure_canary`); one that
never comes back leaves the version withdrawn on every replica, never trusted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proto import codec, subjects
from proto.messages import AdapterCanary, AdapterReady, Canary, LoraSpec, ObjectPayload, Payload, XcclPayload
from services.common import adapter_io, durable, streams
from services.common.durable import ANNOUNCED_NAME, adapter_key, announced_key
from services.common.store import ObjectNotFound, ObjectRef, ObjectStore

if TYPE_CHECKING:
    import torch

    from services.common.bus import Bus
    from services.trainer.xccl_sender import XcclSender

log = logging.getLogger(__name__)
EPOCH_NAME = "trainer.epoch"

__all__ = [
    "Announced",
    "adapter_key",
    "announced_key",
    "deliver",
    "ensure_canary",
    "parse_adapter_version",
    "publish_adapter",
    "publish_canary",
    "trainer_epoch",
]


def adapter_msg_id(epoch: str, version: int) -> str:
    # the epoch in it: an event someone else published first with `adapter-v<N>` must not
    # make the server drop the trainer's own as a duplicate
    return f"adapter-{epoch}-v{version}"


def canary_msg_id(epoch: str, version: int) -> str:
    return f"canary-{epoch}-v{version}"


def epoch_key(run: str) -> str:
    return f"{run}/adapters/{EPOCH_NAME}"


def trainer_epoch(store: ObjectStore, run: str) -> str:
    """The run's trainer epoch: drawn at the run's first start, read back at every restart
    (the store is the trainer's own record of the run, as it is of taken version numbers)."""
    key = epoch_key(run)
    try:
        return store.get_bytes(store.uri_for(key), size=None).decode()
    except ObjectNotFound:
        epoch = secrets.token_hex(8)
        store.put_bytes(key, epoch.encode())
        log.info("trainer epoch of run %s: %s (new)", run, epoch)
        return epoch


def parse_adapter_version(run: str, key: str) -> int | None:
    """`<run>/adapters/v<N>/adapter_model.safetensors` (or its `announced.sha256` marker) -> N;
    None for any other key: the version numbers the store says are taken."""
    prefix = f"{run}/adapters/v"
    for name in (adapter_io.WEIGHTS_NAME, ANNOUNCED_NAME):
        suffix = f"/{name}"
        if key.startswith(prefix) and key.endswith(suffix):
            number = key[len(prefix) : -len(suffix)]
            return int(number) if number.isdigit() else None
    return None


def build_payloads(ref: ObjectRef, xccl: XcclPayload | None = None) -> list[Payload]:
    """Every way a receiver can get this version's weights: the object copy always (the
    durable one: late joiners, restarts, other hosts), the xccl handle beside it when the
    trainer broadcasts."""
    payloads: list[Payload] = [ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)]
    if xccl is not None:
        payloads.append(xccl)
    return payloads


def adapter_event(
    *,
    run: str,
    epoch: str,
    lora_name: str,
    version: int,
    payloads: list[Payload],
    lora: LoraSpec,
    trainer_step: int,
    canary_follows: bool = False,
) -> AdapterReady:
    return AdapterReady(
        run=run,
        trainer_epoch=epoch,
        lora_name=lora_name,
        version=version,
        parent_version=version - 1 if version > 0 else None,
        trainer_step=trainer_step,
        created_at=time.time(),
        lora=lora,
        payloads=payloads,
        canary_follows=canary_follows,
    )


def canary_message(event: AdapterReady, canary: Canary) -> AdapterCanary:
    """`canary` as the message that follows `event`, bound to its weights."""
    obj = event.object_payload()
    return AdapterCanary(
        run=event.run,
        trainer_epoch=event.trainer_epoch,
        version=event.version,
        adapter_sha256=obj.sha256 if obj is not None else None,
        canary=canary,
        created_at=time.time(),
    )


async def publish_canary(bus: Bus, event: AdapterReady, canary: Canary) -> None:
    """Publish the canary of the version `event` announced (after it: the message names the
    event's sha256); its msg_id makes a retry within the dedup window a duplicate."""
    if not event.canary_follows:
        raise ValueError(f"{event.adapter_name}: its event does not say canary_follows; replicas would never read it")
    subject = subjects.adapter_canary(event.run, event.version)
    await bus.publish(subject, canary_message(event, canary), msg_id=canary_msg_id(event.trainer_epoch, event.version))


async def ensure_canary(bus: Bus, run: str, version: int, epoch: str, canary: Canary) -> bool:
    """A version this trainer epoch announced before (a restart re-announcing its checkpoint's
    version): publish its canary if its event says one follows and none of this epoch is stored
    (the trainer died between the two). `canary` must be of the version's weights, as a resume
    from the version's own checkpoint gives. Whether it published."""
    event = await published_event(bus, run, version, epoch)
    if event is None or not event.canary_follows:
        return False
    try:
        stored = await bus.last(streams.CANARIES(run), AdapterCanary, subjects.adapter_canary(run, version))
    except codec.DecodeError:
        stored = None
    if stored is not None and stored.trainer_epoch == epoch:
        return False
    await publish_canary(bus, event, canary)
    log.info("v%d: published the canary its event promised (the announcing trainer died first)", version)
    return True


async def published_event(bus, run: str, version: int, epoch: str) -> AdapterReady | None:
    """This trainer epoch's `adapter.v<N>.ready`, if the stream holds it. Anything else on that
    subject (undecodable, or another epoch's: a forger announcing the trainer's next number) is
    not the trainer's and does not stop it announcing its own; receivers refuse it."""
    try:
        event = await bus.last(streams.ADAPTERS(run), AdapterReady, subjects.adapter_ready(run, version))
    except codec.DecodeError:
        event = None
    if event is not None and event.trainer_epoch != epoch:
        log.warning("v%d: the stream holds an event of trainer epoch %r, not ours (%r); announcing ours",
                    version, event.trainer_epoch, epoch)  # fmt: skip
        return None
    return event


@dataclass
class Announced:
    """Which versions of a run this trainer may find announced by its epoch already, so that
    `publish_adapter` asks the stream (`published_event`) about those only. One per run's life
    in a trainer process (a `runs.Rank0`); `stored`: the highest version the store held when
    that life began (`resume.highest_stored_version`), None when it held none.

    Why the others cannot be: every event follows its version's claim in the store (the object
    or the `announced` marker: `deliver`), so the stream holds the epoch's events of versions up
    to `stored` at most when the life begins; after that, only this life announces the run, and
    it is asked about each version it announces. So once the life's first version has been
    looked up (where a restart re-announces its checkpoint's version), a version above both it
    and `stored`, and above every version announced since, was never announced."""

    stored: int | None = None
    clear_above: int | None = None
    """versions above it were never announced by this epoch; None: look every version up (the
    life's first version has not been)"""

    def begin(self, stored: int | None) -> None:
        """A new life of the run (its start, `stored` as above): the next version is looked up."""
        self.stored, self.clear_above = stored, None

    def needs_lookup(self, version: int) -> bool:
        return self.clear_above is None or version <= self.clear_above

    def announced(self, version: int) -> None:
        """`version` was looked up (announced before, or not) or announced now."""
        floor = max(version, -1 if self.stored is None else self.stored)
        self.clear_above = floor if self.clear_above is None else max(self.clear_above, version)


def _checked_put(store: ObjectStore, key: str, weights: bytes, sha256: str) -> ObjectRef:
    ref = store.put_bytes(key, weights)
    if ref.sha256 != sha256:
        raise RuntimeError(
            f"store returned sha256 {ref.sha256} for {key}, expected {sha256}; the object store corrupted the upload"
        )
    return ref


def _claim(store: ObjectStore, run: str, version: int) -> None:
    """Take the version's number before its event: the marker, not yet holding a sha256."""
    store.put_bytes(announced_key(run, version), durable.PENDING)


def _seal(store: ObjectStore, run: str, version: int, sha256: str) -> None:
    store.put_bytes(announced_key(run, version), sha256.encode())


def _store_and_seal(store: ObjectStore, run: str, version: int, weights: bytes) -> ObjectRef:
    ref = _checked_put(store, adapter_key(run, version), weights, adapter_io.sha256(weights))
    _seal(store, run, version, ref.sha256)
    return ref


def _store_in_background(
    store: ObjectStore,
    run: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    size: int,
    buffer: torch.Tensor,
    first: Callable[[], object],
) -> concurrent.futures.Future:
    """After `first()` returns (the members' swap is done: `XcclSender.wait_released`),
    serialise `tensors` into `buffer`, upload, and seal the marker with the sha256, in a
    thread; the future holds the ref.

    Serialised with `adapter_io.serialize_into` (warm buffer, torch copies): `to_bytes` here
    held the GIL ~25-35 ms at 37 MB, and the trainer's event loop (and, in the benchmark,
    the process timing the replicas) stalled behind it. Hashed once, by the store's put, from
    that private buffer: nothing else writes it, so a second hash of the same memory (as the
    object path does to check a put against bytes it hashed first) would only repeat it."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    key = adapter_key(run, version)

    def run_() -> None:
        # behind the hot path, not in its way: the replicas' swap and the next step may share
        # these cores (Linux: a thread's own nice value)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            first()
            data = adapter_io.serialize_into(tensors, buffer)
            if data.numel() != size:
                raise RuntimeError(f"{key}: serialised to {data.numel()} bytes, the event announced {size}")
            ref = store.put_bytes(key, data.numpy().data)
            _seal(store, run, version, ref.sha256)
            fut.set_result(ref)
        except BaseException as exc:  # surfaced at the next version / close
            log.error("durable copy %s failed: %r", key, exc)
            fut.set_exception(exc)

    threading.Thread(target=run_, name=f"durable-{key}", daemon=False).start()
    return fut


async def deliver(
    store: ObjectStore,
    *,
    run: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    publish: Callable[[list[Payload]], Awaitable[None]],
    sender: XcclSender | None = None,
    weights: bytes | None = None,
) -> list[Payload]:
    """Store and/or broadcast `tensors` as `version` and call `publish(payloads)` (an async
    callable that sends the event) at the earliest moment the order in the module docstring
    allows; returns the payloads. `weights`: the serialised tensors when the caller has them
    already (a resumed checkpoint)."""
    key = adapter_key(run, version)

    async def serialised() -> bytes:
        return weights if weights is not None else await asyncio.to_thread(adapter_io.to_bytes, tensors)

    if sender is None:
        data = await serialised()
        ref = await asyncio.to_thread(_checked_put, store, key, data, adapter_io.sha256(data))
        payloads = build_payloads(ref)
        await publish(payloads)
        return payloads
    previous, sender.durable = sender.durable, None
    if previous is not None:  # one upload in flight at most; its failure stops the trainer
        await asyncio.wrap_future(previous)
    # the marker is written while the buckets are on the wire (one thread: a second one
    # starting beside the send cost ~1 ms before the header on 2 shared cores)
    xp = await asyncio.to_thread(sender.send, version, tensors, lambda: _claim(store, run, version))
    if not xp.ranks:  # nobody holds it yet: everyone reads the object, so store it first
        ref = await asyncio.to_thread(_store_and_seal, store, run, version, await serialised())
        payloads = build_payloads(ref, xp)
        await publish(payloads)
        return payloads
    size = sender.object_size()
    payloads = [ObjectPayload(uri=store.uri_for(key), bytes=size), xp]
    await publish(payloads)
    # the send set holds exactly what was broadcast and is not written again before the next
    # `deliver`, which waits for this future
    epoch = sender.epoch
    sender.durable = _store_in_background(
        store,
        run,
        version,
        sender.last_sent(),
        size,
        sender.durable_buffer(),
        lambda: sender.wait_released(epoch, version),
    )
    return payloads


async def _repair(
    store: ObjectStore,
    event: AdapterReady | None,
    run: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    weights: bytes | None,
) -> None:
    """A version announced before its durable copy was sealed (XCCL) by a trainer that then
    died: store the object and seal the marker now, when these are the announced weights."""
    obj = event.object_payload() if event is not None else None
    if obj is None:
        return
    announced = obj.sha256 or await asyncio.to_thread(durable.stored_digest, store, obj.uri)
    if announced is not None and await asyncio.to_thread(store.exists, adapter_key(run, version)):
        return
    data = weights if weights is not None else await asyncio.to_thread(adapter_io.to_bytes, tensors)
    sha = adapter_io.sha256(data)
    if announced is not None and sha != announced:
        log.error(
            "v%d was announced with sha256 %s but never stored, and the weights at hand "
            "are %s: readers of v%d cannot get its object copy",
            version,
            announced[:12],
            sha[:12],
            version,
        )
        return
    # announced is None: the event went out before hashing; the weights at hand are the
    # checkpoint of this very version (`resume_plan` re-announces N only from N's checkpoint)
    await asyncio.to_thread(_store_and_seal, store, run, version, data)
    log.info("v%d: stored the object copy its event named (the announcing trainer died first)", version)


async def publish_adapter(
    bus: Bus,
    store: ObjectStore,
    *,
    run: str,
    epoch: str,
    lora_name: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    lora: LoraSpec,
    trainer_step: int,
    sender: XcclSender | None = None,
    weights: bytes | None = None,
    canary_follows: bool = False,
    announced: Announced | None = None,
) -> AdapterReady | None:
    """Store and/or broadcast `tensors` as version `version` and announce it (see `deliver`
    for the order), on either path; returns the event, or None when this version had been
    announced already by this trainer epoch (then only a missing object copy of the same
    weights is stored). `canary_follows`: the caller publishes the version's canary after the
    event (`publish_canary`); the event never waits for it. `announced`: the run's record in
    this trainer (`Announced`), which spares the stream a look-up where it cannot find one;
    None: every version is looked up."""
    if announced is None or announced.needs_lookup(version):
        previous = await published_event(bus, run, version, epoch)
        if announced is not None:
            announced.announced(version)
        if previous is not None:
            await _repair(store, previous, run, version, tensors, weights)
            return None
    sent: list[AdapterReady] = []

    async def publish(payloads: list[Payload]) -> None:
        event = adapter_event(run=run, epoch=epoch, lora_name=lora_name, version=version, payloads=payloads,
                              lora=lora, trainer_step=trainer_step, canary_follows=canary_follows)  # fmt: skip
        await bus.publish(subjects.adapter_ready(run, version), event, msg_id=adapter_msg_id(epoch, version))
        sent.append(event)

    await deliver(store, run=run, version=version, tensors=tensors, publish=publish, sender=sender, weights=weights)
    if announced is not None:
        announced.announced(version)
    return sent[0]
