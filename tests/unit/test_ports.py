"""Ports for the launcher's servers: below the ephemeral range, where no outgoing connection
can take them later (the exporter of a GPU run restarted five times on a metrics port an
outgoing connection held); a metrics port that cannot be bound is named in the error."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.common.metrics import start_metrics_server
from services.config.schema import MetricsConfig
from services.local import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    got = ports.free_ports(8)
    assert len(set(got)) == 8
    assert all(10000 <= p < ports.ephemeral_low() for p in got)
    held = []
    try:
        for p in got:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", p))
    finally:
        for s in held:
            s.close()


def test_taken_ports_are_skipped_and_the_kernel_picks_when_too_few_are_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    range_file = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)

    def window(low: int) -> None:  # the one port `low` below the "ephemeral range"
        monkeypatch.setattr(ports, "_LOWEST", low)
        range_file.write_text(f"{low + 1}\t60999\n")

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    try:
        window(taken.getsockname()[1])
        got = ports.free_ports(2)  # the window's port is taken: both from the kernel
        assert len(set(got)) == 2 and taken.getsockname()[1] not in got
        free = got[0]
    finally:
        taken.close()
    window(free)
    assert ports.free_ports(1) == [free]


def test_ephemeral_low_falls_back_when_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_low() == 32768


def test_a_metrics_port_in_use_is_named() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        with pytest.raises(OSError, match=rf"metrics.port: 127.0.0.1:{port} cannot be bound .*give another port"):
            start_metrics_server(MetricsConfig(host="127.0.0.1", port=port))
    finally:
        s.close()
