"""Hostile inputs to `gpunode watch`, the daemon: what stands at <root>/dev/kmsg that is not a
record device, a FIFO or a file (a directory, a socket, links out of the root or in a loop,
nothing) stops it at the start with one error, exit 1, before it tells systemd it is ready;
--dry-run without --once is a usage error. (A FIFO is the tests' stand-in for /dev/kmsg and a
regular file a saved log: the daemon follows both, tests/unit/test_watch_daemon.py.)"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from conftest import HostFactory
from hostile.support import (
    Cli,
    check_refusal,
    make_absent,
    make_directory,
    make_link_out,
    make_loop,
)


@pytest.fixture
def root(make_host: HostFactory) -> Path:
    return make_host("nc4as-t4-v3", "ready").root


def _socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


REFUSED = {
    "directory": (make_directory, r"kmsg'?: is a directory, not a record device, a FIFO or a "
                              r"regular file"),
    "socket": (_socket, r"kmsg'?: is a socket"),
    "symlink-out-of-the-root": (make_link_out, r"kmsg'?: a symlink climbs above the root"),
    "symlink-loop": (make_loop, r"kmsg.*too many levels of symbolic links"),
    "absent": (make_absent, r"kmsg.*No such file or directory"),
}


@pytest.mark.parametrize("make,pattern", REFUSED.values(), ids=list(REFUSED))
def test_what_cannot_be_followed_as_dev_kmsg_stops_the_daemon_at_the_start(
        cli: Cli, root: Path, make: object, pattern: str) -> None:
    make(root / "dev/kmsg")  # type: ignore[operator]
    check_refusal(cli, root, ["--root", str(root), "watch"], 1, pattern)


def test_dry_run_without_once_is_a_usage_error(cli: Cli, root: Path) -> None:
    (root / "dev/kmsg").write_text("")
    check_refusal(cli, root, ["--root", str(root), "watch", "--dry-run"], 2, r"--once")
