"""The test boundary guard (gpunode_testing.boundary) in a whole pytest session, run as a
process (pytester): it fails the tests that did what their markers do not allow and passes the
marked ones. The guard's rules one by one, in-process: tests/unit/test_boundary_guard.py.
"""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]


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
