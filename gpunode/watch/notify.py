"""systemd's notification protocol with the standard library: READY=1, WATCHDOG=1, STATUS=….

A Type=notify service tells its manager it is ready, alive and what it is doing by sending
datagrams of newline-separated KEY=VALUE assignments to the AF_UNIX socket that
$NOTIFY_SOCKET names: a path, or an abstract name written with a leading '@' (sd_notify(3),
"Notes"; systemd's src/libsystemd/sd-daemon/sd-daemon.c). With WatchdogSec= the manager sets
$WATCHDOG_USEC (and $WATCHDOG_PID, the process meant) and kills the service when WATCHDOG=1 does
not come within that time; "it is recommended that a daemon sends a keep-alive notification
message to the service manager every half of the time returned here" (sd_watchdog_enabled(3)).

One socket, made when the first message is sent; the address and the datagram's text as
platform/sdnotify.py (boot's READY=1) makes them. Outside systemd (no $NOTIFY_SOCKET) every
message is a no-op. A send that fails is logged once and the daemon goes on: the manager, not
gpunode, decides what a missing watchdog ping means.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping

from gpunode import log
from gpunode.platform import sdnotify


class Notifier:
    """The manager's notification socket, as the environment names it."""

    def __init__(self, environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_usec = _watchdog_usec(env, os.getpid() if pid is None else pid)
        self._socket: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between keep-alive messages (half of WATCHDOG_USEC), None without one."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def ready(self, status: str) -> bool:
        return self.send(READY="1", STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG="1")

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING="1", STATUS=status)

    def send(self, **fields: str) -> bool:
        """One datagram of `fields`; False when there is no socket or it cannot be sent."""
        if self.address is None:
            return False
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX,
                                             socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never wait on the manager: a full queue (nobody reading) drops the message.
            self._socket.sendto(sdnotify.message(**fields), socket.MSG_DONTWAIT,
                                self.address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.get().warning("watch.notify_failed", socket=_shown(self.address),
                                  error=str(exc), note="systemd does not hear from the "
                                  "watch; with WatchdogSec= it will restart it")
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def forget_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Remove the manager's variables, so no program the watch runs takes them for its own
    (sd_notify's unset_environment)."""
    env = os.environ if environ is None else environ
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(name, None)


def _address(value: str) -> str | None:
    """sdnotify.address, with a warning for a value that is not an address."""
    found = sdnotify.address(value)
    if found is None and value:
        log.get().warning("watch.notify_socket_invalid", value=value,
                          note="NOTIFY_SOCKET is neither an absolute path nor an @name: "
                          "nothing is sent")
    return found


def _shown(address: str) -> str:
    return "@" + address[1:] if address.startswith("\0") else address


def _watchdog_usec(env: Mapping[str, str], pid: int) -> int | None:
    """WATCHDOG_USEC when it is meant for this process (WATCHDOG_PID unset or ours)."""
    usec, meant = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not (usec.isascii() and usec.isdigit()) or int(usec) == 0:
        return None
    if meant and not (meant.isascii() and meant.isdigit() and int(meant) == pid):
        return None
    return int(usec)
