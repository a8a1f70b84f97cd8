"""gpunode/cpushare.py against a stand-in for /proc/self/autogroup (a file in tmp_path): what
it does with what a kernel may show, and where the boot gives the weight back. The real
kernel's file: tests/integration/test_cpushare_kernel.py."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpunode import cpushare
from gpunode.cli import run as clirun
from gpunode.platform import sdnotify


@pytest.fixture
def autogroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in, at nice 0, and this process leading its session as a service does."""
    path = tmp_path / "autogroup"
    path.write_text("/autogroup-42 nice 0\n")
    monkeypatch.setattr(cpushare, "AUTOGROUP", str(path))
    monkeypatch.setattr(cpushare, "_given", [])
    monkeypatch.setattr(os, "getsid", lambda pid: os.getpid())
    return path


def test_the_boot_raises_its_session_and_gives_the_weight_back(autogroup: Path) -> None:
    cpushare.raise_for_boot("/")
    assert autogroup.read_text() == str(cpushare.BOOST)
    cpushare.raise_for_boot("/")  # once: the value to give back stays nice 0
    cpushare.give_back()
    assert autogroup.read_text() == "0"
    cpushare.give_back()  # nothing left to give back
    assert autogroup.read_text() == "0"


@pytest.mark.parametrize("content", ["", "nonsense", "/autogroup-42 nice many\n", "\0" * 64])
def test_what_is_not_a_nice_value_is_left_as_it_is(autogroup: Path, content: str) -> None:
    autogroup.write_text(content)
    cpushare.raise_for_boot("/")
    cpushare.give_back()
    assert autogroup.read_text() == content


def test_a_session_that_already_weighs_more_is_left_as_it_is(autogroup: Path) -> None:
    autogroup.write_text("/autogroup-42 nice -15\n")
    cpushare.raise_for_boot("/")
    cpushare.give_back()
    assert autogroup.read_text() == "/autogroup-42 nice -15\n"


def test_a_kernel_without_autogroup_changes_nothing(autogroup: Path) -> None:
    autogroup.unlink()
    cpushare.raise_for_boot("/")
    cpushare.give_back()
    assert not autogroup.exists()


def test_a_process_that_does_not_lead_its_session_changes_nothing(
        autogroup: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getsid", lambda pid: os.getpid() + 1)  # an operator's shell's
    cpushare.raise_for_boot("/")
    assert autogroup.read_text() == "/autogroup-42 nice 0\n"


def test_a_boot_under_another_root_changes_nothing(autogroup: Path) -> None:
    """`--root`: a fixture's or an image's tree, not the node this process runs on."""
    cpushare.raise_for_boot("/var/tmp/image")
    assert autogroup.read_text() == "/autogroup-42 nice 0\n"


def test_the_record_written_gives_the_weight_back_as_containerd_may_start(
        autogroup: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdnotify, "_ready", [])
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    cpushare.raise_for_boot("/")
    clirun._ready(SimpleNamespace(outcome="ok"))
    assert autogroup.read_text() == "0"
