"""Hostile inputs of `gpunode detect`, round 3: an unreadable /proc/modules is a problem in the
listing, as every unreadable file detect reads is — not a failed command (it used to exit 1;
docs/cli.md: detect exits 0 whenever the command line and config are valid)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import HostFactory
from hostile.support import Cli


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize("make", [_fifo, _directory], ids=["fifo", "directory"])
def test_detect_lists_an_unreadable_proc_modules_as_a_problem_and_exits_0(
        make_host: HostFactory, cli: Cli, make: object) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    modules = root / "proc/modules"
    modules.unlink(missing_ok=True)
    make(modules)  # type: ignore[operator]
    result = cli("--root", str(root), "detect", "--json")
    assert result.code == 0, result.err
    listing = json.loads(result.out)
    assert listing["gpu_count"] == 1
    assert any(p.startswith(f"{modules}: is a") and "whether nouveau is loaded" in p
               for p in listing["problems"]), listing["problems"]


def test_status_with_an_unreadable_proc_modules_says_so_without_a_traceback(
        make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    (root / "proc/modules").unlink(missing_ok=True)
    os.mkfifo(root / "proc/modules")
    result = cli("--root", str(root), "status", "--json")
    assert result.code in (0, 1), result.err
    assert "proc/modules" in result.out + result.err
