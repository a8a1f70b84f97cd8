"""A driver library's own word on what it is: 64-bit or not, and its DT_SONAME (pyelftools).

The SONAME is the name the dynamic loader looks a library up by (`readelf -d`'s "Library
soname"), so it is the name a container must find the library under — not a rule such as
`.so.1`: libnvidia-nvvm's is `.so.4`, libnvidia-gpucomp's and libnvidia-pkcs11-openssl3's are
their full file names. The NVIDIA container toolkit reads it the same way to make its links
(internal/discover/symlinks.go, `getSoname`, with Go's debug/elf).

Why pyelftools, and not binutils' readelf: gpunode runs on Flatcar from its own system
extension, and neither Flatcar nor the extension has binutils; pyelftools is pure Python, a
well-kept library with no dependencies of its own. Only the ELF header, the program headers,
the section headers and the dynamic table are read, at their offsets, never the whole file.

A file is a driver's file, so it is trusted no further than it must be: anything pyelftools
cannot read, and anything larger than a real library's headers, is one `NotALibrary` with a
reason (never a traceback), and a SONAME that is no plain file name is refused.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

# Bounds no real library comes near (the driver's have about 10 program headers, 40 sections,
# 40 dynamic entries, and their headers are read in a few KB): past them the file is broken
# or made to keep a reader busy.
MAX_SEGMENTS = 256
MAX_SECTIONS = 4096
MAX_DYNAMIC_TAGS = 4096
MAX_READ = 4 << 20  # bytes read from one file
NAME_MAX = 255  # the longest file name (Linux's NAME_MAX): a SONAME is one


class NotALibrary(Exception):
    """The file is no ELF shared library gpunode can take; the message says why."""


@dataclass(frozen=True)
class Library:
    """What the library's ELF headers say."""

    bits: int  # 32 or 64 (EI_CLASS)
    soname: str | None  # DT_SONAME; None: the library has none


def read(stream: BinaryIO) -> Library:
    """The library's class and SONAME, read from `stream` (seekable); NotALibrary when it is
    not an ELF shared library whose headers can be read."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    head = stream.read(5)
    if head[:4] != b"\x7fELF":
        raise NotALibrary("is not an ELF shared library")
    if head[4:] == b"\x01":  # ELFCLASS32: a multilib copy, taken by nobody here; not parsed
        return Library(32, None)
    try:
        stream.seek(0)
        elf = ELFFile(_Bounded(stream))
        if elf["e_type"] != "ET_DYN":
            raise NotALibrary(f"is an ELF file of type {elf['e_type']}, not a shared library")
        return Library(elf.elfclass, _soname(elf) if elf.elfclass == 64 else None)
    except (ELFError, ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError,
            OSError, AssertionError) as exc:
        # pyelftools' own errors; what a header pointing outside the file or a string that
        # is no UTF-8 makes the stream or the decoder raise; and pyelftools' assertion that
        # a dynamic table has a string table (dynamic.py, _get_stringtable)
        raise NotALibrary(f"is not a readable ELF shared library ({_first_line(exc)})") \
            from None


def _soname(elf: ELFFile) -> str | None:
    if elf.num_segments() > MAX_SEGMENTS:
        raise NotALibrary(f"has {elf.num_segments()} program headers (a library has a few)")
    if elf.num_sections() > MAX_SECTIONS:
        raise NotALibrary(f"has {elf.num_sections()} sections (a library has a few dozen)")
    soname = None
    for segment in elf.iter_segments("PT_DYNAMIC"):
        for count, tag in enumerate(segment.iter_tags()):  # a DynamicSegment
            if count >= MAX_DYNAMIC_TAGS:
                raise NotALibrary(f"has a dynamic table of more than {MAX_DYNAMIC_TAGS} "
                                  "entries (a library has a few dozen)")
            if tag.entry.d_tag == "DT_SONAME":
                soname = str(tag.soname)
        break  # the loader reads the first PT_DYNAMIC only
    if soname is not None:
        problem = file_name_problem(soname)
        if problem:
            raise NotALibrary(f"names the SONAME {soname[:80]!r}, which {problem}")
    return soname


def file_name_problem(name: str) -> str | None:
    """Why `name` is no plain file name to mount a library under, or None."""
    if not name or name in (".", ".."):
        return "is no file name"
    if "/" in name or not name.isprintable() or not name.isascii():
        return "is no plain file name (a '/', a control or non-ASCII character)"
    if len(name.encode()) > NAME_MAX:
        return f"is longer than {NAME_MAX} bytes"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0][:200] if text else type(exc).__name__) or type(exc).__name__


class _Bounded(io.RawIOBase):
    """`stream` as pyelftools reads it, refusing to read more than MAX_READ bytes in all: a
    string without its NUL, or a table that never ends, would otherwise be read to the end of
    a file of any size."""

    def __init__(self, stream: BinaryIO) -> None:
        super().__init__()
        self._stream = stream
        self._left = MAX_READ

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._stream.seek(offset, whence)

    def tell(self) -> int:
        return self._stream.tell()

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self._left + 1  # pyelftools never asks for "the rest"; refused all the same
        if size > self._left:
            raise NotALibrary(f"needs more than {MAX_READ >> 20} MiB read to find its "
                              "SONAME (a library's headers are a few KB)")
        data = self._stream.read(size)
        self._left -= len(data)
        return data
