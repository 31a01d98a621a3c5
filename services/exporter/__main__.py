"""Write every adapter version of the run as a PEFT directory under `exporter.uri`.

`python -m services.exporter --config FILE [key=value ...]`, or `lorabus exporter ...`.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from services.common import entry

log = logging.getLogger("services.exporter")
PROG = "lorabus exporter"


def main(argv: list[str] | None = None) -> int:
    from services.common.metrics import start_metrics_server
    from services.exporter.service import ExportStopped, run

    args = entry.parser(PROG, __doc__.splitlines()[0]).parse_args(argv)
    cfg = entry.start(args, PROG, service="exporter")
    port = start_metrics_server(cfg.metrics)
    log.info("metrics on port %d", port)

    async def serve() -> None:
        await run(cfg, entry.stop_event())

    try:
        asyncio.run(serve())
    except ExportStopped as exc:  # logged where it happened; the one line a launcher shows
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
