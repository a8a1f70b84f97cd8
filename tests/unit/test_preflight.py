"""The preflight under --root (a mounted image, a fixture): no service manager can be asked, so
the tree's own unit files say whether Flatcar's nvidia.service is enabled, and a mask wins."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import HostFactory
from gpunode.platform import flatcar
from hostile.support import Cli


def enable(root: Path, directory: str = "usr/lib/systemd/system") -> None:
    unit = root / directory / flatcar.NVIDIA_UNIT
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nExecStart=/usr/lib/nvidia/bin/setup-nvidia\n")
    wants = root / directory / "multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    os.symlink(f"../{flatcar.NVIDIA_UNIT}", wants / flatcar.NVIDIA_UNIT)


def test_an_enabled_nvidia_service_in_the_tree_is_a_problem_plan_and_boot_name(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    enable(host.root)
    planned = cli("--root", str(host.root), "plan")
    booted = cli("--root", str(host.root), "boot")
    assert planned.code == 0 and "preflight: would fail: Flatcar's nvidia.service" in planned.out
    assert booted.code == 1
    assert [e["error_code"] for e in booted.errors] == ["preflight-conflict"]


def test_a_masked_nvidia_service_is_no_conflict(cli: Cli, make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    enable(host.root)
    (host.root / "etc/systemd/system").mkdir(parents=True, exist_ok=True)
    os.symlink("/dev/null", host.root / "etc/systemd/system" / flatcar.NVIDIA_UNIT)
    assert "preflight" not in cli("--root", str(host.root), "plan").out
