"""The one boundary through which gpunode reads and writes the host's files.

Every path is an absolute *host* path ("/sys/bus/pci/devices"); the Host maps it under its root.
Under a root other than "/", symlinks are resolved the way the node itself would see them:
absolute targets are re-rooted, and a relative target that climbs above the root is refused,
so a fixture tree or a mounted node image can never make gpunode touch the machine it runs on.

Every read goes through platform/safeio.py (regular files only, non-blocking, capped); links
and device nodes are made under unique temporary names and renamed into place, so concurrent
commands never trip over each other's temporaries. Every failure is one HostError,
'Failed to <op> '<path>': <reason>', never a bare OSError. Locks (locks.py) and the kernel's own
files (kernelio.py) are done beside it, through its mapping; the file operations below it are in
files.py.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

from gpunode.errors import HostError
from gpunode.platform import files, kernelio, locks, safeio
from gpunode.platform.files import HostDir, plain_path

if TYPE_CHECKING:
    from pathlib import Path

_MAX_SYMLINKS = 40  # the kernel's own limit (MAXSYMLINKS)
# Files the kernel writes: their text is read with replacement, never refused for its bytes.
_KERNEL_PREFIXES = ("/proc/", "/sys/")
# The node's runtime state (the boot record, the CDI spec): emptied at every boot, a tmpfs on
# any systemd host. A file there does not outlive a crash, so it is not fsynced.
VOLATILE = ("/run/", "/var/run/")
CHUNK = 1 << 20  # streamed reads and writes (downloads, images, digests of modules)
_GLOB_MAGIC = "*?[\\"


@dataclass(frozen=True)
class Host:
    """The host's files under one root: "/" on a live node, or a fixture tree or mounted image."""

    root: str | os.PathLike[str] = "/"  # as given (a test's fixture tree is a Path)
    _resolved: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    _root: str = field(init=False, compare=False, repr=False)  # the root as a string

    def __post_init__(self) -> None:
        object.__setattr__(self, "_root", os.fspath(self.root))

    @property
    def is_live(self) -> bool:
        return self._root == "/"

    def display(self, path: str) -> str:
        """The path as the user should read it in messages: under the root they chose."""
        return path if self._root == "/" else self._root + path

    def path(self, path: str) -> Path:
        """The real filesystem path of a host path, symlinks resolved inside the root."""
        from pathlib import Path

        return Path(self._real(path))

    def real(self, path: str) -> str:
        """path() as a string, for an open() or a program's argument."""
        return plain_path(self._real(path))

    def _real(self, path: str) -> str:
        if not path.startswith("/"):
            raise HostError("resolve", path, "host paths must be absolute")
        if "\0" in path:  # the OS refuses it with a ValueError, not an OSError
            raise HostError("resolve", self.display(path.replace("\0", "\\0")),
                            "a path cannot contain a NUL byte")
        return path if self._root == "/" else self._resolve_in_root(path)

    def _resolve_in_root(self, path: str) -> str:
        shown = self.display(path)
        resolved = self._resolve(files.normalize("/", path, shown), 0, shown)
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
                raise HostError("resolve", shown, files.reason(exc)) from exc
            resolved = candidate
        else:
            if links >= _MAX_SYMLINKS:
                raise HostError("resolve", shown, "too many levels of symbolic links")
            base = "/" if target.startswith("/") else real_parent
            resolved = self._resolve(files.normalize(base, target, shown), links + 1, shown)
        # Remembered for this Host's lifetime (one command); symlink() forgets it all, and
        # nothing else gpunode does changes what a name resolves to.
        self._resolved.setdefault(path, resolved)
        return resolved

    # -- reads -------------------------------------------------------------------------------
    # Every read goes through gpunode.platform.safeio: regular files only (a FIFO, socket, device or
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

    def read_chunks(self, path: str, size: int = CHUNK) -> Iterator[bytes]:
        """The regular file's bytes in chunks of `size`, for files too large to hold (downloads,
        images). Like every read it refuses a FIFO, device or directory; nothing is opened
        until the first chunk is asked for, and the file is closed when the chunks end."""
        fd = self._open_regular(path)
        try:
            while True:
                try:
                    chunk = os.read(fd, size)
                except OSError as exc:
                    raise HostError("read", self.display(path), files.reason(exc)) from exc
                if not chunk:
                    return
                yield chunk
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def open_file(self, path: str) -> Iterator[BinaryIO]:
        """The regular file for reads at any offset (a library's ELF headers, not the rest),
        closed when the block ends; refused as read_chunks refuses."""
        with os.fdopen(self._open_regular(path), "rb") as handle:
            yield handle

    def _open_regular(self, path: str) -> int:
        try:
            return safeio.open_regular(self._real(path))[0]
        except safeio.Refused as exc:
            raise HostError("read", self.display(path), str(exc)) from None
        except OSError as exc:
            raise HostError("read", self.display(path), files.reason(exc, True)) from exc

    def digest(self, path: str, algorithm: str = "sha256") -> str:
        """The hex digest ("sha256", "sha512") of a regular file's content, read in chunks."""
        import hashlib  # only the driver cache hashes files

        try:
            hasher = hashlib.new(algorithm)
        except ValueError as exc:
            raise HostError("hash", self.display(path), str(exc)) from None
        for chunk in self.read_chunks(path):
            hasher.update(chunk)
        return hasher.hexdigest()

    def open_nonblocking(self, path: str, op: str) -> int:
        """A read-only descriptor that never waits (a FIFO, a tty) and never leaks to children;
        HostError 'Failed to <op> ...' when it cannot be had."""
        try:
            return os.open(self._real(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC |
                           os.O_NOCTTY)
        except OSError as exc:
            raise HostError(op, self.display(path), files.reason(exc, followed=True)) from exc

    def read_records(self, path: str, limit: int = safeio.DEFAULT_LIMIT) -> list[str]:
        """The records of /dev/kmsg so far, or the lines of a file in its place (kernelio)."""
        return kernelio.read_records(self, path, limit)

    def open_records(self, path: str) -> tuple[int, str]:
        """A descriptor following /dev/kmsg (or a FIFO or file in its place) and its kind."""
        return kernelio.open_records(self, path)

    def glob(self, pattern: str, match: Callable[[str, str], bool] | None = None) -> list[str]:
        """The existing host paths an absolute pattern names, under the root (never the machine's
        own /). A component with * ? [ or \\ is matched against its directory's entries by
        `match(part, name)` (default fnmatch.fnmatchcase; Go's filepath.Match for containerd's
        imports), the others are taken as they are; a name starting with '.' matches like any
        other. Matches are in order of the pattern's components, each directory's sorted."""
        if not pattern.startswith("/"):
            raise HostError("glob", pattern, "host paths must be absolute")
        matches, match = [""], match or (lambda part, name: fnmatch.fnmatchcase(name, part))
        for part in pattern.strip("/").split("/"):
            if not any(c in part for c in _GLOB_MAGIC):
                matches = [f"{m}/{part}" for m in matches]
                continue
            matches = [f"{m}/{name}" for m in matches for name in self.list_dir(m or "/")
                       if match(part, name)]
        return [m or "/" for m in matches if self.lstat(m or "/") is not None]

    def _read(self, path: str, limit: int, missing_ok: bool) -> bytes | None:
        try:
            return safeio.read(self._real(path), limit)
        except (FileNotFoundError, NotADirectoryError) as exc:
            if missing_ok:
                return None
            raise HostError("read", self.display(path), files.reason(exc)) from exc
        except safeio.Refused as exc:
            raise HostError("read", self.display(path), str(exc)) from None
        except OSError as exc:
            raise HostError("read", self.display(path), files.reason(exc, followed=True)) from exc

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
        try:
            return os.readlink(self.entry(path))
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
                return None
            raise HostError("read link", self.display(path), files.reason(exc)) from exc

    def list_dir(self, path: str) -> list[str]:
        """Sorted entry names; an absent directory is empty."""
        try:
            return sorted(os.listdir(self.real(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise HostError("list", self.display(path), files.reason(exc)) from exc

    def stat(self, path: str) -> os.stat_result | None:
        """stat() following links inside the root; None when absent."""
        try:
            return os.stat(self.real(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise HostError("stat", self.display(path), files.reason(exc)) from exc

    def directory(self, path: str) -> HostDir:
        """A directory resolved once, for reading many of its entries cheaply (sysfs devices)."""
        return HostDir(self._real(path) + "/", self.display(path))

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def is_executable_file(self, path: str) -> bool:
        st = self.stat(path)
        return st is not None and stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)

    # -- writes ------------------------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes | Iterable[bytes], mode: int = 0o644,
                     attrs: tuple[int, int, int] | None = None,
                     make_parents: bool = False, durable: bool | None = None) -> None:
        """Replace the file's content all at once, or not at all.

        The new bytes go to a temporary file in the same directory, are fsynced, renamed over the
        target and the directory is fsynced, so a crash leaves either the old or the new file.
        Under /run (VOLATILE), which no crash outlives, the replacement is as atomic but not
        fsynced.
        An existing file keeps its mode and owner; `mode` applies to a new file only. `attrs`
        (mode, uid, gid) gives the file exactly those, new or not: a backup or copy made from
        another file keeps that file's. A file with several hard links is refused: the rename
        would silently split it from its other names. `data` may be chunks (a download, an
        unpacked image): an exception the chunks raise passes through unchanged, and the
        temporary file is removed. `make_parents` creates missing parent directories (0755).
        `durable` False: as atomic, not fsynced, for a file rewritten every few seconds anyway
        (the metrics' textfile); None: fsynced unless under /run.
        """
        shown = self.display(path)
        if durable is None:
            durable = not os.path.normpath(path).startswith(VOLATILE)  # not /run/../etc/x
        if make_parents:
            self.make_dirs(path.rstrip("/").rpartition("/")[0] or "/")
        target = self.real(path)
        try:
            current = os.stat(target)
        except FileNotFoundError:
            current = None
        except OSError as exc:
            raise HostError("write", shown, files.reason(exc)) from exc
        if current is not None and not stat.S_ISREG(current.st_mode):
            raise HostError("write", shown, safeio.kind(current.st_mode))
        if current is not None and current.st_nlink > 1:
            raise HostError("write", shown, f"it has {current.st_nlink} hard links, and replacing "
                            "it would split them (the other names would keep the old content)")
        if attrs is None and current is not None:
            attrs = (current.st_mode, current.st_uid, current.st_gid)
        try:
            fd, tmp = files.make_temp(target)
        except OSError as exc:
            raise HostError("write", shown, files.reason(exc)) from exc
        out = os.fdopen(fd, "wb")
        # Each call below turns its own OSError into the HostError; an error of the chunks
        # (a stalled download is a TimeoutError, an OSError too) passes through as it is.
        try:
            for chunk in [data] if isinstance(data, bytes | bytearray) else data:
                files.write_chunk(out, chunk, shown)
            try:
                out.flush()
                if attrs is not None:
                    os.fchmod(out.fileno(), stat.S_IMODE(attrs[0]))
                    os.fchown(out.fileno(), attrs[1], attrs[2])
                else:
                    os.fchmod(out.fileno(), mode)
                if durable:
                    os.fsync(out.fileno())
                out.close()
                os.rename(tmp, target)
            except OSError as exc:
                raise HostError("write", shown, files.reason(exc)) from exc
        except BaseException:
            with contextlib.suppress(OSError):
                out.close()
            files.unlink_quietly(tmp)
            raise
        finally:
            close = getattr(data, "close", None)  # a generator of chunks: its source closes now
            if close is not None:
                close()
        if durable:
            files.fsync_dir(os.path.dirname(target), "write", shown)

    def write_attribute(self, path: str, data: bytes) -> None:
        """Write a sysfs attribute in place, in one write; never create it (kernelio)."""
        kernelio.write_attribute(self, path, data)

    def lstat(self, path: str) -> os.stat_result | None:
        """lstat() of the entry itself (a final symlink is not followed); None when absent."""
        try:
            return os.lstat(self.entry(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise HostError("stat", self.display(path), files.reason(exc)) from exc

    def entry(self, path: str) -> str:
        """The real path of a directory entry itself: its parent resolved, not the entry."""
        parent, _, name = path.rstrip("/").rpartition("/")
        if "\0" in name:  # the parent is checked by path(); the OS raises ValueError
            raise HostError("resolve", self.display(path.replace("\0", "\\0")),
                            "a path cannot contain a NUL byte")
        return os.path.join(self.real(parent or "/"), name)

    def make_char_device(self, path: str, major: int, minor: int, mode: int) -> None:
        """Make a character device node with exactly `mode`, renamed into place (kernelio)."""
        kernelio.make_char_device(self, path, major, minor, mode)

    def symlink(self, path: str, target: str) -> None:
        """Point `path` at `target` (replacing a link or file there) in one rename; the link is
        made under a unique temporary name, so concurrent callers never collide."""
        link = self.entry(path)
        try:
            os.makedirs(os.path.dirname(link), exist_ok=True)
            temp = files.make_unique(link, lambda t: os.symlink(target, t))
            try:
                os.rename(temp, link)
            except OSError:
                files.unlink_quietly(temp)
                raise
        except OSError as exc:
            raise HostError("link", self.display(path), files.reason(exc)) from exc
        self._resolved.clear()  # a name may now resolve elsewhere

    def remove(self, path: str) -> None:
        """Remove a file (a symlink itself, not its target); one already gone is fine."""
        entry = self.entry(path)
        directory = os.path.dirname(entry)
        try:
            os.unlink(entry)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise HostError("remove", self.display(path), files.reason(exc)) from exc
        files.fsync_dir(directory, "remove", self.display(path))

    def remove_dir(self, path: str) -> bool:
        """Remove an empty directory; False (and nothing done) when it is absent or not empty."""
        entry = self.entry(path)
        try:
            os.rmdir(entry)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise HostError("remove directory", self.display(path), files.reason(exc)) from exc
        files.fsync_dir(os.path.dirname(entry), "remove directory", self.display(path))
        return True

    def rename(self, source: str, target: str) -> None:
        """Move an entry (a final symlink itself, not what it points at) to `target` in one
        rename(2), replacing a file or an empty directory there; then both parents are fsynced,
        so the move is atomic and durable."""
        real_source, real_target = self.entry(source), self.entry(target)
        shown = f"{self.display(source)} to {self.display(target)}"
        try:
            os.rename(real_source, real_target)
        except OSError as exc:
            raise HostError("rename", shown, files.reason(exc)) from exc
        self._resolved.clear()  # names under the source now resolve elsewhere
        files.fsync_dir(os.path.dirname(real_target), "rename", shown)
        if os.path.dirname(real_source) != os.path.dirname(real_target):
            files.fsync_dir(os.path.dirname(real_source), "rename", shown)

    def remove_tree(self, path: str) -> None:
        """Remove an entry and, when it is a directory, everything in it: links are removed,
        never followed (a final symlink too). One already gone is fine."""
        entry = self.entry(path)
        shown = self.display(path)
        try:
            st = os.lstat(entry)
            if stat.S_ISDIR(st.st_mode):
                import shutil  # only the driver cache removes trees

                shutil.rmtree(entry)
            else:
                os.unlink(entry)
        except (FileNotFoundError, NotADirectoryError) as exc:
            if exc.filename not in (None, entry):  # something inside, not the entry
                raise HostError("remove", shown, f"{files.reason(exc)} ({exc.filename})") from exc
            return
        except OSError as exc:
            inside = f" ({exc.filename})" if exc.filename not in (None, entry) else ""
            raise HostError("remove", shown, files.reason(exc) + inside) from exc
        self._resolved.clear()
        files.fsync_dir(os.path.dirname(entry), "remove", shown)

    def fsync(self, path: str) -> None:
        """Flush a file's or a directory's data to the disk (before a rename publishes it)."""
        shown = self.display(path)
        fd = self.open_nonblocking(path, "sync")
        try:
            os.fsync(fd)
        except OSError as exc:
            raise HostError("sync", shown, files.reason(exc)) from exc
        finally:
            os.close(fd)

    def connect(self, path: str) -> None:
        """Connect to the Unix socket at `path` and hang up: whether anything listens."""
        kernelio.connect(self, path)

    def lock(self, path: str, wait: float | None = None,
             on_wait: Callable[[str], None] | None = None,
             mode: int = 0o600) -> contextlib.AbstractContextManager[locks.LockFile]:
        """locks.lock: an exclusive flock(2) of `path` held for a with-block."""
        return locks.lock(self, path, wait, on_wait, mode)

    def lock_holder(self, path: str) -> str | None:
        """locks.holder: the note of whoever holds the flock of `path` now, or None."""
        return locks.holder(self, path)

    def make_dirs(self, path: str, mode: int = 0o755) -> None:
        try:
            os.makedirs(self.real(path), mode=mode, exist_ok=True)
        except OSError as exc:
            raise HostError("create directory", self.display(path), files.reason(exc)) from exc
