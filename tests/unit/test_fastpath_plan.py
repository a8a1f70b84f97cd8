"""The no-op fast path never skips a boot that would change something: after a successful boot,
any change to an input that makes `gpunode plan` name an action (or a problem) also makes the
stamp stale, so the next `gpunode boot` runs the pipeline instead of logging boot.unchanged.

Each case boots a fixture node (through gpunode.pipeline.boot, as the boot unit does), checks that the
stamp holds, then changes one thing the steps read and asks both plan and the fast path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode import __version__
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.pipeline import boot, fastpath
from gpunode.platform import flatcar
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd

KUBELET_UNIT = "etc/systemd/system/kubelet.service"


class NoKernel:
    """A loaded driver needs no modprobe; a plan that would load one only describes it."""

    def depends(self, path: str) -> list[str]:
        return []

    def run(self, argv: tuple[str, ...]) -> None:
        raise AssertionError(f"boot loaded a module on a ready node: {argv}")


def booted(make_host: HostFactory, config: AgentConfig) -> Host:
    host = make_host("nc24ads-a100-v4", "ready")
    runtime = host.root / "usr/bin/nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    run = boot.boot(host, config, adapters())
    assert run.outcome == "ok", run.steps
    assert fastpath.unchanged(str(host.root), __version__, None)
    return host


def adapters() -> boot.Adapters:
    return boot.Adapters(systemd=NoSystemd(), kmod=NoKernel())


def remove(relative: str) -> Callable[[Path], None]:
    return lambda root: (root / relative).unlink()


def write(relative: str, text: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return change


def without_module(name: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        modules = root / "proc/modules"
        modules.write_text("".join(line for line in modules.read_text().splitlines(True)
                                   if not line.startswith(f"{name} ")))
    return change


def enable_nvidia_service(root: Path) -> None:
    wants = root / "usr/lib/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    os.symlink(f"../{flatcar.NVIDIA_UNIT}", wants / flatcar.NVIDIA_UNIT)


def drop_the_runtime(root: Path) -> None:
    config = root / "etc/containerd/config.toml"
    table = '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]'
    config.write_text(config.read_text().split(table)[0])


CHANGES: dict[str, Callable[[Path], None]] = {
    "a /dev/char link removed": remove("dev/char/195:0"),
    "a device node removed": remove("dev/nvidia-uvm"),
    "a device node's mode narrowed": lambda root: (root / "dev/nvidia0").chmod(0o600),
    "nvidia_uvm unloaded": without_module("nvidia_uvm"),
    "Flatcar's nvidia.service enabled": enable_nvidia_service,
    "the kubelet unit appears (register_with = kubelet)": write(
        KUBELET_UNIT, "[Service]\nExecStart=/opt/bin/kubelet\n"),
    "the nvidia runtime removed from containerd's config": drop_the_runtime,
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_change_plan_acts_on_makes_the_stamp_stale(make_host: HostFactory,
                                                      change: Callable[[Path], None]) -> None:
    config = AgentConfig(kubernetes=KubernetesConfig(register_with="kubelet"))
    host = booted(make_host, config)
    change(host.root)
    the_plan = boot.plan(host, config, adapters())
    assert the_plan.actions or the_plan.problems, "the change must matter to plan"
    assert not fastpath.unchanged(str(host.root), __version__, None)


def test_a_change_nobody_reads_keeps_the_stamp(make_host: HostFactory) -> None:
    config = AgentConfig()
    host = booted(make_host, config)
    (host.root / "etc/motd").write_text("hello\n")
    assert (boot.plan(host, config, adapters()).actions, fastpath.unchanged(
        str(host.root), __version__, None)) == ([], True)
