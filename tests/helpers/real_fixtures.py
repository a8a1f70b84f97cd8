"""Fixtures on the real components that several integration files ask for: NVIDIA's real 550
files read (tests/real/nvidia_driver.py), its modules compiled here (tests/real/nvidia_modules.py),
podman able to run a container, and the real promtool (tests/real/promtool.py).

They are registered for the whole suite by `pytest_plugins` in tests/conftest.py, as
helpers/sysext.py's are; a test file's own fixture of the same name wins over these. Each is
module-scoped where it was, so a file reads or builds once, as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpunode_testing import podman, real_driver
from real import promtool
from real.nvidia_driver import ensure_driver
from real.nvidia_modules import BuiltModules, ensure_modules


@pytest.fixture(scope="module")
def source() -> real_driver.DriverSource:
    """Debian's real 550 user-space, as gpunode_testing.real_driver reads it."""
    driver = ensure_driver("550")
    return real_driver.read_source(driver.root, driver.version)


@pytest.fixture(scope="module", params=["open", "proprietary"])
def compiled(request: pytest.FixtureRequest) -> BuiltModules:
    """The real 550 modules compiled here, once per flavour (a test that asks runs for each)."""
    return ensure_modules(request.param)


@pytest.fixture(scope="module")
def open_modules() -> BuiltModules:
    return ensure_modules("open")


@pytest.fixture(scope="module")
def proprietary_modules() -> BuiltModules:
    return ensure_modules("proprietary")


@pytest.fixture
def podman_ready(tmp_path: Path) -> None:
    """podman can run a container here: skipped without root, failed without the tools, skipped
    with podman's own reason when a trial container does not run."""
    if os.geteuid() != 0:
        pytest.skip("podman's namespace, mounts and the fixture's mknod need root")
    if missing := podman.missing_tools():
        pytest.fail("missing " + ", ".join(missing) + ": make setup installs them")
    if reason := podman.probe(tmp_path / "probe", podman.make_rootfs(tmp_path / "probe-rootfs")):
        pytest.skip(reason)


@pytest.fixture(scope="module")
def real_promtool() -> None:
    """The real promtool is in the test cache (use it with `usefixtures`)."""
    try:
        promtool.ensure_promtool()
    except Exception as err:  # a failure, never a skip: the Makefile fetches it first
        pytest.fail(f"could not get the real promtool:\n{err}", pytrace=False)
