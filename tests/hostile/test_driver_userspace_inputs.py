"""Hostile driver user-space: what stands where libcuda should be is refused by `driver load`
with one error naming it (exit 1), never followed out of the root, never blocked on, and no
file of the node changes."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode_testing.driver_files import ELF64_LIBRARY, elf_library
from hostile.support import Cli, check_refusal

VERSION = "550.127.08"
LIBCUDA = f"usr/lib64/libcuda.so.{VERSION}"


def _replace(make: Callable[[Path], None]) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        (root / LIBCUDA).unlink()
        make(root / LIBCUDA)
    return change


def _outside(lib: Path) -> None:
    lib.symlink_to("../../../../../../../../../../../../etc/passwd")


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "libcuda-missing": (_replace(lambda lib: None), r"user-space is missing.*but not libcuda"),
    "libcuda-a-fifo": (_replace(os.mkfifo), r"libcuda\.so\.550\.127\.08 is refused: .*FIFO"),
    "libcuda-a-directory": (_replace(os.mkdir), r"libcuda\.so\.550\.127\.08 is refused"),
    "libcuda-links-out-of-the-root": (_replace(_outside), r"climbs above the root"),
    "libcuda-32-bit": (_replace(lambda lib: lib.write_bytes(b"\x7fELF\x01\x01\x01")),
                       r"is a 32-bit library"),
    "libcuda-not-elf": (_replace(lambda lib: lib.write_text("not a library\n")),
                        r"is not an ELF shared library"),
    "libcuda-a-truncated-elf": (_replace(lambda lib: lib.write_bytes(ELF64_LIBRARY[:40])),
                                r"libcuda\.so\.550\.127\.08 is not a readable ELF shared library"),
    "libcuda-naming-libc-as-its-soname": (
        _replace(lambda lib: lib.write_bytes(elf_library("libc.so.6"))),
        r"names the SONAME 'libc\.so\.6', not one of libcuda's"),
    "libcuda-naming-a-path-as-its-soname": (
        _replace(lambda lib: lib.write_bytes(elf_library("../../../etc/ld.so.preload"))),
        r"names the SONAME '\.\./\.\./\.\./etc/ld\.so\.preload', which is no plain file name"),
    "libcuda-with-65534-program-headers": (
        _replace(lambda lib: lib.write_bytes(
            ELF64_LIBRARY[:56] + struct.pack("<H", 65534) + ELF64_LIBRARY[58:])),
        r"has 65534 program headers"),
    "libcuda-of-another-version": (
        _replace(lambda lib: lib.with_name("libcuda.so.535.104.05").write_bytes(b"\x7fELF\x02")),
        r"has libcuda\.so\.535\.104\.05 \(535\.104\.05, not 550\.127\.08\)"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_driver_load_refuses_a_driver_root_without_a_usable_libcuda(
        make_host: HostFactory, cli: Cli, case: tuple[Callable[[Path], None], str]) -> None:
    change, pattern = case
    host = make_host("nc4as-t4-v3", "ready")
    change(host.root)
    check_refusal(cli, host.root, ["--root", str(host.root), "driver", "load"], 1, pattern)
