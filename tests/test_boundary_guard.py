"""The test boundary guard (gpunode_testing.boundary) refuses what a test did not opt in to."""

from __future__ import annotations

import os
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest

from gpunode_testing.boundary import BoundaryViolation, guarded, integration_policy, unit_policy

pytest_plugins = ["pytester"]


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
        assert "[project]" in Path(__file__).parent.parent.joinpath("pyproject.toml").read_text()
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


@pytest.mark.integration  # runs pytest as a process
def test_guarded_session_fails_unmarked_tests_and_passes_marked_ones(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_probe=textwrap.dedent("""
        import subprocess
        import pytest

        def test_reads_hostname():
            try:
                open("/etc/hostname").read()
            except Exception:
                pass  # not caught: the guard's error is a BaseException

        def test_swallows_everything():
            try:
                open("/etc/hostname").read()
            except BaseException:
                pass  # caught: the test fails all the same, when it ends

        def test_starts_true():
            subprocess.run(["true"])

        @pytest.mark.allow_paths("/etc/hostname")
        def test_reads_hostname_allowed():
            open("/etc/hostname").read()

        @pytest.mark.integration
        def test_starts_true_integration():
            subprocess.run(["true"], check=True)
    """))
    result = pytester.runpytest_subprocess("-p", "gpunode_testing.boundary", "-p",
                                           "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=2, errors=1)  # the swallower: passed, then error
    for line in ("*test_reads_hostname read /etc/hostname (open)*",
                 "*test_swallows_everything read /etc/hostname (open)*",
                 "*test_starts_true started a process (subprocess.Popen*"):
        result.stdout.fnmatch_lines([line])
