"""Shared test fixtures: fixture hosts, the in-process command line, the test API server.

Unit tests run against fixture host trees only. The boundary guard (gpunode_testing.boundary,
loaded for every session by pyproject's addopts) fails a test that starts a process, asks
D-Bus, opens a connection or touches a path outside its tmp_path unless its markers allow it:
@pytest.mark.integration (processes, sockets, the test cache) and
@pytest.mark.allow_paths(...) (named parts of the real machine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.host import Host
from gpunode_testing import fixtures
from hostile.support import Cli, make_cli

HostFactory = Callable[..., Host]


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
