"""gpunode.command.run: what a user reads when a program fails, cannot start or hangs."""

from __future__ import annotations

import pytest

from gpunode.command import CommandFailed, run


def test_a_missing_program_could_not_be_started() -> None:
    with pytest.raises(CommandFailed) as info:
        run(["/nonexistent/containerd", "--version"])
    assert str(info.value) == ("'/nonexistent/containerd --version' could not be started: "
                               "No such file or directory")
    assert (info.value.argv, info.value.returncode, info.value.stderr) == (
        ["/nonexistent/containerd", "--version"], None, "No such file or directory")


def test_a_program_that_runs_too_long_timed_out_after_its_limit() -> None:
    with pytest.raises(CommandFailed) as info:
        run(["sleep", "5"], timeout=0.2)
    assert str(info.value) == "'sleep 5' timed out after 0.2 s"
    assert info.value.returncode is None


def test_a_failing_program_keeps_its_exit_code_and_last_stderr_lines() -> None:
    with pytest.raises(CommandFailed) as info:
        run(["sh", "-c", "echo one >&2; echo two >&2; exit 3"])
    assert str(info.value) == "'sh -c echo one >&2; echo two >&2; exit 3' exited 3: one / two"
    assert (info.value.returncode, info.value.stderr) == (3, "one\ntwo\n")


def test_a_command_refused_before_running_says_it_was_not_run() -> None:
    assert str(CommandFailed(["modprobe", "nvidia"], None, "not under --root")) == (
        "'modprobe nvidia' was not run: not under --root")
