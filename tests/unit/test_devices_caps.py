"""MIG capability nodes get the mode the driver states for them (`DeviceFileMode:`), not the
0666 of the other nodes: status calls a node nvidia-modprobe made correctly ok, and
`driver load` never widens the MIG config capability to everyone."""

from __future__ import annotations

import os
import stat

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig
from gpunode.driver import devices, step
from gpunode.status import evaluate, observe

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="the fixture's real character devices need root (mknod)")

CAPS = {"/proc/driver/nvidia/capabilities/mig/config": "DeviceFileMinor: 1\nDeviceFileMode: 256\n",
        "/proc/driver/nvidia/capabilities/mig/monitor": "DeviceFileMinor: 2\nDeviceFileMode: 292\n"}


def test_driver_load_makes_each_capability_node_with_the_drivers_mode(
        make_host: HostFactory) -> None:
    host = make_host("nc24ads-a100-v4", "ready", extra=CAPS)
    step.make_nodes(host)
    modes = {name: stat.S_IMODE((host.root / f"dev/nvidia-caps/{name}").stat().st_mode)
             for name in ("nvidia-cap1", "nvidia-cap2")}
    assert modes == {"nvidia-cap1": 0o400, "nvidia-cap2": 0o444}


def test_a_capability_node_at_the_drivers_mode_is_ok_and_left_alone(
        make_host: HostFactory) -> None:
    host = make_host("nc24ads-a100-v4", "ready", extra=CAPS)
    step.make_nodes(host)
    report = evaluate(observe(host, AgentConfig(), contact_api=False))
    assert next(c for c in report.checks if c.name == "device_nodes").state == "ok"
    assert step.make_nodes(host) == []


def test_a_capability_node_widened_to_0666_is_named_and_narrowed(
        make_host: HostFactory) -> None:
    host = make_host("nc24ads-a100-v4", "ready", extra=CAPS)
    step.make_nodes(host)
    (host.root / "dev/nvidia-caps/nvidia-cap1").chmod(0o666)
    assert step.make_nodes(host) == [
        "/dev/nvidia-caps/nvidia-cap1 (509:1): has mode 666, expected 400"]


def test_a_capability_without_a_stated_mode_is_read_only() -> None:
    nodes = devices.wanted({"nvidia-frontend": 195, "nvidia-uvm": 508, "nvidia-caps": 509}, [0],
                           False, {"monitor": devices.Capability(2, devices.CAP_DEFAULT_MODE)})
    assert (nodes[-1].path, nodes[-1].mode) == ("/dev/nvidia-caps/nvidia-cap2", 0o444)
