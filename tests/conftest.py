"""Shared test fixtures: fixture hosts, and a guard against touching the real machine.

Unit tests run against fixture host trees only. A test that needs a real component (a
subprocess, the machine's own /sys through udev) says so with @pytest.mark.integration;
any other test that starts a process or asks systemd over D-Bus fails at once instead of
quietly depending on the machine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode import fixtures
from gpunode.host import Host
from hostile.support import Cli, make_cli

HostFactory = Callable[..., Host]


@pytest.fixture(autouse=True)
def _no_real_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("integration"):
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"unit test started a process {args!r}; mark it integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)

    def no_bus(*args: object, **kwargs: object) -> None:
        raise AssertionError("unit test asked systemd over D-Bus; use a fake Systemd or mark "
                             "it integration (and start a systemd: tests/real/systemd_ns.py)")

    monkeypatch.setattr("gpunode.systemd.DbusSystemd._connect", no_bus)


@pytest.fixture
def make_host(tmp_path: Path) -> HostFactory:
    """make_host("nc4as-t4-v3", state="driver", extra={...}) → a Host on a fresh fixture tree."""
    counter = iter(range(1000))

    def make(machine: str | fixtures.Machine, state: str = "ready", **options: object) -> Host:
        spec = fixtures.MACHINES[machine] if isinstance(machine, str) else machine
        root = tmp_path / f"{spec.name}-{state}-{next(counter)}"
        fixtures.build(spec, root, fixtures.Options(state=state, **options))  # type: ignore[arg-type]
        return Host(root)

    return make


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """The command line in-process under the hostile suite's rules (tests/hostile/support.py)."""
    return make_cli(capsys)
