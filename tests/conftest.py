"""Shared test fixtures: fixture hosts, the in-process command line, the test API server, and
the rule that the folder says what kind a test is.

- tests/unit/: fixture host trees and in-process code only. No test here may be marked
  integration; collection fails if one is.
- tests/integration/: real components (processes, containerd, systemd in a namespace, kmod
  tools, ignition-validate, shellcheck, the TLS API server, the live machine). Every test
  collected here is marked integration by the hook below; the files do not say it themselves.
- tests/hostile/: one case per bad input, mostly in-process; a case that needs a real process
  or socket carries @pytest.mark.integration itself (mixed markers are allowed there).
- tests/real/ (real-component helpers), tests/helpers/ (helpers shared by unit and
  integration tests), tests/data/ (fixture files): no tests.

The boundary guard (gpunode_testing.boundary, loaded for every session by pyproject's addopts)
fails a test that starts a process, asks D-Bus, opens a connection or touches a path outside
its tmp_path unless its markers allow it: integration (processes, sockets, the test cache) and
@pytest.mark.allow_paths(...) (named parts of the real machine).

pyproject's `pythonpath = ["tests"]` makes `from conftest import ...`, `from hostile.support
import ...`, `from helpers... import ...` and `from real... import ...` work from every folder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.platform.host import Host
from gpunode_testing import fixtures
from hostile.support import Cli, make_cli

HostFactory = Callable[..., Host]

# The real sysext, built once per session for every file that asks for it (`built`), and the
# fixtures on the real driver, podman and promtool that several integration files use.
pytest_plugins = ["helpers.sysext", "helpers.real_fixtures"]

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent  # the checkout: pyproject.toml, gpunode/, docs/, units/, deploy/
TEST_DATA = TESTS / "data"
UNIT, INTEGRATION = TESTS / "unit", TESTS / "integration"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/integration integration; refuse one marked so in tests/unit."""
    misplaced = []
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)
        elif path.is_relative_to(UNIT) and item.get_closest_marker("integration") is not None:
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(
            "tests/unit holds only unit tests, but these are marked integration: "
            + ", ".join(misplaced) + "; move them to tests/integration (which marks every "
            "test it holds) or drop the marker")


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


def with_runtime_binary(host: Host) -> Host:
    """The host with the NVIDIA container runtime installed (an executable stand-in)."""
    path = host.root / "usr/bin/nvidia-container-runtime"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return host


@pytest.fixture
def flatcar(make_host: HostFactory) -> Host:
    """A Flatcar node whose driver is up and whose containerd config is the read-only default."""
    return with_runtime_binary(make_host("nc4as-t4-v3", "driver"))


def in_place_host(make_host: HostFactory, text: str) -> tuple[Host, Path]:
    """A ready node whose /etc/containerd/config.toml is `text` (edited in place)."""
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    target.write_text(text)
    return host, target


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """The command line in-process under the hostile suite's rules (tests/hostile/support.py)."""
    return make_cli(capsys)


# The local TLS API server (gpunode_testing.kube_api) and the PKI it trusts, for a fixture node
# whose hostname names its Node.
KUBE_NODE = "nc4as-t4-v3-vmss000000"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from gpunode_testing.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"), node_name=KUBE_NODE)


@pytest.fixture
def api(pki: Any) -> Iterator[Any]:
    from gpunode_testing.kube_api import FakeApiServer
    from gpunode_testing.kube_objects import make_node

    with FakeApiServer(pki, nodes=[make_node(KUBE_NODE, gpus=1)]) as server:
        yield server
