"""Locks on files under the host root: an exclusive flock(2) held for a block (`lock`, what
the node lock and the driver cache take), the note its holder leaves for a waiter, and who
holds one now (`holder`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpunode.errors import HostError, LockTimeout
from gpunode.platform import safeio
from gpunode.platform.files import HostPaths, reason

_LOCK_POLL_SECONDS = 0.05
_LOCK_NOTE_LIMIT = 256


@contextlib.contextmanager
def lock(host: HostPaths, path: str, wait: float | None = None,
         on_wait: Callable[[str], None] | None = None,
         mode: int = 0o600) -> Iterator[LockFile]:
    """Hold an exclusive flock(2) of the file `path` for the block.

    The file (and its directory) is created when missing, with `mode`; it is never opened
    through a final symlink and must be a regular file. When another open file holds the
    lock, `on_wait(note)` is called once with the note the holder wrote (LockFile.write),
    then the lock is waited for: as long as it takes (`wait` None), or up to `wait` seconds,
    after which LockTimeout (with the holder's note) is raised. flock locks belong to the
    open file description, so two threads of one process exclude each other as two
    processes do. The lock is released when the block ends; the file stays (unlinking it
    would race the next waiter).
    """
    shown = host.display(path)
    host.make_dirs(path.rstrip("/").rpartition("/")[0] or "/")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(host.entry(path), flags, mode)
    except OSError as exc:
        why = "is a symlink, not the lock file" if exc.errno == errno.ELOOP else reason(exc)
        raise HostError("lock", shown, why) from exc
    try:
        held = LockFile(fd, shown)
        try:
            st_mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(st_mode):
                raise HostError("lock", shown, safeio.kind(st_mode))
            _acquire(held, wait, on_wait)
        except OSError as exc:
            raise HostError("lock", shown, reason(exc)) from exc
        yield held  # the block's own errors pass through as they are
    finally:
        os.close(fd)  # releases the lock


def holder(host: HostPaths, path: str) -> str | None:
    """The note of whoever holds the flock of `path` right now, or None when nobody does
    (or there is no such regular file). Never waits, never creates the file, never follows
    a final symlink."""
    shown = host.display(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(host.entry(path), flags)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None  # a symlink is no lock gpunode would take
        raise HostError("lock", shown, reason(exc)) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return LockFile(fd, shown).note()
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except OSError as exc:
        raise HostError("lock", shown, reason(exc)) from exc
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LockFile:
    """An open lock file (locks.lock): the holder writes a note, a waiter reads it."""

    fd: int
    shown: str

    def write(self, note: str) -> None:
        """Replace the file's note (e.g. '<pid> <command>'), for whoever waits or probes."""
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, note.encode(), 0)
        except OSError as exc:
            raise HostError("write", self.shown, reason(exc)) from exc

    def note(self) -> str:
        """The holder's note as far as it can be read ('' when it cannot)."""
        try:
            return os.pread(self.fd, _LOCK_NOTE_LIMIT, 0).decode("utf-8", errors="replace")
        except OSError:
            return ""


def _acquire(lock: LockFile, wait: float | None, on_wait: Callable[[str], None] | None) -> None:
    deadline = None if wait is None else time.monotonic() + wait
    told = False
    while True:
        try:
            fcntl.flock(lock.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if deadline is not None and time.monotonic() >= deadline:
            raise LockTimeout(lock.shown, lock.note(), wait or 0.0)
        if not told:
            told = True
            if on_wait is not None:
                on_wait(lock.note())
        if deadline is None:
            fcntl.flock(lock.fd, fcntl.LOCK_EX)  # no bound: the kernel wakes us
            return
        time.sleep(_LOCK_POLL_SECONDS)
