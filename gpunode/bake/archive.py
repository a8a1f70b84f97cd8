"""A prebuilt module set's tar archive, checked member by member as it is unpacked.

The archive (already verified against its pinned sha512) is read once, as a stream, through
the Host; each member is checked before a byte of it is written: a relative name of plain
path components (no absolute name, no `..`, nothing that is not printable), a regular file
or a directory (a symlink, a hard link, a device or a FIFO is refused: the set is files), a
file no larger than any driver file (cache.MAX_FILE_BYTES), all of them together within
MAX_TOTAL_BYTES and MAX_MEMBERS, no name twice, no file where a directory must be. The
members go into a staging directory the caller names (beside the place of the set) and that
the caller renames into place; a refusal names the member, and the caller removes the
staging directory, so nothing of a refused archive stays. The archive may be compressed as
Python's tarfile reads it (gzip, bzip2, xz).
"""

from __future__ import annotations

import hashlib
import io
import lzma
import re
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any

from gpunode.driver.cache import MAX_FILE_BYTES
from gpunode.errors import BakeArchiveError
from gpunode.platform.host import CHUNK, Host

MAX_MEMBERS = 10_000  # a driver's modules and user-space are a few dozen files
MAX_TOTAL_BYTES = 8 << 30
_COMPONENT = re.compile(r"[A-Za-z0-9_+@%=,:~-][A-Za-z0-9._+@%=,:~-]*|\.[A-Za-z0-9_+-][\w.+-]*")


class _Chunks(io.RawIOBase):
    """The Host's chunks of a file as the file object tarfile's stream mode reads."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._rest = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._rest:
            self._rest = next(self._chunks, b"")
            if not self._rest:
                return 0
        size = min(len(buffer), len(self._rest))
        buffer[:size] = self._rest[:size]
        self._rest = self._rest[size:]
        return size


def unpack(host: Host, archive: str, directory: str, what: str, source: str) -> dict[str, str]:
    """Unpack the tar archive at the host path `archive` into the (new, empty) host directory
    `directory`; the files it holds (path relative to `directory` → sha256). BakeArchiveError
    names the member that is refused; the caller removes `directory` then."""
    files: dict[str, str] = {}
    dirs: set[str] = set()
    total = 0

    def refuse(member: str, reason: str) -> BakeArchiveError:
        return BakeArchiveError(what, source, f"member {member!r} {reason}; nothing of the "
                                "archive was placed", "build the archive from regular files "
                                "and directories only, relative names (tar -C DIR -cf …  .)")

    try:
        with tarfile.open(fileobj=_Chunks(host.read_chunks(archive)), mode="r|*") as tar:
            for count, member in enumerate(tar, 1):
                if count > MAX_MEMBERS:
                    raise refuse(member.name, f"is past the {MAX_MEMBERS}th: too many members")
                name = _name(member.name, refuse)
                if name is None:
                    continue  # "." itself
                if name in files:
                    raise refuse(member.name, "appears twice")
                if name in dirs and not member.isdir():
                    raise refuse(member.name, "is not a directory, but the archive has one "
                                 "of that name")
                parent = name.rpartition("/")[0]
                if any(p in files for p in _parents(name)):
                    raise refuse(member.name, f"is below {parent!r}, which is a file")
                if member.isdir():
                    host.make_dirs(f"{directory}/{name}")
                    dirs.update({name, *_parents(name)})
                    continue
                if member.issym() or member.islnk():
                    raise refuse(member.name, f"is a link (to {member.linkname!r}): the "
                                 "archive must hold regular files and directories only")
                if not member.isreg():
                    raise refuse(member.name, "is a device, a FIFO or another special file: "
                                 "the archive must hold regular files and directories only")
                if member.size > MAX_FILE_BYTES:
                    raise refuse(member.name, f"is {member.size} bytes, larger than any "
                                 f"driver file ({MAX_FILE_BYTES >> 20} MiB at most)")
                total += member.size
                if total > MAX_TOTAL_BYTES:
                    raise refuse(member.name, f"takes the archive past "
                                 f"{MAX_TOTAL_BYTES >> 30} GiB unpacked")
                if parent:
                    host.make_dirs(f"{directory}/{parent}")
                    dirs.update({parent, *_parents(parent)})
                hasher = hashlib.sha256()
                content = tar.extractfile(member)
                assert content is not None  # a regular file's
                host.write_atomic(f"{directory}/{name}", _hashed(content, hasher),
                                  mode=0o755 if member.mode & 0o111 else 0o644)
                files[name] = hasher.hexdigest()
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as exc:
        # The Host's own errors (a write under the root, the archive unreadable) are not these.
        raise BakeArchiveError(what, source, f"not a readable tar archive: "
                               f"{exc or type(exc).__name__}", "give a tar archive (optionally "
                               "gzip, bzip2 or xz compressed)") from None
    return files


def tree(host: Host, directory: str, prefix: str = "") -> dict[str, str] | None:
    """What an unpacked set holds now: path → sha256 of every file below `directory`; None
    when anything there is neither a regular file nor a directory."""
    found: dict[str, str] = {}
    for name in host.list_dir(directory):
        path, rel = f"{directory}/{name}", f"{prefix}{name}"
        st = host.lstat(path)
        if st is not None and stat.S_ISDIR(st.st_mode):
            below = tree(host, path, f"{rel}/")
            if below is None:
                return None
            found.update(below)
        elif st is not None and stat.S_ISREG(st.st_mode):
            found[rel] = host.digest(path, "sha256")
        else:
            return None
    return found


def _name(raw: str, refuse: Callable[[str, str], BakeArchiveError]) -> str | None:
    """The member's name relative to the set ('./lib/x' → 'lib/x'); None for '.'."""
    if raw.startswith("/"):
        raise refuse(raw, "has an absolute name")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if not parts:
        return None
    for part in parts:
        if part == "..":
            raise refuse(raw, "climbs out of the directory (..)")
        if not _COMPONENT.fullmatch(part):
            raise refuse(raw, "has a name that is not a plain file name")
    return "/".join(parts)


def _parents(name: str) -> list[str]:
    parts = name.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _hashed(content: IO[bytes], hasher: Any) -> Iterator[bytes]:
    while chunk := content.read(CHUNK):
        hasher.update(chunk)
        yield chunk
