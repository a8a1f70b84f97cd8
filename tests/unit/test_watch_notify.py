"""systemd's notification protocol with the standard library (gpunode/watch/notify.py): the
datagrams a real AF_UNIX socket in tmp_path receives, as systemd would read them."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode import log
from gpunode.watch import notify
from helpers.notify_socket import manager_socket, parsed


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[socket.socket]:
    """The service manager's end: a datagram socket bound in tmp_path."""
    with manager_socket(tmp_path / "notify") as sock:
        yield sock


def received(sock: socket.socket) -> dict[str, str]:
    return parsed(sock.recv(4096))


def test_ready_watchdog_status_and_stopping_arrive_as_systemd_reads_them(
        tmp_path: Path, manager: socket.socket) -> None:
    notifier = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    assert notifier.ready("watching /dev/kmsg")
    assert received(manager) == {"READY": "1", "STATUS": "watching /dev/kmsg"}
    assert notifier.watchdog()
    assert received(manager) == {"WATCHDOG": "1"}
    assert notifier.status("API server: kube-api-failed,\nretrying")
    assert received(manager) == {"STATUS": "API server: kube-api-failed, retrying"}
    assert notifier.stopping("stopping")
    assert received(manager) == {"STOPPING": "1", "STATUS": "stopping"}
    notifier.close()


def test_without_notify_socket_every_message_is_a_no_op() -> None:
    notifier = notify.Notifier({})
    assert not notifier.enabled and not notifier.ready("x") and not notifier.watchdog()
    assert notifier.watchdog_interval is None


def test_an_abstract_name_is_written_with_a_leading_at() -> None:
    assert notify.Notifier({"NOTIFY_SOCKET": "@/org/freedesktop/systemd1/notify"}).address == \
        "\0/org/freedesktop/systemd1/notify"


def test_a_relative_notify_socket_is_ignored_with_one_warning(
        capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("json")
    assert notify.Notifier({"NOTIFY_SOCKET": "notify"}).address is None
    assert "watch.notify_socket_invalid" in capsys.readouterr().err


@pytest.mark.parametrize(("env", "interval"), [
    ({"WATCHDOG_USEC": "180000000"}, 90.0),
    ({"WATCHDOG_USEC": "180000000", "WATCHDOG_PID": "4242"}, 90.0),
    ({"WATCHDOG_USEC": "180000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "3min"}, None),
    ({"WATCHDOG_USEC": "١٢٣"}, None),  # Arabic-Indic digits are digits to str.isdigit
], ids=["half-of-usec", "our-pid", "other-pid", "zero", "not-a-number", "unicode-digits"])
def test_the_keep_alive_interval_is_half_of_watchdog_usec_when_meant_for_us(
        env: dict[str, str], interval: float | None) -> None:
    assert notify.Notifier(env, pid=4242).watchdog_interval == interval


def test_a_manager_that_went_away_is_said_once_and_the_daemon_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("json")
    notifier = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert not notifier.watchdog() and not notifier.watchdog()
    assert capsys.readouterr().err.count("watch.notify_failed") == 1


def test_the_manager_s_variables_are_forgotten_for_the_programs_the_watch_runs() -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1",
           "PATH": "/usr/bin"}
    notify.forget_environment(env)
    assert env == {"PATH": "/usr/bin"}


def test_a_manager_that_reads_nothing_never_blocks_the_daemon(
        tmp_path: Path, manager: socket.socket, capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("json")
    notifier = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    sent = [notifier.status("x" * 1000) for _ in range(2000)]  # far more than its queue holds
    assert sent[0] and not sent[-1]
    assert capsys.readouterr().err.count("watch.notify_failed") == 1
