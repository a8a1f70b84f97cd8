"""Placing a bake: every path it will write checked before the first write, and every change
undone when a later one fails.

`check_*` look at a target the way the write will meet it — its parents resolved inside the
root (a link climbing out is refused), each existing parent a directory, the entry itself
something the write can replace (a file: a regular file with one name; a link: anything but a
directory; a removal: what the manifest said it was) — and refuse with the path and what stands
there, before a byte is fetched. `Placement` then makes the changes, remembering how to undo
each: an artifact or a tree is renamed over its place only after what stood there was moved
aside, a small file's old bytes and mode are kept, a link's old target. `commit()` drops the
moved-aside entries; `rollback()` puts everything back in reverse, so a bake refused while
placing (a full disk, a file changed underneath) leaves the image as it was.
"""

from __future__ import annotations

import stat
from collections.abc import Callable

from gpunode.errors import HostError
from gpunode.platform import safeio
from gpunode.platform.host import Host
from gpunode.platform.nodepaths import TEMP_SUFFIX

NOTHING_PLACED = ("nothing of the bake was placed; remove or move what stands there (or fix the "
                  "link) and bake again")


def _refuse(host: Host, op: str, path: str, reason: str) -> HostError:
    error = HostError(op, host.display(path), reason)
    error.hint = NOTHING_PLACED
    return error


def _check_parents(host: Host, path: str, op: str) -> None:
    """Every parent of `path` resolves inside the root, and the nearest one that exists is a
    directory (the missing ones the write makes)."""
    directory = path.rstrip("/").rpartition("/")[0] or "/"
    try:
        host.real(directory)  # a link climbing above the root: HostError here
        while directory not in ("", "/"):
            st = host.stat(directory)
            if st is not None:
                if not stat.S_ISDIR(st.st_mode):
                    raise _refuse(host, op, path, f"{host.display(directory)} is not a directory")
                return
            directory = directory.rpartition("/")[0] or "/"
    except HostError as exc:
        if exc.hint:
            raise
        raise _refuse(host, op, path, exc.reason) from None


def check_file(host: Host, path: str) -> None:
    """write_atomic(path) would succeed as far as anything under the root can tell."""
    _check_parents(host, path, "write")
    try:
        st = host.stat(path)
    except HostError as exc:
        raise _refuse(host, "write", path, exc.reason) from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise _refuse(host, "write", path, safeio.kind(st.st_mode))
    if st is not None and st.st_nlink > 1:
        raise _refuse(host, "write", path, f"it has {st.st_nlink} hard links")


def check_link(host: Host, path: str) -> None:
    """symlink(path) would succeed: the entry is absent, a link or a file (replaced in one
    rename), never a directory."""
    _check_parents(host, path, "link")
    st = host.lstat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise _refuse(host, "link", path, "is a directory, not a link or file the bake may "
                      "replace")


def check_rename(host: Host, path: str) -> None:
    """An artifact or tree renamed into `path`: its parents can be made."""
    _check_parents(host, path, "place")


def make_dirs(host: Host, directory: str) -> list[str]:
    """Make `directory` and its missing parents; those it made, outermost first (for a failed
    bake to remove again)."""
    missing = []
    while directory not in ("", "/") and host.lstat(directory) is None:
        missing.insert(0, directory)
        directory = directory.rpartition("/")[0]
    for path in missing:
        host.make_dirs(path)
    return missing


class Placement:
    """The bake's changes as they are made, and how to undo each."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._undo: list[Callable[[], None]] = []
        self._aside: list[str] = []  # what was replaced or removed: gone at commit()
        self._emptied: list[str] = []  # directories to remove at commit(), when empty

    def _aside_of(self, path: str) -> str:
        directory, _, name = path.rpartition("/")
        return f"{directory}/.{name}.old{TEMP_SUFFIX}"

    def _move_aside(self, path: str) -> None:
        host = self.host
        if host.lstat(path) is None:
            return
        aside = self._aside_of(path)
        host.remove_tree(aside)
        host.rename(path, aside)
        self._aside.append(aside)
        self._undo.append(lambda: (host.remove_tree(path), host.rename(aside, path)))

    def make_dirs(self, directory: str) -> None:
        for path in make_dirs(self.host, directory):
            self._undo.append(lambda path=path: self.host.remove_dir(path))  # type: ignore[misc]

    def rename(self, source: str, path: str) -> None:
        """Move `source` (a stage) to `path`; what stood there is kept aside until commit."""
        self.make_dirs(path.rpartition("/")[0])
        replaced = self.host.lstat(path) is not None
        self._move_aside(path)
        self.host.rename(source, path)
        if not replaced:
            self._undo.append(lambda: self.host.remove_tree(path))

    def write(self, path: str, data: bytes) -> None:
        """write_atomic, the old bytes and mode kept for a rollback."""
        host = self.host
        st = host.stat(path)
        old = host.read_optional_bytes(path) if st is not None else None
        self.make_dirs(path.rpartition("/")[0])
        host.write_atomic(path, data)
        if old is None or st is None:
            self._undo.append(lambda: host.remove(path))
        else:
            attrs = (st.st_mode, st.st_uid, st.st_gid)
            self._undo.append(lambda: host.write_atomic(path, old, attrs=attrs))

    def link(self, path: str, target: str) -> None:
        host = self.host
        self.make_dirs(path.rpartition("/")[0])
        st = host.lstat(path)
        if st is not None and not stat.S_ISLNK(st.st_mode):
            self._move_aside(path)  # a file where the link goes: back at a rollback
            st = None
        old = host.read_link(path) if st is not None else None
        host.symlink(path, target)
        if old is None:
            self._undo.append(lambda: host.remove(path))
        else:
            self._undo.append(lambda: host.symlink(path, old))

    def remove(self, path: str) -> None:
        """Remove a file, link or tree: moved aside now, gone at commit."""
        self._move_aside(path)

    def remove_dir(self, directory: str) -> None:
        """Remove `directory` at commit(), when it is empty then."""
        self._emptied.append(directory)

    def built(self, entry: str) -> None:
        """A tree published while staging (a driver build): removed at a rollback."""
        self._undo.append(lambda: self.host.remove_tree(entry))

    def commit(self) -> None:
        for aside in self._aside:
            self.host.remove_tree(aside)
        for directory in self._emptied:
            self.host.remove_dir(directory)
        self._undo.clear()
        self._aside.clear()
        self._emptied.clear()

    def rollback(self) -> None:
        """Undo every change made, last first; an undo that fails leaves the rest to try."""
        from gpunode import log

        for undo in reversed(self._undo):
            try:
                undo()
            except HostError as exc:
                log.get().warning("bake.rollback_incomplete", exc=exc)
        self._undo.clear()
        self._aside.clear()
        self._emptied.clear()
