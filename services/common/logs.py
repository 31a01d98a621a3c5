"""One logging setup for every service: one line per record, tagged with the service name and
stamped to the millisecond, so the interleaved output of `lorabus up` stays readable and the
logs of different processes can be lined up (an adapter load takes milliseconds)."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s {service} %(name)s: %(message)s"


def setup_logging(service: str, level: str | int = "INFO", file: str | None = None) -> None:
    """Configure the root logger (replacing earlier handlers) to write to stderr and, if
    given, also to `file`."""
    if isinstance(level, str):
        resolved = logging.getLevelName(level.upper())
        if not isinstance(resolved, int):
            raise ValueError(f"log level {level!r}: use one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        level = resolved
    formatter = logging.Formatter(FORMAT.format(service=service), datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file:
        handlers.append(logging.FileHandler(file))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level)
