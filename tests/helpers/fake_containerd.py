"""A containerd the unit tests can ask about without one running: a recording systemd whose
containerd is in a given state, and containerd's socket answering under a fixture root."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpunode.errors import SystemdError
from gpunode.platform.host import Host


@dataclass
class RecordingSystemd:
    """Records what is asked of systemd; containerd is in `state`; a restart fails while the
    config (read through `host`) contains one of `broken`, as a containerd refusing it would."""

    state: str = "active"
    available: bool = True
    broken: set[str] = field(default_factory=set)
    host: Host | None = None
    calls: list[str] = field(default_factory=list)

    def active_state(self, unit: str) -> str:
        return self.state

    def exec_start(self, unit: str) -> None:
        return None

    def daemon_reload(self) -> None:
        self.calls.append("daemon-reload")

    def restart(self, unit: str, timeout: float) -> None:
        self.calls.append(f"restart {unit}")
        if self.broken:
            assert self.host is not None
            text = self.host.read_optional("/etc/containerd/config.toml") or ""
            if any(marker in text for marker in self.broken):
                raise SystemdError(unit, "restart", "it is failed after the restart")


def listen(host: Host) -> socket.socket:
    """containerd's default socket under `host`'s root, answering as a running containerd's
    would; the caller closes it (or use `listening`)."""
    directory = host.root / "run/containerd"
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_PATH)  # a short name for a long tmp path (sun_path limit)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(f"/proc/self/fd/{fd}/containerd.sock")
        server.listen()
    except OSError:
        server.close()
        raise
    finally:
        os.close(fd)
    return server


@contextlib.contextmanager
def listening(host: Host) -> Iterator[socket.socket]:
    server = listen(host)
    try:
        yield server
    finally:
        server.close()
