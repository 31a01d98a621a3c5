"""Announcing an adapter version: the durable safetensors copy plus `AdapterReady`.

Every event carries the run's trainer epoch (`trainer_epoch`: drawn at the run's first start,
kept in the store beside the adapters). The event's msg_id is `adapter-<epoch>-v<N>`, and
before publishing the trainer asks the ADAPTERS stream whether its own `adapter.v<N>.ready`
(of its epoch) is already there: a retry or a restarted trainer can therefore never announce
one version twice, even after JetStream's dedup window, and an event of another epoch on that
subject (someone announcing the trainer's next number first) does not stop it.

Order (`deliver`):
- object path: upload, then the event (it never names an object that is not stored).
- XCCL with members: broadcast, and beside it the sha256 of the bytes and a small
  `announced` marker under the version's key; then the event (the members hold the version
  already, the event carries the object's uri/bytes/sha256); then the upload, in the
  background (`sender.durable`). Readers of the object tolerate it appearing up to an upload
  time after the event (`xccl.fetch_when_stored`). The marker keeps the store the ledger of
  taken version numbers (`parse_adapter_version` counts it), so a trainer dying inside the
  upload window resumes above N instead of re-using N for other weights; if it resumes at N
  with the same bytes (its checkpoint), `publish_adapter` uploads the missing object.
  The next version's `deliver` waits for this upload and raises its failure.
- XCCL with nobody in the group (v0, after a failure): upload first, as the object path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from proto import codec, subjects
from proto.messages import AdapterReady, LoraSpec, ObjectPayload, Payload, XcclPayload
from services.common import adapter_io, streams
from services.common.store import ObjectNotFound, ObjectRef, ObjectStore

if TYPE_CHECKING:
    import torch

    from services.common.bus import Bus
    from services.trainer.xccl_sender import XcclSender

log = logging.getLogger(__name__)
ANNOUNCED_NAME = "announced.sha256"
EPOCH_NAME = "trainer.epoch"


def adapter_key(run: str, version: int) -> str:
    return f"{run}/adapters/v{version}/{adapter_io.WEIGHTS_NAME}"


def adapter_msg_id(epoch: str, version: int) -> str:
    # the epoch in it: an event someone else published first with `adapter-v<N>` must not
    # make the server drop the trainer's own as a duplicate
    return f"adapter-{epoch}-v{version}"


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


def announced_key(run: str, version: int) -> str:
    return f"{run}/adapters/v{version}/{ANNOUNCED_NAME}"


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
    )


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


def _checked_put(store: ObjectStore, key: str, weights: bytes, sha256: str) -> ObjectRef:
    ref = store.put_bytes(key, weights)
    if ref.sha256 != sha256:
        raise RuntimeError(
            f"store returned sha256 {ref.sha256} for {key}, expected {sha256}; the object store corrupted the upload"
        )
    return ref


def _claim(store: ObjectStore, run: str, version: int, key: str, weights: bytes) -> ObjectRef:
    """The object's reference before it is stored, and the marker that takes its number."""
    sha = adapter_io.sha256(weights)
    store.put_bytes(announced_key(run, version), sha.encode())
    return ObjectRef(uri=store.uri_for(key), bytes=len(weights), sha256=sha)


def _upload_in_background(store: ObjectStore, key: str, weights: bytes, sha256: str) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(_checked_put(store, key, weights, sha256))
        except BaseException as exc:  # surfaced at the next version / close
            log.error("durable copy %s failed: %r", key, exc)
            fut.set_exception(exc)

    threading.Thread(target=run, name=f"upload-{key}", daemon=False).start()
    return fut


async def deliver(
    store: ObjectStore,
    *,
    run: str,
    version: int,
    weights: bytes,
    publish: Callable[[list[Payload]], Awaitable[None]],
    sender: XcclSender | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> list[Payload]:
    """Store and broadcast `weights`/`tensors` as `version` and call `publish(payloads)` (an
    async callable that sends the event) at the earliest moment the order in the module
    docstring allows; returns the payloads."""
    key = adapter_key(run, version)
    if sender is None:
        ref = await asyncio.to_thread(_checked_put, store, key, weights, adapter_io.sha256(weights))
        payloads = build_payloads(ref)
        await publish(payloads)
        return payloads
    if tensors is None:
        raise ValueError(f"v{version}: tensors: None with an XCCL sender; pass the adapter's tensors to broadcast")
    previous, sender.durable = sender.durable, None
    if previous is not None:  # one upload in flight at most; its failure stops the trainer
        await asyncio.wrap_future(previous)
    ref, xp = await asyncio.gather(
        asyncio.to_thread(_claim, store, run, version, key, weights),
        asyncio.to_thread(sender.send, version, tensors),
    )
    payloads = build_payloads(ref, xp)
    if not xp.ranks:  # nobody holds it yet: everyone reads the object, so store it first
        await asyncio.to_thread(_checked_put, store, key, weights, ref.sha256)
        await publish(payloads)
        return payloads
    await publish(payloads)
    sender.durable = _upload_in_background(store, key, weights, ref.sha256)
    return payloads


async def _repair(store: ObjectStore, event: AdapterReady | None, run: str, version: int, weights: bytes) -> None:
    """A version announced before its upload finished (XCCL) by a trainer that then died:
    store the object now when these are the announced bytes."""
    obj = event.object_payload() if event is not None else None
    key = adapter_key(run, version)
    if obj is None or await asyncio.to_thread(store.exists, key):
        return
    sha = adapter_io.sha256(weights)
    if sha != obj.sha256:
        log.error(
            "v%d was announced with sha256 %s but never stored, and the weights at hand "
            "are %s: readers of v%d cannot get its object copy",
            version,
            obj.sha256[:12],
            sha[:12],
            version,
        )
        return
    await asyncio.to_thread(_checked_put, store, key, weights, sha)
    log.info("v%d: stored the object copy its event named (the announcing trainer died first)", version)


async def publish_adapter(
    bus: Bus,
    store: ObjectStore,
    *,
    run: str,
    epoch: str,
    lora_name: str,
    version: int,
    weights: bytes,
    lora: LoraSpec,
    trainer_step: int,
    sender: XcclSender | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> AdapterReady | None:
    """Store `weights` as version `version` and announce it (see `deliver` for the order);
    returns the event, or None when this version had been announced already (then only a
    missing object copy of the same bytes is stored)."""
    previous = await published_event(bus, run, version, epoch)
    if previous is not None:
        await _repair(store, previous, run, version, weights)
        return None
    sent: list[AdapterReady] = []

    async def publish(payloads: list[Payload]) -> None:
        event = adapter_event(run=run, epoch=epoch, lora_name=lora_name, version=version, payloads=payloads,
                              lora=lora, trainer_step=trainer_step)  # fmt: skip
        await bus.publish(subjects.adapter_ready(run, version), event, msg_id=adapter_msg_id(epoch, version))
        sent.append(event)

    await deliver(store, run=run, version=version, weights=weights, publish=publish, sender=sender, tensors=tensors)
    return sent[0]
