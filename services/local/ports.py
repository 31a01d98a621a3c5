"""Free TCP ports on 127.0.0.1 for servers started on this machine.

Ports are picked below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`): a port
from `bind(0)` lies inside it, where any outgoing connection made later (a service's NATS or S3
client) can be handed the same number and hold it for the whole run, so a server that binds it
afterwards, or again after a restart, fails with "address in use". Below the range only a
server that binds the number explicitly can take it. A port can still be taken between this
call and the server's bind, which is why servers that can pick their own port
(nats-server `-p -1`) do so.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # above the well-known and most registered service ports


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports below the ephemeral range, held open together while they are
    chosen; the kernel's own pick where too few are free there."""
    span = max(0, ephemeral_low() - _LOWEST)
    start = random.randrange(span) if span else 0  # runs started together should not collide
    candidates = (_LOWEST + (start + i) % span for i in range(span)) if span >= n else iter(())
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            if len(sockets) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        while len(sockets) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
