"""Hostile inputs to `gpunode watch --once`: what stands at /dev/kmsg (a FIFO, a directory, a
file larger than any kernel log, links out of the root or in a loop, nothing) is refused once,
never waited on; binary garbage, floods of lines and damaged records of its own are read past,
the Xid among them still found."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import HostFactory
from hostile.support import (
    Cli,
    check_refusal,
    make_absent,
    make_directory,
    make_link_out,
    make_loop,
)

XID_79 = b"4,900,5000000,-;NVRM: Xid (PCI:0001:00:00): 79, GPU has fallen off the bus.\n"


@pytest.fixture
def root(make_host: HostFactory) -> Path:
    return make_host("nc4as-t4-v3", "ready").root


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _too_large(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate((32 << 20) + 1)


REFUSED = {
    "fifo": (_fifo, r"kmsg.*is a FIFO"),
    "directory": (make_directory, r"kmsg.*is a directory"),
    "larger-than-any-kernel-log": (_too_large, r"kmsg.*more than the kernel's largest log"),
    "symlink-out-of-the-root": (make_link_out, r"kmsg"),
    "symlink-loop": (make_loop, r"kmsg.*too many levels of symbolic links"),
    "absent": (make_absent, r"kmsg'?: does not exist: under --root the watch reads the node's "
                        r"kernel log"),
}


@pytest.mark.parametrize("make,pattern", REFUSED.values(), ids=list(REFUSED))
def test_what_is_not_a_kernel_log_is_refused_once_without_waiting(
        cli: Cli, root: Path, make: object, pattern: str) -> None:
    make(root / "dev/kmsg")  # type: ignore[operator]
    for dry_run in ([], ["--dry-run"]):
        check_refusal(cli, root, ["--root", str(root), "watch", "--once", *dry_run], 1, pattern)


READ_PAST = {
    "binary-garbage": os.urandom(1 << 20).replace(b"\n", b" ") + b"\n" + XID_79,
    "nul-bytes": b"\0" * (1 << 20) + b"\n" + XID_79,
    "five-mib-of-lines": b"6,1,1,-;usb 1-1: new device\n" * 200_000 + XID_79,
    "an-xid-flood-of-one-code": b"".join(
        b"4,%d,%d,-;NVRM: Xid (PCI:0001:00:00): 94, Contained ECC error.\n" % (n, n)
        for n in range(1, 50_000)) + XID_79,
    "a-record-line-of-a-mebibyte": b"4,1,1,-;NVRM: " + b"x" * (1 << 20) + b"\n" + XID_79,
}


@pytest.mark.parametrize("data", READ_PAST.values(), ids=list(READ_PAST))
def test_garbage_and_floods_are_read_past_and_the_xid_found(
        cli: Cli, root: Path, data: bytes) -> None:
    (root / "dev/kmsg").write_bytes(data)
    result = cli("--root", str(root), "watch", "--once", "--dry-run")
    assert result.code == 0, result.err
    lines = [json.loads(line) for line in result.out.splitlines()]
    assert lines[0]["reason"] == "GPUFellOffBus"
    assert len(lines) <= 2  # the condition, and at most one Event however many lines


DAMAGED_STATE = {
    "not-json": b"{",
    "wrong-schema": b'{"schema_version": 7}',
    "wrong-types": b'{"schema_version": 1, "boot_id": 3, "last_seq": "x"}',
    "finding-not-an-object": b'{"schema_version": 1, "boot_id": "", "last_seq": 1, "fatal": [1]}',
    "events-not-pairs": b'{"schema_version": 1, "boot_id": "", "last_seq": 1, "events": {"a": 1}}',
    "not-utf8": b'\xff\xfe{"schema_version": 1}',
}


@pytest.mark.parametrize("data", DAMAGED_STATE.values(), ids=list(DAMAGED_STATE))
def test_a_damaged_state_is_warned_about_and_everything_reported_again(
        cli: Cli, root: Path, data: bytes) -> None:
    (root / "dev/kmsg").write_bytes(XID_79)
    (root / "run/gpunode/watch.json").write_bytes(data)
    result = cli("--root", str(root), "watch", "--once", "--dry-run")
    assert result.code == 0, result.err
    assert [json.loads(line)["reason"] for line in result.out.splitlines()] == ["GPUFellOffBus"]
    warnings = [e for e in map(json.loads, result.err.splitlines())
                if e["event"] == "watch.state_unusable"]
    assert len(warnings) == 1 and "watch.json" in str(warnings[0]["error"])


def test_a_fifo_as_the_state_file_is_never_waited_on(cli: Cli, root: Path) -> None:
    (root / "dev/kmsg").write_bytes(XID_79)
    os.mkfifo(root / "run/gpunode/watch.json")
    result = cli("--root", str(root), "watch", "--once", "--dry-run")
    assert result.code == 0 and "is a FIFO" in result.err


def test_a_damaged_boot_record_is_warned_about_and_the_xid_still_reported(
        cli: Cli, root: Path) -> None:
    (root / "dev/kmsg").write_bytes(XID_79)
    (root / "run/gpunode/state.json").write_bytes(b"[1, 2")
    result = cli("--root", str(root), "watch", "--once", "--dry-run")
    assert result.code == 0
    assert "watch.boot_record_unusable" in result.err and "GPUFellOffBus" in result.out
