"""The one boundary through which gpunode reads and writes the host's files.

Every path is an absolute *host* path ("/sys/bus/pci/devices"); the Host maps it under its root.
Under a root other than "/", symlinks are resolved the way the node itself would see them:
absolute targets are re-rooted, and a relative target that climbs above the root is refused,
so a fixture tree or a mounted node image can never make gpunode touch the machine it runs on.

Every read goes through gpunode.safeio (regular files only, non-blocking, capped); links and
device nodes are made under unique temporary names and renamed into place, so concurrent
commands never trip over each other's temporaries.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpunode import safeio
from gpunode.errors import HostError

_MAX_SYMLINKS = 40  # the kernel's own limit (MAXSYMLINKS)
# Files the kernel writes: their text is read with replacement, never refused for its bytes.
_KERNEL_PREFIXES = ("/proc/", "/sys/")
ATTRIBUTE_LIMIT = 1 << 16  # a sysfs attribute is at most a page; 64 KiB leaves room


@dataclass(frozen=True)
class Host:
    root: Path = Path("/")
    _resolved: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # The root as a string: path handling is on the hot path of detection, pathlib is not.
    _root: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_root", str(self.root))

    @property
    def is_live(self) -> bool:
        return self._root == "/"

    def display(self, path: str) -> str:
        """The path as the user should read it in messages: under the root they chose."""
        return path if self._root == "/" else self._root + path

    def path(self, path: str) -> Path:
        """The real filesystem path of a host path, symlinks resolved inside the root."""
        return Path(self._real(path))

    def _real(self, path: str) -> str:
        if not path.startswith("/"):
            raise HostError("resolve", path, "host paths must be absolute")
        if "\0" in path:  # the OS refuses it with a ValueError, not an OSError
            raise HostError("resolve", self.display(path.replace("\0", "\\0")),
                            "a path cannot contain a NUL byte")
        return path if self._root == "/" else self._resolve_in_root(path)

    def _resolve_in_root(self, path: str) -> str:
        shown = self.display(path)
        resolved = self._resolve(_normalize("/", path, shown), 0, shown)
        return self._root + resolved if resolved != "/" else self._root

    def _resolve(self, path: str, links: int, shown: str) -> str:
        """A normalized host path → the host path it names with every symlink followed.

        Parents are resolved first and remembered: sysfs reads hundreds of paths that share
        them, and a component walk per read would cost more than the rest of detection.
        """
        if path == "/":
            return "/"
        cached = self._resolved.get(path)
        if cached is not None:
            return cached
        parent, _, name = path.rpartition("/")
        real_parent = self._resolve(parent or "/", links, shown)
        candidate = real_parent.rstrip("/") + "/" + name
        try:
            target = os.readlink(self._root + candidate)
        except OSError as exc:
            # Not a link (EINVAL) or not there yet: either way the name stands as it is.
            if exc.errno not in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
                raise HostError("resolve", shown, _reason(exc)) from exc
            resolved = candidate
        else:
            if links >= _MAX_SYMLINKS:
                raise HostError("resolve", shown, "too many levels of symbolic links")
            base = "/" if target.startswith("/") else real_parent
            resolved = self._resolve(_normalize(base, target, shown), links + 1, shown)
        # Remembered for this Host's lifetime (one command); symlink() forgets it all, and
        # nothing else gpunode does changes what a name resolves to.
        self._resolved.setdefault(path, resolved)
        return resolved

    # -- reads -------------------------------------------------------------------------------
    # Every read goes through gpunode.safeio: regular files only (a FIFO, socket, device or
    # directory is refused, naming what it is), opened non-blocking, at most `limit` bytes.

    def read_bytes(self, path: str, limit: int = safeio.DEFAULT_LIMIT) -> bytes:
        data = self._read(path, limit, missing_ok=False)
        assert data is not None
        return data

    def read_text(self, path: str, limit: int = safeio.DEFAULT_LIMIT,
                  errors: str | None = None) -> str:
        """The file's text. `errors` None: kernel files (/proc, /sys) replace bytes that are not
        UTF-8 (the kernel prints what firmware and drivers give it); every other file must be
        UTF-8, and one that is not is refused with the byte offset. "replace"/"strict" force
        either."""
        data = self._read(path, limit, missing_ok=False)
        assert data is not None
        return self._decode(path, data, errors)

    def read_optional_bytes(self, path: str, limit: int = safeio.DEFAULT_LIMIT) -> bytes | None:
        """The file's bytes, or None when nothing is there. Unlike read_optional, a symlink to
        a missing file is refused, not taken as absent: the files gpunode replaces and records
        (containerd's config, its ledger and journal) must never be mistaken for none."""
        data = self._read(path, limit, missing_ok=True)
        if data is None and self.lstat(path) is not None:
            raise HostError("read", self.display(path), "is a symlink to a file that does not "
                            "exist")
        return data

    def read_optional(self, path: str, limit: int = safeio.DEFAULT_LIMIT,
                      errors: str | None = None) -> str | None:
        """The file's text (as read_text), or None when it does not exist (other failures,
        a directory or FIFO in its place included, still raise)."""
        data = self._read(path, limit, missing_ok=True)
        return None if data is None else self._decode(path, data, errors)

    def _read(self, path: str, limit: int, missing_ok: bool) -> bytes | None:
        try:
            return safeio.read(self._real(path), limit)
        except (FileNotFoundError, NotADirectoryError) as exc:
            if missing_ok:
                return None
            raise HostError("read", self.display(path), _reason(exc)) from exc
        except safeio.Refused as exc:
            raise HostError("read", self.display(path), str(exc)) from None
        except OSError as exc:
            raise HostError("read", self.display(path), _reason(exc, followed=True)) from exc

    def _decode(self, path: str, data: bytes, errors: str | None) -> str:
        if errors is None:
            errors = "replace" if path.startswith(_KERNEL_PREFIXES) else "strict"
        if errors == "replace":
            return data.decode("utf-8", errors="replace")
        try:
            return safeio.decode(data)
        except safeio.Refused as exc:
            raise HostError("read", self.display(path), str(exc)) from None

    def read_link(self, path: str) -> str | None:
        """The target of a symlink, or None when the path is absent or not a link."""
        parent, _, name = path.rstrip("/").rpartition("/")
        try:
            return os.readlink(self.path(parent or "/") / name)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
                return None
            raise HostError("read link", self.display(path), _reason(exc)) from exc

    def list_dir(self, path: str) -> list[str]:
        """Sorted entry names; an absent directory is empty."""
        try:
            return sorted(os.listdir(self.path(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise HostError("list", self.display(path), _reason(exc)) from exc

    def stat(self, path: str) -> os.stat_result | None:
        """stat() following links inside the root; None when absent."""
        try:
            return os.stat(self.path(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise HostError("stat", self.display(path), _reason(exc)) from exc

    def directory(self, path: str) -> HostDir:
        """A directory resolved once, for reading many of its entries cheaply (sysfs devices)."""
        return HostDir(self._real(path) + "/", self.display(path))

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def is_executable_file(self, path: str) -> bool:
        st = self.stat(path)
        return st is not None and stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)

    # -- writes ------------------------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes, mode: int = 0o644,
                     attrs: tuple[int, int, int] | None = None) -> None:
        """Replace the file's content all at once, or not at all.

        The new bytes go to a temporary file in the same directory, are fsynced, renamed over the
        target and the directory is fsynced, so a crash leaves either the old or the new file.
        An existing file keeps its mode and owner; `mode` applies to a new file only. `attrs`
        (mode, uid, gid) gives the file exactly those, new or not: a backup or copy made from
        another file keeps that file's. A file with several hard links is refused: the rename
        would silently split it from its other names.
        """
        target = self.path(path)
        shown = self.display(path)
        try:
            current = os.stat(target)
        except FileNotFoundError:
            current = None
        except OSError as exc:
            raise HostError("write", shown, _reason(exc)) from exc
        if current is not None and not stat.S_ISREG(current.st_mode):
            raise HostError("write", shown, safeio.kind(current.st_mode))
        if current is not None and current.st_nlink > 1:
            raise HostError("write", shown, f"it has {current.st_nlink} hard links, and replacing "
                            "it would split them (the other names would keep the old content)")
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".gpunode-tmp",
                                       dir=target.parent)
        except OSError as exc:
            raise HostError("write", shown, _reason(exc)) from exc
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                if attrs is not None:
                    os.fchmod(out.fileno(), stat.S_IMODE(attrs[0]))
                    os.fchown(out.fileno(), attrs[1], attrs[2])
                elif current is not None:
                    os.fchmod(out.fileno(), stat.S_IMODE(current.st_mode))
                    os.fchown(out.fileno(), current.st_uid, current.st_gid)
                else:
                    os.fchmod(out.fileno(), mode)
                os.fsync(out.fileno())
            os.rename(tmp, target)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise HostError("write", shown, _reason(exc)) from exc
        _fsync_dir(target.parent)

    def lstat(self, path: str) -> os.stat_result | None:
        """lstat() of the entry itself (a final symlink is not followed); None when absent."""
        try:
            return os.lstat(self._entry(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise HostError("stat", self.display(path), _reason(exc)) from exc

    def _entry(self, path: str) -> Path:
        """The real path of a directory entry itself: its parent resolved, not the entry."""
        parent, _, name = path.rstrip("/").rpartition("/")
        return self.path(parent or "/") / name

    def make_char_device(self, path: str, major: int, minor: int, mode: int) -> None:
        """Create a character device node (replacing whatever is there) with exactly `mode`.

        The node is made under a unique temporary name and renamed over the path, so two
        commands doing this at once both succeed and the path is never missing in between.
        """
        target = self._entry(path)
        shown = self.display(path)
        try:
            device = os.makedev(major, minor)
        except (OverflowError, ValueError) as exc:
            raise HostError("create device", shown, f"{major}:{minor} is not a device number "
                            f"({exc})") from None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = _make_unique(target, lambda t: os.mknod(t, stat.S_IFCHR | mode, device))
            try:
                os.chmod(temp, mode)  # mknod applies the umask
                os.rename(temp, target)
            except OSError:
                _unlink_quietly(temp)
                raise
        except OSError as exc:
            raise HostError("create device", shown, _reason(exc)) from exc

    def symlink(self, path: str, target: str) -> None:
        """Point `path` at `target` (replacing a link or file there) in one rename; the link is
        made under a unique temporary name, so concurrent callers never collide."""
        link = self._entry(path)
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            temp = _make_unique(link, lambda t: os.symlink(target, t))
            try:
                os.rename(temp, link)
            except OSError:
                _unlink_quietly(temp)
                raise
        except OSError as exc:
            raise HostError("link", self.display(path), _reason(exc)) from exc
        self._resolved.clear()  # a name may now resolve elsewhere

    def remove(self, path: str) -> None:
        """Remove a file (a symlink itself, not its target); one already gone is fine."""
        entry = self._entry(path)
        directory = entry.parent
        try:
            os.unlink(entry)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise HostError("remove", self.display(path), _reason(exc)) from exc
        _fsync_dir(directory)

    def remove_dir(self, path: str) -> bool:
        """Remove an empty directory; False (and nothing done) when it is absent or not empty."""
        entry = self._entry(path)
        try:
            os.rmdir(entry)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise HostError("remove directory", self.display(path), _reason(exc)) from exc
        _fsync_dir(entry.parent)
        return True

    def make_dirs(self, path: str, mode: int = 0o755) -> None:
        try:
            self.path(path).mkdir(mode=mode, parents=True, exist_ok=True)
        except OSError as exc:
            raise HostError("create directory", self.display(path), _reason(exc)) from exc


def _normalize(base: str, path: str, shown: str) -> str:
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
        directory or other non-regular entry is refused (gpunode.safeio)."""
        try:
            data = safeio.read(self.real + name, ATTRIBUTE_LIMIT, follow=False)
        except FileNotFoundError:
            return None
        except safeio.Refused as exc:
            raise HostError("read", f"{self.shown}/{name}", str(exc)) from None
        except OSError as exc:
            raise HostError("read", f"{self.shown}/{name}", _reason(exc)) from exc
        return data.decode("utf-8", errors="replace").strip()

    def read_link(self, name: str) -> str | None:
        try:
            return os.readlink(self.real + name)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):
                return None
            raise HostError("read link", f"{self.shown}/{name}", _reason(exc)) from exc


def _reason(exc: OSError, followed: bool = False) -> str:
    """The OSError as a message; ELOOP means a refused final symlink unless links were
    being followed (then it is a loop)."""
    if exc.errno == errno.ELOOP:
        return "too many levels of symbolic links" if followed else \
            "is a symlink where a file was expected"
    if exc.errno == errno.ENXIO:  # opening a socket
        return safeio.kind(stat.S_IFSOCK)
    return exc.strerror or str(exc)


def _make_unique(beside: Path, make: Callable[[str], None]) -> str:
    """Create an entry with make(name) under a fresh ".<name>.<random>.gpunode-tmp" next to
    `beside` (the way mkstemp picks names), and return that name."""
    for _ in range(100):
        temp = str(beside.with_name(f".{beside.name}.{os.urandom(6).hex()}.gpunode-tmp"))
        try:
            make(temp)
        except FileExistsError:
            continue
        return temp
    raise FileExistsError(errno.EEXIST, "no unused temporary name", str(beside))


def _unlink_quietly(path: str) -> None:
    # The temp file is ours and the write already failed; the original error is what matters.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
