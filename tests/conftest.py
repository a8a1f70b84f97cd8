"""Shared test fixtures: fixture hosts, and a guard against touching the real machine.

Unit tests run against fixture host trees only. A test that needs a real component (a
subprocess, the machine's own /sys through udev) says so with @pytest.mark.integration;
any other test that starts a process or asks systemd over D-Bus fails at once instead of
quietly depending on the machine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.host import Host
from gpunode_testing import fixtures
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
                             "it integration (and start a systemd: gpunode_testing.systemd_ns)")

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


# The local TLS API server (gpunode_testing.kube_api) and the PKI it trusts, for a fixture node
# whose hostname names its Node.
KUBE_NODE = "nc4as-t4-v3-vmss000000"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from gpunode_testing.kube_api import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"), node_name=KUBE_NODE)


@pytest.fixture
def api(pki: Any) -> Iterator[Any]:
    from gpunode_testing.kube_api import FakeApiServer, make_node

    with FakeApiServer(pki, nodes=[make_node(KUBE_NODE, gpus=1)]) as server:
        yield server
