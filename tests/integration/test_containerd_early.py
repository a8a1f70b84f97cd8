"""containerd's `--version` started as a GPU node's boot begins (gpunode/containerd/early.py)
and taken, or stopped, by the probe, with the real containerd binary."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpunode.containerd import early
from gpunode.containerd.probe import CommandProbe


@pytest.fixture
def containerd() -> str:
    if not (os.path.isfile(early.BINARY) and os.access(early.BINARY, os.X_OK)):
        pytest.fail(f"{early.BINARY} is not installed: the Makefile's setup installs containerd")
    return early.BINARY


def test_the_early_version_is_the_one_the_probe_takes(containerd: str) -> None:
    early.start("/")
    started = early._started.get(early.version_argv(containerd))
    assert started is not None
    probe = CommandProbe()
    probe.prefetch(containerd, None)  # as locate.start_probes does: takes it
    assert early._started == {} and probe._started[early.version_argv(containerd)] is started
    version = probe.version(containerd)
    assert version is not None and version >= (1, 6)
    probe.discard()


def test_a_guess_that_is_not_the_located_binary_is_stopped_and_reaped(containerd: str,
                                                                       tmp_path: Path) -> None:
    other = tmp_path / "containerd"
    other.symlink_to(containerd)  # another path to the same program
    early.start("/")
    started = early._started[early.version_argv(containerd)]
    probe = CommandProbe()
    assert probe.version(str(other)) is not None  # its own program, not the guess
    probe.discard()  # the step's plan ends so
    assert early._started == {} and started.returncode is not None


def test_nothing_is_started_under_another_root(containerd: str, tmp_path: Path) -> None:
    early.start(str(tmp_path))
    assert early._started == {}


def test_a_guess_asked_after_its_own_timeout_still_answers(containerd: str) -> None:
    """A boot that waited for the node lock longer than the probe's timeout: the program,
    long done, is read, not reported as timed out."""
    early.start("/")
    started = early._started[early.version_argv(containerd)]
    started._deadline = 0.0  # as if started VERSION_TIMEOUT ago and more
    probe = CommandProbe()
    assert probe.version(containerd) is not None
    probe.discard()


def test_a_boot_cut_short_stops_the_early_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe leads its own session (early.started), so a Ctrl-C on gpunode's terminal does
    not reach it: gpunode stops and reaps it on that way out too."""
    from gpunode.cli import entry
    from gpunode.platform import command

    hung = command.Started(["sleep", "30"], 60, own_session=True)  # a containerd that hangs
    monkeypatch.setitem(early._started, ("sleep", "30"), hung)

    def interrupted() -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "main", interrupted)
    monkeypatch.setattr(entry.gc, "disable", lambda: None)  # (this test process keeps its GC)
    with pytest.raises(KeyboardInterrupt):
        entry.run()
    assert early._started == {} and hung.returncode is not None
