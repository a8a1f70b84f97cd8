"""gpunode.service's READY=1 (gpunode/platform/sdnotify.py): the datagram a real AF_UNIX socket in
tmp_path receives, as systemd reads it; once per process; why it could not be sent."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.platform import sdnotify
from helpers.notify_socket import manager_socket, pending


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[socket.socket]:
    with manager_socket(tmp_path / "notify") as sock:
        yield sock


@pytest.fixture(autouse=True)
def not_sent_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdnotify, "_ready", [])


def test_ready_is_sent_once_with_its_status(tmp_path: Path, manager: socket.socket) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    assert sdnotify.ready("boot ok\nsecond line", env) is None
    assert sdnotify.ready("boot ok", env) is None  # once per process
    assert pending(manager) == [{"READY": "1", "STATUS": "boot ok second line"}]


def test_outside_a_notify_unit_nothing_is_sent() -> None:
    assert sdnotify.ready("boot ok", {}) is None


@pytest.mark.parametrize("value", ["notify", "@"])
def test_a_value_that_is_not_an_address_is_reported(value: str) -> None:
    problem = sdnotify.ready("boot ok", {"NOTIFY_SOCKET": value})
    assert problem is not None and "neither an absolute path nor an @name" in problem


def test_a_socket_nobody_listens_on_is_reported(tmp_path: Path) -> None:
    problem = sdnotify.ready("boot ok", {"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert problem is not None and str(tmp_path / "gone") in problem


def test_the_abstract_name_is_written_with_a_leading_at() -> None:
    assert sdnotify.address("@/org/freedesktop/systemd1/notify") == \
        "\0/org/freedesktop/systemd1/notify"
    assert sdnotify.address("/run/systemd/notify") == "/run/systemd/notify"
