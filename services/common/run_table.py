"""A fleet's run table (JetStream KV `lorabus_<fleet>_runs`, one `RunRecord` per run) and its
run requests, over a Bus: what nats.py's `KeyValue` is to its client.

The registry is the table's one writer (`put`); every other service reads it (`records`) or
follows it (`watch`), and a user's tool asks the registry to change it (`submit`, `stop`, `resume`,
`list`).

Invariant: a record that does not decode is never handed on: the one writer wrote it, so it is
a bug to log, not a message to retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.js.errors

from proto import codec, subjects
from proto.messages import RunList, RunRecord, RunReply, RunResume, RunStop, RunSubmit
from services.common import streams
from services.common.bus import Bus
from services.common.nats_client import decode

log = logging.getLogger(__name__)

OnRecord = Callable[[RunRecord], Awaitable[None]]


class RunTable:
    """The run table of `fleet`, read and written over `bus`."""

    def __init__(self, bus: Bus, fleet: str):
        self.bus, self.fleet = bus, fleet
        self.bucket = streams.runs_bucket(fleet)

    async def records(self) -> dict[str, RunRecord]:
        """Every run as the table holds it now."""
        kv = await self.bus.key_value(self.bucket)
        # The keys from the stream's own subject list, not `kv.keys()`: nats-py's key watcher
        # can end its initial replay early and return some of the keys (nats-io/nats.py#842,
        # #995), and a restarted fleet registry would then forget live runs. STREAM.INFO
        # answers from one snapshot of the stream.
        prefix = streams.kv_subject(self.bucket)
        stream = streams.kv_stream(self.bucket)
        info = await self.bus.jetstream(f"stream info {stream}", self.bus.js.stream_info, stream,
                                        subjects_filter=f"{prefix}>")  # fmt: skip
        keys = [subject.removeprefix(prefix) for subject in info.state.subjects or {}]
        out = {}
        for key in keys:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                entry = await self.bus.jetstream(f"read run {key} of {self.bucket}", kv.get, key)
                if entry.value:
                    out[key] = decode(entry.value, RunRecord)
        return out

    async def put(self, record: RunRecord) -> int:
        """Write one run's record (the registry's job); returns the bucket revision."""
        bucket = streams.runs_bucket(record.fleet)
        kv = await self.bus.key_value(bucket)
        # a repeated put stores the same record again: the key's value is the same either way
        key = subjects.token(record.run, "run")
        return await self.bus.jetstream(f"write run {key} to {bucket}", kv.put, key, codec.encode(record))

    async def watch(self, handler: OnRecord) -> asyncio.Task:
        """`handler(record)` for every run now, then for every change, in order, in a background
        task of the bus (cancel it to stop; closing the bus does). A record that does not decode
        is logged and skipped."""
        kv = await self.bus.key_value(self.bucket)
        watcher = await kv.watchall()

        async def run() -> None:
            try:
                async for entry in watcher:
                    if entry is None or not entry.value:  # end of the initial values; a delete
                        continue
                    try:
                        record = decode(entry.value, RunRecord)
                    except codec.DecodeError as exc:
                        log.error("bus: run record %s of fleet %s does not decode: %s", entry.key, self.fleet, exc)
                        continue
                    await handler(record)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()

        return self.bus.adopt(asyncio.create_task(run(), name=f"runs:{self.fleet}"))

    # --- run requests, answered by the fleet's registry ---------------------------------------

    async def submit(self, run: str, config: dict[str, Any], *, timeout: float = 10.0) -> RunReply:
        """Ask the registry to add a run (`lorabus run submit`)."""
        request = RunSubmit(fleet=self.fleet, run=run, config=config)
        return await self.bus.request(subjects.run_control(self.fleet, "submit"), request, RunReply, timeout=timeout)

    async def stop(self, run: str, reason: str = "", *, timeout: float = 10.0) -> RunReply:
        """Ask the registry to stop a run (`lorabus run stop`)."""
        request = RunStop(fleet=self.fleet, run=run, reason=reason)
        return await self.bus.request(subjects.run_control(self.fleet, "stop"), request, RunReply, timeout=timeout)

    async def resume(self, run: str, *, timeout: float = 10.0) -> RunReply:
        """Ask the registry to serve a stopped run again (`lorabus run resume`)."""
        request = RunResume(fleet=self.fleet, run=run)
        return await self.bus.request(subjects.run_control(self.fleet, "resume"), request, RunReply, timeout=timeout)

    async def list(self, *, timeout: float = 5.0) -> RunReply:
        """The fleet's runs (`lorabus run list`)."""
        request = RunList(fleet=self.fleet)
        return await self.bus.request(subjects.run_control(self.fleet, "list"), request, RunReply, timeout=timeout)
