"""A boot's READY=1 as the process sends it (gpunode/platform/sdnotify.py, cli/commands.py), to
a real AF_UNIX socket; tests/integration/test_boot_systemd.py has systemd's own view."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import HostFactory
from helpers.notify_socket import manager_socket, pending


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[socket.socket]:
    with manager_socket(tmp_path / "notify") as sock:
        yield sock


@pytest.mark.parametrize(("machine", "state", "status", "code"), [
    # the pipeline's, once its record is written, a failed boot's too (this fixture has no
    # nvidia-container-runtime: the containerd step fails); the unit then ends failed
    ("nc4as-t4-v3", "driver", "boot failed", 1),
    ("azure-d4s-v5", "bare", "boot no-gpu", 0),  # the CPU node's, once its record is written
])
def test_a_boot_says_ready_exactly_once(make_host: HostFactory, tmp_path: Path,
                                        manager: socket.socket, machine: str, state: str,
                                        status: str, code: int) -> None:
    node = make_host(machine, state)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    done = subprocess.run([sys.executable, "-m", "gpunode", "--root", str(node.root),
                           "--log-format", "json", "boot"], env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == code, done.stderr
    assert pending(manager) == [{"READY": "1", "STATUS": status}]
    assert (node.root / "run/gpunode/state.json").is_file()


def test_a_boot_that_fails_says_nothing_before_its_exit(make_host: HostFactory,
                                                         tmp_path: Path,
                                                         manager: socket.socket) -> None:
    """An agent config gpunode refuses (exit 2): no READY=1, the unit fails as it exits."""
    node = make_host("nc4as-t4-v3", "driver")
    config = tmp_path / "config.toml"
    config.write_text("[detect]\nsource = 7\n")
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    done = subprocess.run([sys.executable, "-m", "gpunode", "--root", str(node.root),
                           "--config", str(config), "boot"], env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2, done.stderr
    assert pending(manager) == []
