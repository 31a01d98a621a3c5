"""Prometheus endpoint shared by every service.

Each service declares its metrics in its own `metrics.py` on prometheus-client's default
registry; this module only serves that registry and spells names consistently.
"""

from __future__ import annotations

import re

from prometheus_client import start_http_server

from services.config.schema import MetricsConfig

_PART = re.compile(r"^[a-z][a-z0-9_]*$")


def metric_name(service: str, thing: str, unit: str | None = None) -> str:
    """`lorabus_<service>_<thing>_<unit>`, e.g. ("rollout", "adapter_load", "seconds")."""
    parts = [service, thing] + ([unit] if unit else [])
    for part in parts:
        if not _PART.match(part):
            raise ValueError(
                f"metric name part {part!r}: use lower-case letters, digits and '_', starting with a letter"
            )
    return "_".join(["lorabus", *parts])


def start_metrics_server(cfg: MetricsConfig) -> int:
    """Serve `/metrics` on `cfg.host:cfg.port` in a daemon thread; returns the bound port
    (the kernel's pick when `cfg.port` is 0)."""
    if not 0 <= cfg.port <= 65535:
        raise ValueError(f"metrics.port: {cfg.port} is not a TCP port; use 0..65535 (0 = any free)")
    try:
        server, _thread = start_http_server(cfg.port, addr=cfg.host)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"metrics.port: {cfg.host}:{cfg.port} cannot be bound ({exc.strerror}); "
            "give another port, or 0 for any free one",
        ) from exc
    return server.server_address[1]
