"""The service manager's end of systemd's notification protocol for tests: a datagram socket
bound in a test's directory, and what it received, as systemd reads it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def manager_socket(path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    try:
        yield sock
    finally:
        sock.close()


def parsed(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n"))


def pending(sock: socket.socket) -> list[dict[str, str]]:
    """Every datagram waiting now, oldest first (none: [])."""
    sock.setblocking(False)
    found = []
    try:
        while True:
            found.append(parsed(sock.recv(4096)))
    except BlockingIOError:
        return found
    finally:
        sock.settimeout(2)
