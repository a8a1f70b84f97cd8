"""The one way gpunode reads a file: regular files only, never blocking, never unbounded.

A FIFO, socket, device or directory where a file is expected would block the open (a FIFO
waits for a writer: `boot` would hold the node for its unit's timeout), have side effects (a
device's driver runs on open) or fail obscurely; a file of gigabytes would exhaust memory.
So every read:

- looks at the entry first (stat), and refuses anything but a regular file, naming what it is;
- opens it with O_NONBLOCK (a FIFO swapped in after the stat still cannot block the open) and
  checks the opened file again (fstat);
- reads until EOF, but never more than a cap: files in /proc and /sys report size 0 (or 4096)
  whatever they hold, so the size is only a first check.

`Host` (host.py) maps host paths under its root and turns `Refused` into a HostError.
"""

from __future__ import annotations

import errno
import os
import stat

MIB = 1 << 20
DEFAULT_LIMIT = 16 * MIB  # well above any config, record or pci.ids gpunode reads
_CHUNK = 1 << 16

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISLNK, "a symlink"))


class Refused(Exception):
    """The path exists but is not something gpunode will read; str() says why."""


def kind(mode: int) -> str:
    """Why a non-regular entry is refused, for messages: "is a FIFO, not a regular file"."""
    name = next((name for test, name in _KINDS if test(mode)), None)
    return "is not a regular file" if name is None else f"is {name}, not a regular file"


def read(real: str, limit: int = DEFAULT_LIMIT, follow: bool = True) -> bytes:
    """The bytes of the regular file at the real path `real`.

    Raises Refused for a non-regular file or one over `limit` bytes, and OSError (with the
    errno: FileNotFoundError, NotADirectoryError, …) when it cannot be opened or read.
    `follow=False` refuses a final symlink (ELOOP) instead of following it.
    """
    fd, st = open_regular(real, follow)
    try:
        if st.st_size > limit:
            raise Refused(too_large(limit))
        chunks: list[bytes] = []
        total = 0
        # A regular file's size is known: all of it in one read, and on to the end in case it
        # grew.
        size = max(_CHUNK, st.st_size + 1)
        while True:
            chunk = os.read(fd, size)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise Refused(too_large(limit))
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_regular(real: str, follow: bool = True) -> tuple[int, os.stat_result]:
    """A read-only descriptor (and its fstat) of the regular file at the real path `real`
    (non-blocking, close-on-exec): for read(), and for streamed reads (Host.read_chunks).

    Raises Refused for anything but a regular file and OSError when it cannot be opened;
    `follow=False` refuses a final symlink (ELOOP) instead of following it.
    """
    st = os.stat(real, follow_symlinks=follow)
    if not stat.S_ISREG(st.st_mode):
        if not follow and stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "is a symlink where a file was expected", real)
        raise Refused(kind(st.st_mode))
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    fd = os.open(real, flags if follow else flags | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):  # swapped between the stat and the open
        os.close(fd)
        raise Refused(kind(st.st_mode))
    return fd, st


def too_large(limit: int) -> str:
    if limit >= MIB and limit % MIB == 0:
        return f"is larger than {limit // MIB} MiB"
    return f"is larger than {limit} bytes"


def decode(data: bytes) -> str:
    """UTF-8 text; raises Refused naming the line and byte offset of the first invalid byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise Refused(f"is not UTF-8 text (invalid byte 0x{data[exc.start]:02x} at line {line}, "
                      f"byte offset {exc.start})") from None

