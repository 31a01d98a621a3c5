"""The exporter service: every `adapter.v<N>.ready` becomes `<exporter.uri>/v<N>/`, announced
by `export.v<N>.done`; in a fleet, for every run of the run table, in any state (a stopped or
finished run's last versions are exported too): each run is an `Exporter` of the process's
`RunHost`, over its own view of the connection, reading its own ADAPTERS stream through its
own `exporter` durable and writing under its own `exporter.uri` (its config's, where
`${run_dir}` is the run's directory). An event is exported by the exporter of the run whose
stream holds it.

It reads the ADAPTERS stream through its own durable consumer (`exporter`), so it exports
every version even when it starts late or restarts. Exports are write-once: a redelivered
event finds its directory written with the same weights and only re-announces it if needed
(ExportDone is published only when the EXPORTS stream does not already hold the same one,
plus `Nats-Msg-Id` dedup); an event whose weights differ from an existing export (a version
re-announced with other content) is refused, never written over it. Only the run's trainer
lineage is exported (`services.common.lineage`: its epoch, bounded version steps).

A write the export directory refuses (full, read-only, not ours, an S3 endpoint that stays
silent after the store's own bounded retries) stops the exporter with that error, naming the
directory and the fix: the event is not acked, so it and every later one stay in the durable
and are exported once the disk is fixed and the exporter restarted, none dead-lettered.
Retrying in place would not help (space is freed and mounts fixed by people, and the
launcher's restart policy already retries with backoff).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import NoReturn

from proto import codec, subjects
from proto.messages import AdapterReady, ExportDone, ObjectPayload
from services.common import durable, lineage, streams, xccl
from services.common.bus import Bus, MsgMeta, Refused
from services.common.megatron_to_hf import ModelShape
from services.common.pull import Puller
from services.common.run_host import ALL_STATES, RunHost
from services.common.store import ObjectCorrupt, ObjectNotFound, OutsideStore, StoreError, store_for_uri
from services.config.schema import LorabusConfig
from services.exporter import metrics
from services.exporter.peft_dir import (
    FILES,
    PeftFiles,
    existing_sha256,
    load_model_shape,
    peft_files,
    version_uri,
    write_export,
)

log = logging.getLogger(__name__)

SERVICE = "exporter"
DURABLE = "exporter"


@contextlib.contextmanager
def _stage(run: str, name: str):
    try:
        yield
    except Exception:
        metrics.FAILURES.labels(run, name).inc()
        raise


class ExportStopped(Exception):
    """The export directory refused a write; the message says which, why and the fix."""


class Exporter:
    def __init__(self, cfg: LorabusConfig, bus: Bus, stopped: asyncio.Future[ExportStopped] | None = None):
        self.cfg = cfg
        self.bus = bus
        self.stopped: asyncio.Future[ExportStopped] = stopped or asyncio.get_running_loop().create_future()
        """set when a write is refused: the service ends with it (`run`)"""
        self._shape: ModelShape | None = None
        self._last_version = -1
        self.epoch: str | None = None
        """the run's trainer epoch (`start` reads it from the stream's first event)"""
        self.newest: int | None = None
        """the newest version exported (the bound for the next step)"""
        self.busy = asyncio.Lock()
        """held while an event is handled; shutdown takes it so no export is cut in half"""
        self.consumer: asyncio.Task | None = None
        """the dispatch of the run's adapter events (`start`)"""

    def model_shape(self) -> ModelShape:
        # The payload is one file with global expert indices: the EP-gathered view (ep_size 1).
        if self._shape is None:
            self._shape = load_model_shape(self.cfg.actor.path)
        return self._shape

    # --- the run's life in the host (`RunWorker`) -------------------------------------------

    async def start(self) -> None:
        """Where the lineage stands (the run's trainer epoch and the last version exported),
        then follow the run's adapter events."""
        self.epoch = await lineage.first_epoch(self.bus, streams.ADAPTERS(self.cfg.run))
        try:
            last = await self.bus.last(streams.EXPORTS(self.cfg.run), ExportDone)
        except Exception:  # an undecodable last export: bound the next step from what comes
            last = None
        self.newest = last.version if last is not None else None
        # batch 1: a fetched message not yet handled at shutdown waits ack_wait to return
        reader: Puller[AdapterReady] = await self.bus.pull(
            streams.consumer(self.cfg.run, DURABLE), AdapterReady, batch=1
        )
        self.consumer = self.bus.dispatch(reader, self.handle)
        log.info("exporting %s adapters to %s", self.cfg.run, self.cfg.exporter.uri)
        metrics.open_run(self.cfg.run)

    async def drain(self) -> None:
        """Let a running export finish (and ack), then take no more events."""
        async with self.busy:
            if self.consumer is not None:
                self.consumer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.consumer

    async def close(self) -> None:
        """Nothing is held past the consumer: exports are written as they are made."""

    # --- one event ------------------------------------------------------------------------

    async def handle(self, event: AdapterReady, meta: MsgMeta) -> None:
        async with self.busy:
            await self._handle(event, meta)

    async def _handle(self, event: AdapterReady, meta: MsgMeta) -> None:
        if event.run != self.cfg.run:
            raise Refused(f"run: event of run {event.run!r} on run {self.cfg.run!r}'s stream")
        problem = lineage.lineage_problem(self.epoch, self.newest, event.trainer_epoch, event.version)
        if problem is not None:
            raise Refused(f"{event.adapter_name}: {problem}")
        payload = event.object_payload()
        if payload is None:
            # An XCCL-only version has no durable copy to export; retrying would not create one.
            metrics.FAILURES.labels(self.cfg.run, "no-object-payload").inc()
            log.error("v%d: no object payload (xccl only); not exported", event.version)
            return
        started = time.perf_counter()
        try:
            files = await asyncio.to_thread(self._fetch_and_convert, payload, event)
        except OutsideStore as exc:
            raise Refused(f"{event.adapter_name}: {exc}") from None
        except (ObjectNotFound, ObjectCorrupt) as exc:
            # reading again gives the same answer: record it and go on with the next version
            letter_id = f"{meta.subject}:{meta.stream_seq}:{SERVICE}"
            error = f"v{event.version} not exported: {exc}"
            await self.bus.dead_letter(meta.subject, "handler", error, codec.encode(event), msg_id=letter_id)
            log.error("v%d: not exported: %s", event.version, exc)
            return
        with _stage(self.cfg.run, "write"):
            try:
                wrote = await asyncio.to_thread(self._write_once, event.version, files)
            except StoreError as exc:
                await self._stop(event.version, exc)
        self.epoch = event.trainer_epoch
        self.newest = max(self.newest if self.newest is not None else -1, event.version)
        done = ExportDone(
            run=event.run,
            lora_name=event.lora_name,
            version=event.version,
            uri=version_uri(self.cfg.exporter.uri, event.version),
            files=list(FILES),
            bytes=len(files.weights),
            sha256=files.sha256,
            exported_at=time.time(),
        )
        with _stage(self.cfg.run, "publish"):
            published = await self._publish_once(done)
        if wrote:
            metrics.EXPORTS.labels(self.cfg.run).inc()
            metrics.EXPORT_SECONDS.labels(self.cfg.run).observe(time.perf_counter() - started)
        if event.version > self._last_version:
            self._last_version = event.version
            metrics.LAST_VERSION.labels(self.cfg.run).set(event.version)
        log.info("v%d -> %s (%d bytes%s%s)", event.version, done.uri, done.bytes,
                 "" if wrote else ", already written", "" if published else ", already announced")  # fmt: skip

    async def _stop(self, version: int, exc: StoreError) -> NoReturn:
        """End the service with `exc`, leaving this event unacked: `run` cancels this handler
        where it waits."""
        stop = ExportStopped(
            f"exporter stopped at v{version}: {exc} (v{version} and later stay in the exporter's "
            "durable and are exported when it restarts)"
        )
        log.error("%s", stop)
        if not self.stopped.done():
            self.stopped.set_result(stop)
        await asyncio.Future()  # cancelled by run
        raise AssertionError("unreachable")

    def _fetch_and_convert(self, payload: ObjectPayload, event: AdapterReady) -> PeftFiles:
        with _stage(self.cfg.run, "fetch"):
            store = store_for_uri(payload.uri, self.cfg.store)
            # under xccl the event may precede its object by an upload time
            data = xccl.fetch_when_stored(
                lambda: durable.read(store, payload), what=payload.uri, within_s=xccl.upload_wait_s(event)
            )
        with _stage(self.cfg.run, "convert"):
            return peft_files(data, payload.layout, event.lora, self.model_shape)

    def _write_once(self, version: int, files: PeftFiles) -> bool:
        """Write version N's export unless it exists; False when it exists with these weights."""
        uri, store_cfg = self.cfg.exporter.uri, self.cfg.store
        existing = existing_sha256(uri, version, store_cfg)
        if existing == files.sha256:
            return False
        if existing is not None:
            raise Refused(
                f"export v{version}: already written with other weights (sha256 {existing[:12]}, this "
                f"event's {files.sha256[:12]}); exports are write-once, a version is published once"
            )
        write_export(uri, version, files, store_cfg)
        return True

    async def _publish_once(self, done: ExportDone) -> bool:
        subject = subjects.export_done(done.run, done.version)
        previous = await self.bus.last(streams.EXPORTS(done.run), ExportDone, subject)
        if previous is not None and (previous.uri, previous.sha256) == (done.uri, done.sha256):
            return False
        await self.bus.publish(subject, done, msg_id=f"export-v{done.version}")
        return True


