"""What the Host does with the kernel's own files: records read from /dev/kmsg, a sysfs
attribute written in place, a character device node made, a Unix socket tried. The Host
delegates here (host.py), so every path still goes through its mapping under the root."""

from __future__ import annotations

import errno
import os
import stat

from gpunode.errors import HostError
from gpunode.platform import safeio
from gpunode.platform.files import HostPaths, make_unique, reason, unlink_quietly


def read_records(host: HostPaths, path: str, limit: int = safeio.DEFAULT_LIMIT) -> list[str]:
    """The text records of a kernel record device (/dev/kmsg: one record per read, up to
    the end of its buffer, never blocking) or the lines of a regular file in its place (a
    fixture); at most `limit` bytes. Anything else (a FIFO, a directory) is refused."""
    shown = host.display(path)
    fd = host.open_nonblocking(path, "read")
    records: list[str] = []
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return os.read(fd, limit).decode(errors="replace").splitlines()
        if not stat.S_ISCHR(mode):
            raise HostError("read", shown, safeio.kind(mode).replace(
                "not a regular file", "not a record device or a regular file"))
        total = 0
        while total < limit:
            try:
                record = os.read(fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # overwritten while reading: carry on with the next one
                if exc.errno == errno.EAGAIN:
                    break  # the end of the buffer
                raise
            if not record:
                break
            total += len(record)
            records.append(record.decode(errors="replace"))
    except OSError as exc:
        raise HostError("read", shown, reason(exc)) from exc
    finally:
        os.close(fd)
    return records


def open_records(host: HostPaths, path: str) -> tuple[int, str]:
    """A descriptor to follow a kernel record device from the start of its buffer (the
    daemon of gpunode watch: gpunode/watch/kmsg.py reads it), and what it is: "device"
    (/dev/kmsg: one record per read), "fifo" (a stand-in fed lines, in tests) or "file"
    (a saved log under --root). Read-only, non-blocking, never inherited; anything else is
    refused. The caller closes it."""
    fd = host.open_nonblocking(path, "read")
    mode = os.fstat(fd).st_mode
    kind = ("device" if stat.S_ISCHR(mode) else "fifo" if stat.S_ISFIFO(mode)
            else "file" if stat.S_ISREG(mode) else None)
    if kind is None:
        os.close(fd)
        raise HostError("read", host.display(path), safeio.kind(mode).replace(
            "not a regular file", "not a record device, a FIFO or a regular file"))
    return fd, kind


def write_attribute(host: HostPaths, path: str, data: bytes) -> None:
    """Write a kernel attribute (a /sys module parameter) in place, in one write: it must
    exist as a regular file (sysfs attributes are; under --root, the fixture's file), is
    never created, and a FIFO or link in its place is refused without blocking."""
    shown = host.display(path)
    st = host.stat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):  # a FIFO would open as ENXIO
        raise HostError("write", shown, safeio.kind(st.st_mode))
    try:
        fd = os.open(host.real(path), os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK |
                     os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise HostError("write", shown, reason(exc)) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HostError("write", shown, "is not a kernel attribute (a regular file)")
        if os.write(fd, data) != len(data):
            raise HostError("write", shown, "the kernel took only part of the value")
    except OSError as exc:
        raise HostError("write", shown, reason(exc)) from exc
    finally:
        os.close(fd)


def make_char_device(host: HostPaths, path: str, major: int, minor: int, mode: int) -> None:
    """Create a character device node (replacing whatever is there) with exactly `mode`.

    The node is made under a unique temporary name and renamed over the path, so two
    commands doing this at once both succeed and the path is never missing in between.
    """
    target = host.entry(path)
    shown = host.display(path)
    try:
        device = os.makedev(major, minor)
    except (OverflowError, ValueError) as exc:
        raise HostError("create device", shown, f"{major}:{minor} is not a device number "
                        f"({exc})") from None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        temp = make_unique(target, lambda t: os.mknod(t, stat.S_IFCHR | mode, device))
        try:
            os.chmod(temp, mode)  # mknod applies the umask
            os.rename(temp, target)
        except OSError:
            unlink_quietly(temp)
            raise
    except OSError as exc:
        raise HostError("create device", shown, reason(exc)) from exc


def connect(host: HostPaths, path: str) -> None:
    """Connect to the Unix socket at `path` and hang up: whether something listens there.

    The socket's directory is opened first and the socket reached through
    /proc/self/fd/<fd>/<name>, so a socket under a long root still fits sun_path's 108
    bytes."""
    import socket  # only waiting for containerd's socket needs it

    shown = host.display(path)
    # Resolved whole, inside the root: the kernel would follow a final symlink out of it.
    directory, _, name = host.real(path).rpartition("/")
    try:
        fd = os.open(directory or "/", os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError("connect to", shown, reason(exc)) from exc
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(f"/proc/self/fd/{fd}/{name}")
    except OSError as exc:
        raise HostError("connect to", shown, reason(exc)) from exc
    finally:
        os.close(fd)
