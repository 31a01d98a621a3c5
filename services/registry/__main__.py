"""`python -m services.registry --config FILE [key=value ...]` (also `lorabus registry`), and
`lorabus registry status --config FILE` for the operator's view of the ledger."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

log = logging.getLogger("services.registry")


async def serve(cfg) -> int:
    from services.common.bus import Bus
    from services.common.metrics import start_metrics_server
    from services.registry.policy import PolicyConfig
    from services.registry.service import LedgerConflict, RegistryService

    policy_cfg = PolicyConfig.from_config(cfg)
    port = start_metrics_server(cfg.metrics)
    bus = await Bus.connect(cfg.bus, run=cfg.run, service="registry")
    try:
        await bus.ensure_streams()
        service = RegistryService(bus, policy_cfg)
        await service.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
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
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":
        from services.registry import status

        return status.main(argv[1:])

    from services.common.bus import BusError
    from services.common.config import ConfigError, load_config
    from services.common.logs import setup_logging

    parser = argparse.ArgumentParser(
        prog="lorabus registry",
        description="version ledger and off-policyness policy; `lorabus registry status "
        "--config FILE` prints the running registry's ledger",
    )
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, overrides=args.overrides)
    except ConfigError as exc:
        print(f"lorabus registry: {exc}", file=sys.stderr)
        return 2
    setup_logging("registry", args.log_level)
    try:
        return asyncio.run(serve(cfg))
    except (BusError, ValueError) as exc:
        log.error("registry: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
