"""Hostile inputs to `gpunode cdi generate`: what the spec is made from (the driver's GPU
information, its version file, its user-space) and where it goes (--output). Each is refused
with one clear event, the documented exit code, and every file as it was."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from hostile.support import Cli, check_refusal

GPU = "0001:00:00.0"
INFORMATION = f"proc/driver/nvidia/gpus/{GPU}/information"
VERSION = "550.127.08"


def _write(path: str, text: str | bytes) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        data = text.encode() if isinstance(text, str) else text
        (root / path).write_bytes(data)

    return write


def _remove(path: str) -> Callable[[Path], None]:
    return lambda root: (root / path).unlink()


def _fifo(path: str) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        (root / path).unlink(missing_ok=True)
        os.mkfifo(root / path)

    return make


# (what is done to a T4 with its driver loaded, the argv after `cdi generate`, exit, pattern)
CASES: dict[str, tuple[Callable[[Path], None], list[str], int, str]] = {
    "uuid-missing": (_write(INFORMATION, "Model: \t Tesla T4\nDevice Minor: \t 0\n"), [], 1,
                     r"has no 'GPU UUID' line"),
    "uuid-not-a-device-name": (
        _write(INFORMATION, "GPU UUID: \t GPU-1 /../x\nDevice Minor: \t 0\n"), [], 1,
        r"which is no CDI device name"),
    "uuid-an-index": (_write(INFORMATION, "GPU UUID: \t 0\nDevice Minor: \t 0\n"), [], 1,
                      r"which another device of the spec is named already"),
    "information-a-fifo": (_fifo(INFORMATION), [], 1, r"information"),
    "driver-not-loaded": (_remove("proc/driver/nvidia/version"), [], 1,
                          r"no CDI spec without the driver"),
    "libcuda-missing": (_remove(f"usr/lib64/libcuda.so.{VERSION}"), [], 1,
                        rf"user-space is missing: libcuda.so.{VERSION}"),
    "output-relative": (lambda root: None, ["--output", "cdi/nvidia.yaml"], 2,
                        r"--output 'cdi/nvidia.yaml': name an absolute file path"),
    "output-a-fifo": (lambda root: (root / "etc/cdi").mkdir(parents=True) or os.mkfifo(
        root / "etc/cdi/nvidia.yaml"), ["--output", "/etc/cdi/nvidia.yaml"], 2,
        r"not a regular file"),
}


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_a_bad_input_is_refused_with_one_clear_event(
    make_host: HostFactory, cli: Cli, case: str
) -> None:
    change, argv, code, pattern = CASES[case]
    root = make_host("nc4as-t4-v3", "driver").root
    change(root)
    result = check_refusal(cli, root, ["--root", str(root), "cdi", "generate", *argv], code,
                           pattern)
    assert result.out == ""
