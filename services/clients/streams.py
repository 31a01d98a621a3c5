"""`lorabus streams --config FILE`: create the run's streams, or update them to their current
definition (`services.common.streams`). Under NATS auth this is the operator's job: the
registry may create a run's streams but no service may change one (deploy/nats/nats.conf), so
after an upgrade that changes a definition the operator runs this with its own credential."""

from __future__ import annotations

import asyncio
import sys

from services.common import entry
from services.config.schema import LorabusConfig

PROG = "lorabus streams"


async def ensure(cfg: LorabusConfig) -> None:
    async with entry.connected(cfg, "streams"):
        pass  # `connected` ensures the streams


def main(argv: list[str] | None = None) -> int:
    from services.common.bus import BusError

    args = entry.parser(PROG, __doc__.splitlines()[0]).parse_args(sys.argv[1:] if argv is None else argv)
    cfg = entry.start(args, PROG, service="streams")
    try:
        asyncio.run(ensure(cfg))
    except BusError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    print(f"{PROG}: the streams of run {cfg.run} match their definitions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
