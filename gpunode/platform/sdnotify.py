"""systemd's notification protocol (sd_notify(3)): datagrams of newline-separated KEY=VALUE
lines to the AF_UNIX socket $NOTIFY_SOCKET names, a path or an abstract name written with a
leading '@' (systemd's src/libsystemd/sd-daemon/sd-daemon.c). Outside a Type=notify unit there
is no $NOTIFY_SOCKET and nothing is sent.

gpunode.service is Type=notify so that containerd starts as soon as gpunode's boot record is
written (`ready`, from cli/commands.py boot): the last log line and the process's exit come
after, beside containerd's start instead of before it (docs/design.md, "The units"). Callers log
what `ready` returns; the watch's Notifier (gpunode/watch/notify.py) keeps its socket and logs
its own failures.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

_ready: list[bool] = []  # [True] once this process said READY=1


def address(value: str) -> str | None:
    """The socket address: an absolute path, or '@name' for the abstract name "\\0name"; None
    for nothing or anything else (sd_notify refuses it too)."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


def message(**fields: str) -> bytes:
    """One datagram's text: a value is one line (the protocol separates assignments by
    newlines)."""
    return "\n".join(f"{k}={' '.join(v.splitlines())}" for k, v in fields.items()).encode()


def ready(status: str, environ: Mapping[str, str] | None = None) -> str | None:
    """READY=1 (with STATUS=`status`), once per process. None when it was sent, had been, or
    there is no socket to send it to; else why it could not be sent."""
    if _ready:
        return None
    value = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    target = address(value)
    if target is None:
        return f"NOTIFY_SOCKET={value!r} is neither an absolute path nor an @name" \
            if value else None
    _ready.append(True)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:  # never waits on the manager: a full queue (nobody reading) refuses it
            sock.sendto(message(READY="1", STATUS=status), socket.MSG_DONTWAIT, target)
        finally:
            sock.close()
    except OSError as exc:
        return f"{value}: {exc.strerror or exc}"
    return None
