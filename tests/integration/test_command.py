"""gpunode.command: what a user reads when a program fails, cannot start or hangs; programs
started side by side (Started) run at the same time and are reaped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpunode.command import CommandFailed, Started, run


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


def test_started_programs_run_at_the_same_time(tmp_path: Path) -> None:
    """The first waits for what the second writes into a FIFO: run one after the other, the
    first would time out."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = Started(["sh", "-c", f"read line < {fifo}; echo got $line"], timeout=10)
    writer = Started(["sh", "-c", f"echo hello > {fifo}"], timeout=10)
    assert reader.result() == "got hello\n"
    assert writer.result() == ""


def test_a_started_program_s_errors_are_run_s() -> None:
    with pytest.raises(CommandFailed, match="could not be started"):
        Started(["/nonexistent/containerd", "--version"]).result()
    with pytest.raises(CommandFailed, match="exited 3"):
        Started(["sh", "-c", "exit 3"]).result()
    with pytest.raises(CommandFailed, match=r"timed out after 0\.2 s"):
        Started(["sleep", "5"], timeout=0.2).result()


def test_a_discarded_program_is_stopped_and_reaped() -> None:
    started = Started(["sleep", "30"])
    pid = started._process.pid if started._process else 0
    started.discard()
    assert started._process is not None and started._process.returncode is not None
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # nothing left to reap: no zombie
