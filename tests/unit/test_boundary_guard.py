"""The test boundary guard (gpunode_testing.boundary) refuses what a test did not opt in to.

A whole guarded pytest session, run as a process:
tests/integration/test_boundary_guard_session.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from gpunode_testing.boundary import BoundaryViolation, guarded, integration_policy, unit_policy


def test_a_unit_test_may_not_read_the_machines_etc_hostname(tmp_path: Path) -> None:
    with guarded(unit_policy("t", tmp_path)), \
            pytest.raises(BoundaryViolation, match=r"read /etc/hostname .*allow_paths"):
        open("/etc/hostname").close()


def test_a_unit_test_may_not_start_true(tmp_path: Path) -> None:
    with guarded(unit_policy("t", tmp_path)), \
            pytest.raises(BoundaryViolation, match=r"started a process .*integration"):
        subprocess.run(["true"], check=False)


def test_a_unit_test_may_not_list_or_write_outside_its_temporary_directory(
        tmp_path: Path) -> None:
    with guarded(unit_policy("t", tmp_path)):
        with pytest.raises(BoundaryViolation, match=r"read /etc \(os.listdir\)"):
            os.listdir("/etc")
        with pytest.raises(BoundaryViolation, match="wrote /var/lib/gpunode-guard-probe"):
            os.mkdir("/var/lib/gpunode-guard-probe")
        with pytest.raises(BoundaryViolation, match="asked the machine"):
            socket.gethostname()


def test_a_unit_test_reads_and_writes_its_tmp_path_and_reads_the_checkout(
        tmp_path: Path) -> None:
    with guarded(unit_policy("t", tmp_path)) as policy:
        (tmp_path / "a").write_text("x")
        os.rename(tmp_path / "a", tmp_path / "b")
        assert "[project]" in REPO.joinpath("pyproject.toml").read_text()
        with open(os.devnull, "w") as null:
            null.write("x")
    assert policy.violations == []


def test_a_symlink_in_tmp_path_that_leads_out_is_followed_and_refused(tmp_path: Path) -> None:
    (tmp_path / "escape").symlink_to("/etc")
    refused = r"escape \(os.listdir\) \(that is /etc\)"
    with guarded(unit_policy("t", tmp_path)), pytest.raises(BoundaryViolation, match=refused):
        os.listdir(tmp_path / "escape")


def test_removing_a_symlink_in_tmp_path_that_leads_out_acts_on_the_link(tmp_path: Path) -> None:
    (tmp_path / "escape").symlink_to("/etc")
    with guarded(unit_policy("t", tmp_path)) as policy:
        os.remove(tmp_path / "escape")
    assert policy.violations == []


def test_an_integration_test_may_start_processes_but_not_read_etc(tmp_path: Path) -> None:
    with guarded(integration_policy("t", tmp_path)):
        subprocess.run(["true"], check=True)
        with pytest.raises(BoundaryViolation, match="/etc/hostname"):
            open("/etc/hostname").close()
