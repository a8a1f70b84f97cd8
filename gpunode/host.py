"""The one boundary through which gpunode reads and writes the host's files.

Every path is an absolute *host* path ("/sys/bus/pci/devices"); the Host maps it under its root.
Under a root other than "/", symlinks are resolved the way the node itself would see them:
absolute targets are re-rooted, and a relative target that climbs above the root is refused,
so a fixture tree or a mounted node image can never make gpunode touch the machine it runs on.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpunode.errors import HostError

_MAX_SYMLINKS = 40  # the kernel's own limit (MAXSYMLINKS)


@dataclass(frozen=True)
class Host:
    root: Path = Path("/")

    @property
    def is_live(self) -> bool:
        return self.root == Path("/")

    def display(self, path: str) -> str:
        """The path as the user should read it in messages: under the root they chose."""
        return path if self.is_live else str(self.root) + path

    def path(self, path: str) -> Path:
        """The real filesystem path of a host path, symlinks resolved inside the root."""
        if not path.startswith("/"):
            raise HostError("resolve", path, "host paths must be absolute")
        if self.is_live:
            return Path(path)
        return Path(self._resolve_in_root(path))

    def _resolve_in_root(self, path: str) -> str:
        root = str(self.root)
        pending = [c for c in path.split("/") if c not in ("", ".")]
        pending.reverse()
        resolved: list[str] = []
        links = 0
        while pending:
            name = pending.pop()
            if name == "..":
                if not resolved:
                    raise HostError("resolve", self.display(path), "a symlink climbs above the root")
                resolved.pop()
                continue
            real = root + "/" + "/".join([*resolved, name])
            try:
                target = os.readlink(real)
            except OSError as exc:
                # Not a link (EINVAL) or not there yet: either way the name stands as it is.
                if exc.errno not in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
                    raise HostError("resolve", self.display(path), _reason(exc)) from exc
                resolved.append(name)
                continue
            links += 1
            if links > _MAX_SYMLINKS:
                raise HostError("resolve", self.display(path), "too many levels of symbolic links")
            if target.startswith("/"):
                resolved = []
            pending.extend(reversed([c for c in target.split("/") if c not in ("", ".")]))
        return root + "/" + "/".join(resolved) if resolved else root

    # -- reads -------------------------------------------------------------------------------

    def read_text(self, path: str) -> str:
        try:
            return self.path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise HostError("read", self.display(path), _reason(exc)) from exc

    def read_bytes(self, path: str) -> bytes:
        try:
            return self.path(path).read_bytes()
        except OSError as exc:
            raise HostError("read", self.display(path), _reason(exc)) from exc

    def read_optional(self, path: str) -> str | None:
        """The file's text, or None when it does not exist (other failures still raise)."""
        try:
            return self.path(path).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        except OSError as exc:
            raise HostError("read", self.display(path), _reason(exc)) from exc

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
        return HostDir(self.path(path), self.display(path))

    def exists(self, path: str) -> bool:
        return self.stat(path) is not None

    def is_executable_file(self, path: str) -> bool:
        st = self.stat(path)
        return st is not None and stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)

    # -- writes ------------------------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Replace the file's content all at once, or not at all.

        The new bytes go to a temporary file in the same directory, are fsynced, renamed over the
        target and the directory is fsynced, so a crash leaves either the old or the new file.
        An existing file keeps its mode and owner; `mode` applies to a new file only.
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
            raise HostError("write", shown, "not a regular file")
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".gpunode-tmp",
                                       dir=target.parent)
        except OSError as exc:
            raise HostError("write", shown, _reason(exc)) from exc
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                if current is not None:
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

    def make_dirs(self, path: str, mode: int = 0o755) -> None:
        try:
            self.path(path).mkdir(mode=mode, parents=True, exist_ok=True)
        except OSError as exc:
            raise HostError("create directory", self.display(path), _reason(exc)) from exc


@dataclass(frozen=True)
class HostDir:
    """A resolved directory; its entries are read without following a final symlink."""

    real: Path
    shown: str

    def read(self, name: str) -> str | None:
        """The entry's text, stripped; None when it does not exist."""
        try:
            fd = os.open(self.real / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError("read", f"{self.shown}/{name}", _reason(exc)) from exc
        try:
            return os.read(fd, 4096).decode("utf-8", errors="replace").strip()
        except OSError as exc:
            raise HostError("read", f"{self.shown}/{name}", _reason(exc)) from exc
        finally:
            os.close(fd)

    def read_link(self, name: str) -> str | None:
        try:
            return os.readlink(self.real / name)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):
                return None
            raise HostError("read link", f"{self.shown}/{name}", _reason(exc)) from exc


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symlink where a file was expected"
    return _reason(exc)


def _unlink_quietly(path: str) -> None:
    # The temp file is ours and the write already failed; the original error is what matters.
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
