"""gpunode as `pip install` gives it: the wheel built from this checkout, installed (not editable)
into a fresh virtualenv, renders every `gpunode ignition` format from any working directory,
byte for byte as the checkout does, because the units travel in the wheel as package data.

No network: the wheel is built with the virtualenv's own setuptools (--no-build-isolation),
installed with --no-index --no-deps, and the fresh virtualenv sees only gpunode's declared
dependencies (and theirs), linked from this virtualenv: an undeclared import fails here.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from conftest import REPO
from gpunode.delivery import ignition
from helpers.ignition_example import SHA512, URL

EXAMPLE_CONFIG = REPO / "ignition" / "example-config.toml"
# What the source distribution of gpunode holds that the wheel is built from.
SOURCES = ("pyproject.toml", "README.md", "gpunode")
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # no PYTHONPATH, no virtualenv


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    workdir: Path  # an empty directory, far from any checkout


def dependency_closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `requirements` need, transitively (markers evaluated for no
    extra)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        requirement = Requirement(todo.pop())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        key = requirement.name.lower().replace("_", "-")
        if key in found:
            continue
        found[key] = importlib.metadata.distribution(requirement.name)
        todo += found[key].requires or []
    return list(found.values())


def link_dependencies(requirements: list[str], into: Path) -> None:
    """Link the top-level modules and metadata of every needed distribution into `into`."""
    into.mkdir()
    for dist in dependency_closure(requirements):
        site = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops - {"__pycache__"}):
            if not (into / top).exists():
                (into / top).symlink_to(site / top)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(REPO / name, source / name)
    wheels = base / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(wheels), str(source)], cwd=base)
    (wheel,) = wheels.glob("gpunode-*.whl")
    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=base)
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q",
         "--no-deps", "--no-index", str(wheel)], cwd=base)
    metadata = importlib.metadata.Distribution.at(next(
        (venv / "lib").glob("python3.*/site-packages/gpunode-*.dist-info")))
    link_dependencies(metadata.requires or [], base / "deps")
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    (site / "gpunode-test-deps.pth").write_text(f"{base / 'deps'}\n")
    workdir = base / "elsewhere"
    workdir.mkdir()
    yield Installed(wheel, venv, workdir)


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return done


def ignition_argv(fmt: str, agent_config: bool) -> list[str]:
    argv = ["--log-format", "json", "ignition", "--format", fmt, "--sysext-url", URL,
            "--sysext-sha512", SHA512]
    return argv + (["--agent-config", str(EXAMPLE_CONFIG)] if agent_config else [])


def test_the_wheel_holds_the_units_byte_for_byte_and_no_test_support(
        installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        units = {n for n in names if n.startswith("gpunode/delivery/units/")}
        assert units == {f"gpunode/delivery/units/{p.name}" for p in (REPO / "units").iterdir()
                         if p.suffix in (".service", ".conf")}
        for name in units:
            assert wheel.read(name) == (REPO / name).read_bytes(), name
    tops = {name.split("/")[0] for name in names}
    assert tops == {"gpunode", installed.wheel.name.split("-py3")[0] + ".dist-info"}
    assert not [n for n in names if "gpunode_testing" in n or "fixtures" in n
                or n.startswith(("tests/", "testing/"))]


def test_the_installed_gpunode_runs_from_the_fresh_virtualenv_not_the_checkout(
        installed: Installed) -> None:
    done = run([str(installed.venv / "bin/python"), "-c",
                "import gpunode, importlib.resources as r; print(gpunode.__file__); "
                "print(r.files('gpunode.delivery') / 'units')"], cwd=installed.workdir)
    module, units = done.stdout.splitlines()
    assert Path(module).is_relative_to(installed.venv), module
    assert Path(units).is_relative_to(installed.venv) and Path(units).is_dir(), units


@pytest.mark.parametrize("agent_config", [True, False], ids=["with-config", "without-config"])
@pytest.mark.parametrize("fmt", ignition.FORMATS)
def test_the_installed_gpunode_renders_what_the_checkout_renders(
        installed: Installed, fmt: str, agent_config: bool) -> None:
    argv = ignition_argv(fmt, agent_config)
    wheel = subprocess.run([str(installed.venv / "bin/gpunode"), *argv], cwd=installed.workdir,
                           env=CLEAN_ENV, capture_output=True, text=True, timeout=60,
                           check=False)
    checkout = subprocess.run([str(Path(sys.executable).parent / "gpunode"), *argv],
                              cwd=REPO, env=CLEAN_ENV, capture_output=True, text=True,
                              timeout=60, check=False)
    assert (wheel.returncode, checkout.returncode) == (0, 0), wheel.stderr + checkout.stderr
    assert wheel.stdout == checkout.stdout
