"""gpunode.platform.command: what a user reads when a program fails, cannot start or hangs; programs
started side by side (Started) run at the same time and are reaped."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpunode.platform.command import CommandFailed, Started, run


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
    assert started.pid is not None
    started.discard()
    assert started.returncode == -9  # SIGKILL
    with pytest.raises(ChildProcessError):
        os.waitpid(started.pid, os.WNOHANG)  # nothing left to reap: no zombie


def test_a_discarded_program_s_child_holding_its_pipes_is_not_waited_for(
        tmp_path: Path) -> None:
    """`sh -c 'sleep 30 & wait'`: killing sh leaves the sleep with the pipes open."""
    pid_file = tmp_path / "sleep.pid"
    started = Started(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"])
    try:
        for _ in range(1000):  # 10 s at most
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.01)
        began = time.monotonic()
        started.discard()
        assert time.monotonic() - began < 5 and started.returncode == -9
    finally:
        os.kill(int(pid_file.read_text()), 9)  # the sleep, left to init


def test_a_program_sees_gpunode_s_environment_path_and_default_signals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on PATH; the environment as it is now; SIGPIPE at its default (Python ignores
    it, and an ignored signal would survive exec): `yes | head -1` ends at once."""
    monkeypatch.setenv("GPUNODE_PROBE", "seen")
    assert run(["sh", "-c", "echo $GPUNODE_PROBE"]) == "seen\n"
    assert run(["sh", "-c", "yes | head -1"], timeout=10) == "y\n"
    status = run(["sh", "-c", "grep -E '^Sig(Ign|Blk):' /proc/self/status"])
    ignored = int(status.split("SigIgn:")[1].split()[0], 16)
    assert not ignored & (1 << (13 - 1)) and not ignored & (1 << (25 - 1))  # PIPE, XFSZ


def test_output_is_text_as_popen_gave_it_and_bad_bytes_are_one_error() -> None:
    assert run(["printf", "a\\r\\nb\\rc\\n"]) == "a\nb\nc\n"  # universal newlines
    assert run(["printf", "\\303\\251\\n"]) == "\u00e9\n"
    with pytest.raises(CommandFailed, match="printed what is not text"):
        run(["printf", "\\377\\n"])
    with pytest.raises(CommandFailed, match="exited 1: bad \ufffd"):  # stderr: replaced
        run(["sh", "-c", "printf 'bad \\377\\n' >&2; exit 1"])


def test_a_large_output_on_both_pipes_is_read_whole() -> None:
    """More than a pipe holds on each, written interleaved: nothing blocks, nothing is lost."""
    out = run(["sh", "-c", "i=0; while [ $i -lt 3000 ]; do echo out-$i; echo err-$i >&2; "
               "i=$((i+1)); done"], timeout=30)
    assert out.splitlines()[-1] == "out-2999" and len(out.splitlines()) == 3000


@pytest.mark.parametrize(("line", "version"), [
    # Flatcar's (the ebuild builds with VERSION=v${PV}) and upstream's releases: a tag
    ("containerd github.com/containerd/containerd/v2 v2.1.5 fcd43222d6b07379a4be9786bda5", (2, 1)),
    ("containerd github.com/containerd/containerd v1.7.20 8fc6bcff51318944179630522a09", (1, 7)),
    # Debian's packages (tests/data/containerd/defaults/VERSIONS)
    ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3", (1, 6)),
    ("containerd github.com/containerd/containerd/v2 2.1.9+unknown", (2, 1)),
    ("containerd github.com/containerd/containerd/v2 (devel)", None),
])
def test_containerd_s_version_is_read_from_each_build_s_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str,
        version: tuple[int, int] | None) -> None:
    import io
    import json

    from gpunode import log
    from gpunode.containerd.probe import CommandProbe

    fake = tmp_path / "containerd"
    fake.write_text(f"#!/bin/sh\necho '{line}'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(log, "_logger", log.get())  # the test's logger is undone afterwards
    stream = io.StringIO()
    log.configure("json", stream=stream)
    assert CommandProbe().version(str(fake)) == version
    events = [json.loads(e) for e in stream.getvalue().splitlines()]
    # a line without a version is said, not taken silently as "unknown"
    assert [(e["event"], e.get("output")) for e in events] == (
        [] if version else [("containerd.version_unknown", line)])
