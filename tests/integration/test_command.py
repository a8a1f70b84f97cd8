"""gpunode.command: what a user reads when a program fails, cannot start or hangs; programs
started side by side (Started) run at the same time and are reaped; programs in a Series run
one after the other, and a discarded series stops."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpunode.command import CommandFailed, Series, Started, run


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


def test_a_series_runs_each_program_after_the_one_before_has_ended(tmp_path: Path) -> None:
    """Each program notes its start and end: the second starts only after the first ended,
    and the results are taken in any order."""
    log = tmp_path / "log"
    first = ["sh", "-c", f"echo start-1 >> {log}; sleep 0.3; echo end-1 >> {log}; echo one"]
    second = ["sh", "-c", f"echo start-2 >> {log}; echo two"]
    series = Series([(first, 10.0), (second, 10.0)])
    assert second in series and ("other",) not in series
    assert series.take(second) == "two\n"
    assert series.take(first) == "one\n"
    assert log.read_text().split() == ["start-1", "end-1", "start-2"]
    assert second not in series  # taken: asked once
    series.discard()


def test_a_series_keeps_each_program_s_own_errors_for_its_asker() -> None:
    series = Series([(["sh", "-c", "echo bad >&2; exit 3"], 10.0),
                     (["/nonexistent/containerd", "--version"], 10.0),
                     (["sleep", "5"], 0.2), (["echo", "fine"], 10.0)])
    with pytest.raises(CommandFailed, match="exited 3: bad"):
        series.take(["sh", "-c", "echo bad >&2; exit 3"])
    with pytest.raises(CommandFailed, match="could not be started"):
        series.take(["/nonexistent/containerd", "--version"])
    with pytest.raises(CommandFailed, match=r"timed out after 0\.2 s"):
        series.take(["sleep", "5"])
    assert series.take(["echo", "fine"]) == "fine\n"


def test_a_discarded_series_stops_the_running_program_and_starts_no_other(
        tmp_path: Path) -> None:
    marker = tmp_path / "second-ran"
    series = Series([(["sleep", "30"], 60.0), (["touch", str(marker)], 10.0)])
    time.sleep(0.2)  # the first is running
    running = series._running._process if series._running else None
    assert running is not None and running.poll() is None
    began = time.monotonic()
    series.discard()
    assert time.monotonic() - began < 5  # not the 30 s of the sleep
    assert not marker.exists()
    with pytest.raises(CommandFailed, match="was stopped before it started"):
        series.take(["touch", str(marker)])
    with pytest.raises(ChildProcessError):
        os.waitpid(running.pid, os.WNOHANG)  # reaped: no zombie
