"""Write every adapter version of the run as a PEFT directory under `exporter.uri`.

`python -m services.exporter --config FILE [key=value ...]`, or `lorabus exporter ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

log = logging.getLogger("services.exporter")


def main(argv: list[str] | None = None) -> int:
    from services.common.config import ConfigError, load_config
    from services.common.logs import setup_logging
    from services.common.metrics import start_metrics_server
    from services.exporter.service import run

    p = argparse.ArgumentParser(prog="lorabus exporter", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the run's YAML config")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    setup_logging("exporter", args.log_level)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"lorabus exporter: {exc}", file=sys.stderr)
        return 2
    port = start_metrics_server(cfg.metrics)
    log.info("metrics on port %d", port)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run(cfg, stop)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
