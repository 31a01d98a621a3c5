"""Free TCP ports on 127.0.0.1 for servers started on this machine.

A port is free when the kernel hands it out; it can be taken again between this call and the
server's bind, which is why servers that can pick their own port (nats-server `-p -1`) do so.
"""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports. Held open together so the kernel cannot hand one out twice."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
