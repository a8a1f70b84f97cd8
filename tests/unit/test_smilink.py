"""The boot step nvidia_smi (kubernetes.stack = "gpu-operator"): the loaded driver's nvidia-smi
where the GPU Operator's validator looks, through a wrapper in /opt/bin written only over
nothing or gpunode's own, and refused, naming it, where the validator would run another one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory, with_runtime_binary
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.driver import smilink
from gpunode.pipeline import boot
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from gpunode_testing import fixtures
from gpunode_testing.driver_files import BINARIES, LIBRARIES, write_userspace

VERSION = "550.127.08"
PREBUILT = f"/opt/nvidia/modules/{fixtures.KERNEL}"
SMI = f"{PREBUILT}/bin/nvidia-smi"
WRAPPER = smilink.wrapper(SMI, f"{PREBUILT}/lib")
OPERATOR = AgentConfig(kubernetes=KubernetesConfig(stack="gpu-operator"))


class NoKernel:
    """A loaded driver needs no modprobe."""

    def modinfo(self, paths: list[str]) -> dict[str, Any]:
        raise AssertionError(f"boot read modules on a loaded node: {paths}")

    def run(self, argv: tuple[str, ...]) -> None:
        raise AssertionError(f"boot loaded a module on a loaded node: {argv}")


def adapters() -> boot.Adapters:
    return boot.Adapters(systemd=NoSystemd(), kmod=NoKernel())


def prebuilt_node(make_host: HostFactory) -> Host:
    """A ready T4 node whose driver user-space is a prebuilt directory's, none of it in /usr."""
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    for name in LIBRARIES:
        for lib in (host.root / "usr/lib64").glob(f"{name}.so*"):
            lib.unlink()
    for name in BINARIES:
        (host.root / "usr/bin" / name).unlink()
    write_userspace(host.root, VERSION, False, lib_dir=f"{PREBUILT}/lib",
                    bin_dir=f"{PREBUILT}/bin")
    return host


def step(run: boot.BootRun) -> dict[str, object]:
    return next(s for s in run.steps if s["name"] == "nvidia_smi")


