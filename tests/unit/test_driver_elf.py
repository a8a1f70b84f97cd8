"""A library's class and DT_SONAME as gpunode reads them (gpunode/driver/elf.py, pyelftools):
every broken or hostile file refused with one reason.

Against binutils' readelf, on the fixture's stand-ins and NVIDIA's real libraries:
tests/integration/test_real_driver_cdi.py.
"""

from __future__ import annotations

import io
import random
import struct
import time

import pytest

from gpunode.driver import elf
from gpunode_testing.driver_files import elf_library


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt):]


GOOD = elf_library("libcuda.so.1")
DYNAMIC_AT = 64 + 2 * 56  # where elf_library puts the dynamic table
CASES = {
    "empty": (b"", r"is not an ELF shared library"),
    "text": (b"#!/bin/sh\n", r"is not an ELF shared library"),
    "truncated-header": (GOOD[:40], r"is not a readable ELF shared library"),
    "truncated-program-headers": (GOOD[:100], r"is not a readable ELF shared library"),
    "an-executable": (_patched(GOOD, 16, "<H", 2), r"type ET_EXEC, not a shared library"),
    "program-headers-past-the-end": (_patched(GOOD, 32, "<Q", 1 << 40),
                                     r"is not a readable ELF shared library"),
    "program-headers-at-a-negative-offset": (_patched(GOOD, 32, "<Q", 1 << 63),
                                             r"is not a readable ELF shared library"),
    "65534-program-headers": (_patched(GOOD, 56, "<H", 65534), r"65534 program headers"),
    "65534-sections": (_patched(_patched(GOOD, 40, "<Q", 64), 60, "<H", 65534),
                       r"65534 sections"),
    "a-soname-outside-the-file": (_patched(GOOD, DYNAMIC_AT + 32 + 8, "<Q", 1 << 40),
                                  r"names the SONAME '', which is no file name"),
    "a-dynamic-table-without-its-string-table": (
        _patched(GOOD, DYNAMIC_AT, "<q", 0x6FFFFFF0), r"is not a readable ELF shared library"),
    "a-string-table-outside-every-segment": (
        _patched(GOOD, DYNAMIC_AT + 8, "<Q", 1 << 40), r"is not a readable ELF shared library"),
    "a-soname-path": (elf_library("../../lib/libc.so.6"), r"no plain file name"),
    "a-soname-not-utf8": (elf_library("libcuda.so.1").replace(b"libcuda", b"lib\xffuda"),
                          r"is not a readable ELF shared library"),
    "a-soname-of-64-kib": (elf_library("l" * 65536), r"longer than 255 bytes"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_broken_or_hostile_file_is_one_refusal_with_its_reason(
        case: tuple[bytes, str]) -> None:
    data, reason = case
    with pytest.raises(elf.NotALibrary, match=reason):
        elf.read(io.BytesIO(data))


def test_a_32_bit_library_is_told_apart_without_being_parsed() -> None:
    assert elf.read(io.BytesIO(b"\x7fELF\x01\x01\x01")) == elf.Library(32, None)


def test_a_string_without_its_end_is_not_read_to_the_end_of_a_huge_file() -> None:
    """A SONAME whose NUL never comes, in 64 MiB of file: refused after a few MiB, quickly."""
    head = GOOD[:-1]  # the SONAME's NUL gone; then 64 MiB of 'x'
    stream = io.BytesIO(head + b"x" * (64 << 20))
    started = time.monotonic()
    with pytest.raises(elf.NotALibrary, match=r"more than 4 MiB"):
        elf.read(stream)
    assert time.monotonic() - started < 5


def test_no_mutation_of_a_librarys_headers_gives_anything_but_a_library_or_a_refusal() -> None:
    """2000 stand-ins with up to 8 bytes changed at random (a fixed seed): each is read as a
    library or refused as NotALibrary, never another exception."""
    rng = random.Random(35)
    outcomes = set()
    for _ in range(2000):
        data = bytearray(GOOD)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            elf.read(io.BytesIO(bytes(data)))
            outcomes.add("read")
        except elf.NotALibrary:
            outcomes.add("refused")
    assert outcomes == {"read", "refused"}
