"""gpunode's session weight during a GPU node's boot (gpunode/cpushare.py), on this machine's
kernel: what /proc/self/autogroup says in a process that leads its session, as a service does,
in one that does not, as at an operator's terminal, and in one the kernel refuses. Each child
runs in a session made for it, never in the test's: a test run that PID 1 started without
setsid (CI's may be) is in the kernel's default autogroup, whose file is empty. The boot's own
use, under systemd as PID 1: tests/integration/test_boot_systemd.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode import cpushare

pytestmark = pytest.mark.allow_paths(cpushare.AUTOGROUP)  # the test's own session's

CHILD = """
import os, sys
from gpunode import cpushare
if sys.argv[1] == "nobody":
    os.setgid(65534); os.setuid(65534)
def nice(): return open(cpushare.AUTOGROUP).read().split()[-1]
cpushare.raise_for_boot("/"); raised = nice()
cpushare.give_back(); print(raised, nice())
"""


@pytest.fixture(autouse=True)
def autogroup() -> None:
    if not Path(cpushare.AUTOGROUP).exists():
        pytest.fail("this kernel has no /proc/self/autogroup (CONFIG_SCHED_AUTOGROUP): the "
                    "unit tests cover a kernel without it; these need one with it")


# The operator's shell: it leads a session of its own and runs gpunode in it.
SHELL = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


def child(leads: bool, user: str = "root") -> list[str]:
    """CHILD's nice after raise_for_boot and after give_back, in a fresh session that it
    leads, as a service does, or that a shell leads, as at a terminal."""
    argv = [sys.executable, "-c", CHILD, user]
    if not leads:
        argv = [sys.executable, "-c", SHELL, *argv]
    done = subprocess.run(argv, capture_output=True, text=True, start_new_session=True,
                          check=False, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_session_leader_weighs_more_until_it_gives_the_weight_back() -> None:
    if os.geteuid() != 0:
        pytest.fail("run as root (CI does): a negative autogroup nice needs CAP_SYS_NICE")
    assert child(leads=True) == [str(cpushare.BOOST), "0"]


def test_outside_its_own_session_nothing_changes() -> None:
    """`gpunode boot` at a terminal: the shell's session is the operator's, not gpunode's."""
    if os.geteuid() != 0:
        pytest.fail("run as root (CI does): as root the kernel would let it raise the session")
    before = Path(cpushare.AUTOGROUP).read_text()  # the test's own, whatever it is
    assert child(leads=False) == ["0", "0"]
    assert Path(cpushare.AUTOGROUP).read_text() == before


def test_a_kernel_that_refuses_leaves_the_boot_unweighted_and_says_nothing() -> None:
    if os.geteuid() != 0:
        pytest.fail("run as root (CI does): the child becomes nobody, without CAP_SYS_NICE")
    assert child(leads=True, user="nobody") == ["0", "0"]
