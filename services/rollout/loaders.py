"""The ways a rollout replica loads an adapter version, as an ordered list tried in turn.

A loader either loads the version into the engine and says how (`Loaded`), or returns None
(not its way this time: the next one is tried), or raises (this attempt failed: the follower,
`adapters.AdapterFollower`, counts it, reports it, and retries from the first loader). The
follower owns retries, reports and metrics; a loader owns only getting bytes or tensors into
the engine. Order (`loaders`):
1. XCCL: the tensors the receiver staged from the trainer's broadcast (first attempt only; a
   staged set that does not load gives way to the object copy);
2. the fast path (embedded engine, `load_path.Stager`): servable before its sha256 check ends;
3. the verified fetch: the object's bytes, checked against the announced sha256, then loaded.
The last one always loads or raises.

Invariant: `Loaded.sha256` is hashed from the very bytes the loader handed the engine (or, on
the fast path, by the background check of the very bytes copied into the slot), never copied
from the event: it is what a trajectory's token ranges name as the policy that served them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from proto.messages import AdapterReady, LoadedVia
from services.common import xccl
from services.rollout.engines.base import Engine

if TYPE_CHECKING:
    from services.rollout.load_path import Staged, Stager
    from services.rollout.xccl_receiver import XcclReceiver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """A version now in the engine."""

    via: LoadedVia
    sha256: str | None
    """of the bytes handed to the engine; None: XCCL tensors (no bytes), or the fast path, whose
    digest `staged.verified` gives once its check ends"""
    staged: Staged | None = None


class Loader(Protocol):
    async def __call__(self, ev: AdapterReady, *, attempt: int, verify_first: bool) -> Loaded | None: ...


def _object_of(ev: AdapterReady) -> None:
    if ev.object_payload() is None:
        raise ValueError(f"{ev.adapter_name}: no object payload and this replica did not receive it by xccl")


@dataclass
class FromXccl:
    """The version the XCCL receiver staged; None when it staged none or it does not load."""

    engine: Engine
    receiver: Callable[[], XcclReceiver | None]
    """the follower's receiver, made when it starts"""
    replica: str

    async def __call__(self, ev: AdapterReady, *, attempt: int, verify_first: bool) -> Loaded | None:
        payload, receiver = ev.xccl_payload(), self.receiver()
        if attempt != 1 or payload is None or receiver is None:
            return None
        tensors = await asyncio.to_thread(receiver.take, ev.version, payload)
        if tensors is None:
            return None
        try:
            await self.engine.load_version(ev.version, tensors, ev.lora)
        except Exception as exc:
            log.warning("rollout %s: staged %s does not load (%r); object copy instead", self.replica,
                        ev.adapter_name, exc)  # fmt: skip
            return None
        finally:
            receiver.release(ev.version)
        return Loaded("xccl", None)


@dataclass
class FastPath:
    """The embedded engine's fast path; a version withdrawn after a failed check is loaded
    again verify-first, so this loader steps aside for it."""

    stager: Stager

    async def __call__(self, ev: AdapterReady, *, attempt: int, verify_first: bool) -> Loaded | None:
        if verify_first:
            return None
        _object_of(ev)
        # under xccl the event may precede its object by an upload time
        staged = await asyncio.to_thread(
            xccl.fetch_when_stored, lambda: self.stager.load(ev), what=ev.adapter_name,
            within_s=xccl.upload_wait_s(ev),
        )  # fmt: skip
        return Loaded("object", None, staged)


@dataclass
class VerifiedFetch:
    """The object's bytes, verified by `fetch` against the announced sha256, then loaded."""

    engine: Engine
    fetch: Callable[[AdapterReady], bytes]

    async def __call__(self, ev: AdapterReady, *, attempt: int, verify_first: bool) -> Loaded | None:
        _object_of(ev)
        data = await asyncio.to_thread(
            xccl.fetch_when_stored, lambda: self.fetch(ev), what=ev.adapter_name, within_s=xccl.upload_wait_s(ev)
        )
        return await self.load_bytes(ev, data)

    async def load_bytes(self, ev: AdapterReady, data: bytes) -> Loaded:
        # hashed beside the engine's load (hashlib releases the GIL), off the path to servable
        digest = asyncio.create_task(asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest()))
        try:
            await self.engine.load_version(ev.version, data, ev.lora)
        except BaseException:
            await asyncio.gather(digest, return_exceptions=True)
            raise
        return Loaded("object", await digest)


def loaders(
    engine: Engine,
    fetch: Callable[[AdapterReady], bytes],
    *,
    replica: str,
    receiver: Callable[[], XcclReceiver | None],
    stager: Stager | None,
) -> tuple[Sequence[Loader], VerifiedFetch]:
    """The replica's loaders in the order they are tried, and the verified fetch (the last of
    them, which a restore uses alone)."""
    last = VerifiedFetch(engine, fetch)
    order: list[Loader] = [FromXccl(engine, receiver, replica)]
    if stager is not None:
        order.append(FastPath(stager))
    order.append(last)
    return order, last


async def load(order: Sequence[Loader], ev: AdapterReady, *, attempt: int, verify_first: bool) -> Loaded:
    """The first loader that takes `ev`; the last one always does, or raises."""
    for loader in order:
        if (done := await loader(ev, attempt=attempt, verify_first=verify_first)) is not None:
            return done
    raise RuntimeError(f"{ev.adapter_name}: no loader took it; the verified fetch must come last in the order")
