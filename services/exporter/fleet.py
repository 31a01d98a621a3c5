"""The exporter of a fleet: every run of the fleet's run table is exported like the fleet's own.

A run the table names (in any state: a stopped or finished run's last versions are exported
too) gets its own `Exporter` over its view of the connection, reading its own ADAPTERS stream
through its own `exporter` durable, so its versions land under its own `exporter.uri` (the
run's config, where `${run_dir}` is the run's directory) and are announced on its own
subjects. Runs are followed for as long as the exporter runs; a finished run's durable idles.

Invariant: an event is exported by the exporter of the run whose stream holds it.
"""

from __future__ import annotations

import asyncio
import logging

from proto.messages import AdapterReady, RunRecord
from services.common import runconfig, streams
from services.common.bus import Bus
from services.common.config_schema import LorabusConfig
from services.common.pull import Puller
from services.exporter.service import DURABLE, Exporter

log = logging.getLogger(__name__)


class FleetExports:
    def __init__(self, cfg: LorabusConfig, bus: Bus):
        self.cfg, self.bus = cfg, bus
        self.runs: dict[str, tuple[Exporter, Bus, asyncio.Task]] = {}

    async def on_record(self, record: RunRecord) -> None:
        if record.run == self.cfg.run or record.run in self.runs:
            return
        try:
            cfg = runconfig.restore(record.config, self.cfg)
            view = self.bus.for_run(record.run)
            await view.ensure_streams()
            exporter = Exporter(cfg, view)
            reader: Puller[AdapterReady] = await view.pull(streams.consumer(record.run, DURABLE), AdapterReady, batch=1)
            self.runs[record.run] = (exporter, view, view.dispatch(reader, exporter.handle))
        except Exception:  # one run that cannot be exported must not stop the others
            log.exception("run %s: cannot follow its adapters", record.run)
            return
        log.info("exporting %s adapters to %s", record.run, cfg.exporter.uri)

    async def close(self) -> None:
        """Let every running export finish (and ack), then stop."""
        for exporter, view, _ in self.runs.values():
            async with exporter.busy:
                await view.close()
        self.runs.clear()
