"""Announcing an adapter version: upload the safetensors once, then publish `AdapterReady`.

The event's msg_id is `adapter-v<N>`, and before publishing the trainer asks the ADAPTERS
stream whether `adapter.v<N>.ready` is already there: a retry or a restarted trainer can
therefore never announce one version twice, even after JetStream's dedup window.
"""

from __future__ import annotations

import asyncio
import time

import nats.js.errors

from proto import subjects
from proto.messages import AdapterReady, LoraSpec, ObjectPayload, Payload, XcclPayload
from services.common import adapter_io, streams
from services.common.store import ObjectRef


def adapter_key(run: str, version: int) -> str:
    return f"{run}/adapters/v{version}/{adapter_io.WEIGHTS_NAME}"


def adapter_msg_id(version: int) -> str:
    return f"adapter-v{version}"


def parse_adapter_version(run: str, key: str) -> int | None:
    """`<run>/adapters/v<N>/adapter_model.safetensors` -> N; None for any other key."""
    prefix, suffix = f"{run}/adapters/v", f"/{adapter_io.WEIGHTS_NAME}"
    if not (key.startswith(prefix) and key.endswith(suffix)):
        return None
    number = key[len(prefix) : -len(suffix)]
    return int(number) if number.isdigit() else None


def build_payloads(ref: ObjectRef, xccl: XcclPayload | None = None) -> list[Payload]:
    """Every way a receiver can get this version's weights: the object copy always (the
    durable one: late joiners, restarts, other hosts), the xccl handle beside it when the
    trainer broadcasts."""
    payloads: list[Payload] = [ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)]
    if xccl is not None:
        payloads.append(xccl)
    return payloads


def adapter_event(
    *, run: str, lora_name: str, version: int, ref: ObjectRef, lora: LoraSpec, trainer_step: int,
    xccl: XcclPayload | None = None,
) -> AdapterReady:
    return AdapterReady(
        run=run,
        lora_name=lora_name,
        version=version,
        parent_version=version - 1 if version > 0 else None,
        trainer_step=trainer_step,
        created_at=time.time(),
        lora=lora,
        payloads=build_payloads(ref, xccl),
    )


async def already_published(bus, run: str, version: int) -> bool:
    try:
        await bus.js.get_last_msg(streams.ADAPTERS(run), subjects.adapter_ready(run, version))
    except nats.js.errors.NotFoundError:
        return False
    return True


async def publish_adapter(
    bus, store, *, run: str, lora_name: str, version: int, weights: bytes, lora: LoraSpec,
    trainer_step: int, sender=None, tensors=None,
) -> AdapterReady | None:
    """Upload `weights` as version `version` and announce it; returns the event, or None when
    this version had been announced already (nothing is uploaded or published then).

    With an `XcclSender`, `tensors` are broadcast to its group while the upload runs; the
    event goes out once both are done, so it never names an object that is not stored yet
    and its `ranks` are the replicas that already hold the whole version."""
    if await already_published(bus, run, version):
        return None
    upload = asyncio.to_thread(store.put_bytes, adapter_key(run, version), weights)
    if sender is not None:
        ref, xccl = await asyncio.gather(upload, asyncio.to_thread(sender.send, version, tensors))
    else:
        ref, xccl = await upload, None
    if ref.sha256 != adapter_io.sha256(weights):
        raise RuntimeError(f"store returned sha256 {ref.sha256} for v{version}, expected "
                           f"{adapter_io.sha256(weights)}; the object store corrupted the upload")
    event = adapter_event(run=run, lora_name=lora_name, version=version, ref=ref, lora=lora,
                          trainer_step=trainer_step, xccl=xccl)
    await bus.publish(subjects.adapter_ready(run, version), event, msg_id=adapter_msg_id(version))
    return event