def test_a_driver_sysext_in_usr_needs_no_link(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    run = boot.boot(host, OPERATOR, adapters())
    assert run.outcome == "ok", run.steps
    assert (step(run)["changed"], step(run)["validator_runs"]) == (False, "/usr/bin/nvidia-smi")
    assert not (host.root / "opt/bin/nvidia-smi").exists()


def test_the_gpunode_stack_runs_no_nvidia_smi_step(make_host: HostFactory) -> None:
    run = boot.boot(prebuilt_node(make_host), AgentConfig(), adapters())
    assert "nvidia_smi" not in [s["name"] for s in run.steps]


def test_a_prebuilt_drivers_nvidia_smi_gets_a_wrapper_in_opt_bin_once(
        make_host: HostFactory) -> None:
    host = prebuilt_node(make_host)
    plan = boot.plan(host, OPERATOR, adapters())
    assert [(a.step, a.description) for a in plan.actions if a.step == "nvidia_smi"] == [
        ("nvidia_smi", f"write /opt/bin/nvidia-smi to run {SMI}: the GPU Operator's validator "
                       "looks there")]
    run = boot.boot(host, OPERATOR, adapters())
    assert run.outcome == "ok", run.steps
    assert (step(run)["changed"], step(run)["nvidia_smi"]) == (True, SMI)
    written = host.root / "opt/bin/nvidia-smi"
    assert written.read_text() == WRAPPER
    assert written.stat().st_mode & 0o777 == 0o755
    assert WRAPPER.splitlines()[2:] == [f"LD_LIBRARY_PATH='{PREBUILT}/lib'",
                                        "export LD_LIBRARY_PATH", f"exec '{SMI}' \"$@\""]
    assert smilink.reachable(host) == smilink.WRAPPER
    assert boot.plan(host, OPERATOR, adapters()).actions == []
    again = boot.boot(host, OPERATOR, adapters())
    assert step(again)["changed"] is False


@pytest.mark.parametrize("state", ["old-driver", "not-executable"])
def test_gpunodes_own_wrapper_is_rewritten_when_it_is_not_right(make_host: HostFactory,
                                                                state: str) -> None:
    host = prebuilt_node(make_host)
    written = host.root / "opt/bin/nvidia-smi"
    written.parent.mkdir(parents=True, exist_ok=True)
    if state == "old-driver":
        written.write_text(smilink.wrapper("/var/lib/gpunode/old/bin/nvidia-smi", "/x/lib"))
        written.chmod(0o755)
    else:
        written.write_text(WRAPPER)
        written.chmod(0o644)
    run = boot.boot(host, OPERATOR, adapters())
    assert step(run)["changed"] is True
    assert written.read_text() == WRAPPER and written.stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("foreign", ["empty-file", "script", "link"])
def test_a_foreign_opt_bin_nvidia_smi_is_refused_and_kept(make_host: HostFactory,
                                                          foreign: str) -> None:
    host = prebuilt_node(make_host)
    path = host.root / "opt/bin/nvidia-smi"
    path.parent.mkdir(parents=True, exist_ok=True)
    if foreign == "empty-file":
        path.write_text("")  # empty: the validator would not run it either
    elif foreign == "script":
        path.write_text("#!/bin/sh\nexec /home/admin/nvidia-smi\n")
    else:
        path.symlink_to("/home/admin/nvidia-smi")
    before = path.read_text() if foreign != "link" else None
    run = boot.boot(host, OPERATOR, adapters())
    failed = step(run)
    assert (run.outcome, failed["code"]) == ("failed", "nvidia-smi-unreachable")
    assert "is not gpunode's" in str(failed["error"]) and "remove" in str(failed["hint"])
    assert path.is_symlink() == (foreign == "link")
    if before is not None:
        assert path.read_text() == before


def test_another_nvidia_smi_the_validator_finds_first_is_refused_naming_it(
        make_host: HostFactory) -> None:
    host = prebuilt_node(make_host)
    other = host.root / "usr/sbin/nvidia-smi"
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text("#!/bin/sh\n# another driver's\n")
    other.chmod(0o755)
    run = boot.boot(host, OPERATOR, adapters())
    failed = step(run)
    assert failed["code"] == "nvidia-smi-unreachable"
    assert f"would run {host.root}/usr/sbin/nvidia-smi" in str(failed["error"])
    assert not (host.root / "opt/bin/nvidia-smi").exists()


def test_a_driver_root_without_nvidia_smi_fails_the_step(make_host: HostFactory) -> None:
    host = prebuilt_node(make_host)
    (host.root / SMI.lstrip("/")).unlink()
    run = boot.boot(host, OPERATOR, adapters())
    failed = step(run)
    assert failed["code"] == "nvidia-smi-unreachable"
    assert f"({PREBUILT}) has no nvidia-smi" in str(failed["error"])


def test_without_a_loaded_driver_the_step_says_the_driver_step_failed(
        make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "bare"))
    run = boot.boot(host, OPERATOR, adapters())
    assert step(run)["error"] == smilink.NO_DRIVER[0]


def _loop(path: Path) -> None:
    path.symlink_to(path.name)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize("make", [_loop, _fifo, Path.mkdir], ids=["link-loop", "fifo", "directory"])
def test_what_no_validator_could_run_at_an_earlier_path_is_passed_over(
        make_host: HostFactory, make: Callable[[Path], None]) -> None:
    """The validator skips what is no executable file; so does gpunode, without hanging."""
    host = prebuilt_node(make_host)
    (host.root / "usr/sbin").mkdir(parents=True, exist_ok=True)
    make(host.root / "usr/sbin/nvidia-smi")
    run = boot.boot(host, OPERATOR, adapters())
    assert (step(run)["outcome"], step(run)["changed"]) == ("ok", True), run.steps


def test_a_fifo_where_the_wrapper_goes_is_refused_without_hanging(make_host: HostFactory) -> None:
    host = prebuilt_node(make_host)
    (host.root / "opt/bin").mkdir(parents=True, exist_ok=True)
    os.mkfifo(host.root / "opt/bin/nvidia-smi")
    failed = step(boot.boot(host, OPERATOR, adapters()))
    assert failed["code"] == "nvidia-smi-unreachable" and "is not gpunode's" in str(failed["error"])
