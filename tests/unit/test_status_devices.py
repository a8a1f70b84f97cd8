"""`gpunode status` judges the device nodes exactly as `gpunode driver load` makes them
(driver/devices.py): the nodes the driver calls for, MIG capability nodes included, with their
numbers and modes (0666; a MIG capability the mode the driver states). Where status says ok,
driver load has nothing to fix, and where driver load would fix something, status says so and
names the command."""

from __future__ import annotations

import json
import os

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig
from gpunode.driver import step
from gpunode.platform.host import Host
from gpunode.status import Check, evaluate, observe
from hostile.support import Cli

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="the fixture's real character devices need root (mknod)")

CAPS = {"/proc/driver/nvidia/capabilities/mig/config": "DeviceFileMinor: 1\nDeviceFileMode: 256\n",
        "/proc/driver/nvidia/capabilities/mig/monitor": "DeviceFileMinor: 2\nDeviceFileMode: 292\n"}


def device_nodes(host: Host) -> Check:
    report = evaluate(observe(host, AgentConfig(), contact_api=False))
    return next(c for c in report.checks if c.name == "device_nodes")


def test_a_missing_mig_capability_node_is_not_ok_and_driver_load_makes_it(
        make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra=CAPS)
    check = device_nodes(host)
    assert (check.state, check.detail) == ("fail", "/dev/nvidia-caps/nvidia-cap1 missing; "
                                           "/dev/nvidia-caps/nvidia-cap2 missing")
    assert check.hint is not None and "gpunode driver load" in check.hint
    assert step.make_nodes(host)  # what driver load does about it
    assert device_nodes(host).state == "ok"


def test_a_node_with_mode_0600_is_not_ok_and_driver_load_fixes_it(
        make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "dev/nvidia0").chmod(0o600)
    check = device_nodes(host)
    assert (check.state, check.detail) == ("fail", "/dev/nvidia0 has mode 600, expected 666")
    assert check.hint is not None and "gpunode driver load" in check.hint
    assert step.make_nodes(host) == ["/dev/nvidia0 (195:0): has mode 600, expected 666"]
    assert device_nodes(host).state == "ok"


def test_status_says_not_ready_where_driver_load_would_fix_a_node(
        make_host: HostFactory, cli: Cli) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "dev/nvidia-uvm").chmod(0o600)
    result = cli("--root", str(host.root), "status", "--json")
    checks = {c["name"]: c for c in json.loads(result.out)["checks"]}
    assert (result.code, checks["device_nodes"]["state"]) == (1, "fail")
    assert "run 'gpunode driver load'" in checks["device_nodes"]["hint"]


def test_a_ready_node_has_nothing_for_driver_load_to_fix(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra=CAPS)
    step.make_nodes(host)
    assert device_nodes(host) == Check("device_nodes", "ok", "7 device nodes present")
    assert step.make_nodes(host) == []


def test_a_missing_dev_char_link_is_not_ok_and_driver_load_makes_it(
        make_host: HostFactory) -> None:
    """runc and systemd look devices up by /dev/char/MAJOR:MINOR; driver load makes the link."""
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "dev/char/195:0").unlink()
    check = device_nodes(host)
    assert (check.state, check.detail) == ("fail", "/dev/nvidia0: no /dev/char/195:0 link")
    assert check.hint is not None and "gpunode driver load" in check.hint
    assert step.make_nodes(host) == ["/dev/nvidia0 (195:0): no /dev/char/195:0 link"]
    assert device_nodes(host).state == "ok"
