"""`python -m services.registry --config FILE [key=value ...]` (also `lorabus registry`), and
`lorabus registry status --config FILE` for the operator's view of the ledger."""

from __future__ import annotations

import asyncio
import logging
import sys

from services.common import entry
from services.config.schema import LorabusConfig

log = logging.getLogger("services.registry")
PROG = "lorabus registry"


async def serve(cfg: LorabusConfig, raw: dict) -> int:
    """`raw`: the config file's tree as written, the base of every run submitted to the fleet."""
    from services.common.metrics import start_metrics_server
    from services.registry.fleet import FleetRegistry
    from services.registry.service import LedgerConflict

    port = start_metrics_server(cfg.metrics)
    async with entry.connected(cfg, "registry") as bus:
        # a fleet with the config's run as its first run: that run's registry is the one a
        # single-run deployment has always had, other runs join it at runtime
        service = FleetRegistry(bus, cfg, raw)
        await service.start()
        stop = entry.stop_event()
        log.info("registry: serving run %s (metrics on :%d)", cfg.run, port)
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({stopping, service.failed}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        await service.stop()
        if service.failed.done():
            exc = service.failed.exception()
            log.error("registry: %s", exc)
            return 3 if isinstance(exc, LedgerConflict) else 1
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":
        from services.registry import status

        return status.main(argv[1:])

    from services.common.bus import BusError

    parser = entry.parser(
        PROG,
        "version ledger and off-policyness policy; `lorabus registry status --config FILE` prints "
        "the running registry's ledger",
    )
    args = parser.parse_args(argv)
    cfg = entry.start(args, PROG, service="registry")
    from services.config.runconfig import fleet_tree

    try:
        return entry.run(serve(cfg, fleet_tree(args.config, args.overrides)))
    except (BusError, ValueError) as exc:
        log.error("registry: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
