"""The file operations the Host is made of, below its path mapping: unique temporary names
beside a file, a directory's fsync, an OSError worded as the message a HostError carries, path
normalization, and a sysfs directory read entry by entry (HostDir)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from gpunode.errors import HostError
from gpunode.platform import safeio
from gpunode.platform.nodepaths import TEMP_SUFFIX

ATTRIBUTE_LIMIT = 1 << 16  # a sysfs attribute is at most a page; 64 KiB leaves room


class HostPaths(Protocol):
    """What locks.py and kernelio.py ask of the Host: its mapping of host paths under the root."""

    def display(self, path: str) -> str: ...

    def real(self, path: str) -> str: ...

    def entry(self, path: str) -> str: ...

    def open_nonblocking(self, path: str, op: str) -> int: ...

    def stat(self, path: str) -> os.stat_result | None: ...

    def make_dirs(self, path: str, mode: int = 0o755) -> None: ...


def plain_path(path: str) -> str:
    """An absolute `path` as pathlib spells it, as a string: no empty or "."
    components, no trailing slash (a leading "//" too is "/", as Linux reads it)."""
    if "//" not in path and "/." not in path and not path.endswith("/"):
        return path
    return "/" + "/".join(name for name in path.split("/") if name not in ("", "."))


def normalize(base: str, path: str, shown: str) -> str:
    """`path` (absolute, or relative to the host directory `base`) with . and .. applied."""
    parts: list[str] = [] if path.startswith("/") else [c for c in base.split("/") if c]
    for name in path.split("/"):
        if name in ("", "."):
            continue
        if name == "..":
            if not parts:
                raise HostError("resolve", shown, "a symlink climbs above the root")
            parts.pop()
        else:
            parts.append(name)
    return "/" + "/".join(parts)


@dataclass(frozen=True)
class HostDir:
    """A resolved directory; its entries are read without following a final symlink."""

    real: str  # with a trailing slash
    shown: str

    def read(self, name: str) -> str | None:
        """The entry's text, stripped; None when it does not exist. A final symlink, FIFO,
        directory or other non-regular entry is refused (gpunode.platform.safeio)."""
        try:
            data = safeio.read(self.real + name, ATTRIBUTE_LIMIT, follow=False)
        except ValueError:  # a NUL byte in the name
            raise HostError("read", f"{self.shown}/{name!r}", "a path cannot contain a NUL "
                            "byte") from None
        except FileNotFoundError:
            return None
        except safeio.Refused as exc:
            raise HostError("read", f"{self.shown}/{name}", str(exc)) from None
        except OSError as exc:
            raise HostError("read", f"{self.shown}/{name}", reason(exc)) from exc
        return data.decode("utf-8", errors="replace").strip()

    def read_link(self, name: str) -> str | None:
        try:
            return os.readlink(self.real + name)
        except ValueError:  # a NUL byte in the name
            raise HostError("read link", f"{self.shown}/{name!r}", "a path cannot contain a "
                            "NUL byte") from None
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):
                return None
            raise HostError("read link", f"{self.shown}/{name}", reason(exc)) from exc


def write_chunk(out: BinaryIO, chunk: bytes, shown: str) -> None:
    try:
        out.write(chunk)
    except OSError as exc:
        raise HostError("write", shown, reason(exc)) from exc


def make_temp(beside: str) -> tuple[int, str]:
    """A new private file ".<name>.<random>.gpunode-tmp" next to `beside`, open for writing."""
    fds: list[int] = []
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    temp = make_unique(beside, lambda t: fds.append(os.open(t, flags, 0o600)))
    return fds[0], temp


def reason(exc: OSError, followed: bool = False) -> str:
    """The OSError as a message; ELOOP means a refused final symlink unless links were
    being followed (then it is a loop)."""
    if exc.errno == errno.ELOOP:
        return "too many levels of symbolic links" if followed else \
            "is a symlink where a file was expected"
    if exc.errno == errno.ENXIO:  # opening a socket
        return safeio.kind(stat.S_IFSOCK)
    return exc.strerror or str(exc)


def make_unique(beside: str, make: Callable[[str], None]) -> str:
    """Create an entry with make(name) under a fresh ".<name>.<random>.gpunode-tmp" next to
    `beside` (the way mkstemp picks names), and return that name."""
    for _ in range(100):
        directory, _, name = beside.rpartition("/")
        temp = f"{directory}/.{name}.{os.urandom(6).hex()}{TEMP_SUFFIX}"
        try:
            make(temp)
        except FileExistsError:
            continue
        return temp
    raise FileExistsError(errno.EEXIST, "no unused temporary name", beside)


def unlink_quietly(path: str) -> None:
    # The temp file is ours and the write already failed; the original error is what matters.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_dir(directory: str, op: str, shown: str) -> None:
    """fsync(2) a directory after an entry in it changed; a failure is the change's HostError
    (the entry may be in place, but it is not known to be on the disk)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise HostError(op, shown, f"{reason(exc)} (syncing its directory)") from exc
