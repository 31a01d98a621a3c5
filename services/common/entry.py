"""The start every entry point shares: arguments, config, logging, a stop signal, the bus.

    args = entry.parser("lorabus exporter", __doc__).parse_args(argv)
    cfg = entry.start(args, "lorabus exporter", service="exporter")
    ...
    stop = entry.stop_event()                       # inside the event loop
    async with entry.connected(cfg, "exporter") as bus:
        ...

Invariant: a config that does not load ends the entry point with exit status 2 and the
problems on stderr (no traceback, whichever way it was started: `lorabus <cmd>` or
`python -m`), and SIGINT and SIGTERM ask for the same orderly stop.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from services.common.bus import Bus
from services.common.logs import setup_logging
from services.config.loader import ConfigError, load_config
from services.config.schema import LorabusConfig

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """`--config FILE`, `--log-level` and trailing `key=value` overrides; add the rest."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", required=True, help="the run's YAML config")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


def load_or_exit(args: argparse.Namespace, prog: str) -> LorabusConfig:
    """The config named by `args`; on `ConfigError`, its problems on stderr and exit status 2."""
    try:
        return load_config(args.config, overrides=args.overrides)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def start(args: argparse.Namespace, prog: str, service: str) -> LorabusConfig:
    """Logging as `service` at `--log-level`, then `load_or_exit`."""
    setup_logging(service, args.log_level)
    return load_or_exit(args, prog)


def stop_event(stop: asyncio.Event | None = None) -> asyncio.Event:
    """`stop` (or a new event), set by SIGINT or SIGTERM; call it inside the running loop."""
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    return stop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, on uvloop where it is installed: a service that handles several
    small messages per decision spends much of its CPU in the event loop, which uvloop
    (libuv, Cython) runs in a fraction of asyncio's time."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


@asynccontextmanager
async def connected(cfg: LorabusConfig, service: str, *, ensure_streams: bool = True) -> AsyncIterator[Bus]:
    """The run's bus as `service`, with its streams ensured (unless a read-only user asks not
    to), closed however the block ends."""
    bus = await Bus.connect(cfg.bus, run=cfg.run, service=service)
    try:
        if ensure_streams:
            await bus.ensure_streams()
        yield bus
    finally:
        await bus.close()