async def run(cfg: LorabusConfig, stop: asyncio.Event) -> None:
    """Serve every run of the fleet until `stop` is set (or the own run's consumer dies, which
    is raised)."""
    bus = await Bus.connect(cfg.bus, run=cfg.run, service=SERVICE)
    try:
        await bus.ensure_streams()
        exporters: dict[str, Exporter] = {}
        stopped: asyncio.Future[ExportStopped] = asyncio.get_running_loop().create_future()

        async def make(run_cfg: LorabusConfig, run_bus: Bus) -> Exporter:
            exporter = exporters[run_cfg.run] = Exporter(run_cfg, run_bus, stopped)
            return exporter

        host = RunHost(cfg, bus, make, name="exporter", opens=ALL_STATES, ends=())
        await host.start()
        consumer = exporters[cfg.run].consumer
        assert consumer is not None  # started
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({consumer, stopper, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if stopped.done():
            for exporter in exporters.values():  # the refused event stays unacked
                if exporter.consumer is not None:
                    exporter.consumer.cancel()
            await host.close()
            await bus.close()
            raise stopped.result()
        if consumer.done() and not consumer.cancelled() and (exc := consumer.exception()) is not None:
            raise exc
        await host.close()
        await bus.close()
    finally:
        if not bus.is_closed:
            await bus.close()
