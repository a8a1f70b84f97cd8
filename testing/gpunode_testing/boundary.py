"""The test boundary guard: a test touches the real machine only where its markers say so.

An audit hook (`sys.addaudithook`, PEP 578) sees every process start, socket connection and
filesystem call CPython makes, from any code the test runs — gpunode's own included — and
raises `BoundaryViolation` for one its test did not opt in to. In the spirit of cloud-init's
`disable_subp_usage` (tests/conftest.py there), the error is a `BaseException`, so an `except
Exception` in the code under test cannot swallow it; and one swallowed all the same still
fails the test when it ends.

What a test may do:

- every test: read and write inside its session's temporary directory (each test's tmp_path
  and what tmp_path_factory made) and /dev/null; read the checkout (sources, units/,
  tests/data, docs/) and the Python installation it runs from (imports); AF_UNIX sockets
  inside the temporary directory;
- `@pytest.mark.integration`: also start processes, connect to D-Bus and other sockets, ask
  the host name and the resolver, and read and write the test cache where the real components
  live (/var/cache/gpunode-tests, or GPUNODE_TEST_CACHE);
- `@pytest.mark.allow_paths("/sys", ...)`: also read and write under those paths (a test of the
  live machine says which part of it). libudev (pyudev) counts as reading /sys.

Not seen: what C code does by itself (libudev's own reads, libsystemd's D-Bus socket, which is
why `DbusSystemd._connect` is refused separately), `os.stat`/`os.path.exists` (CPython raises
no event for them), and what child processes do. Pure Python `open`, `os.listdir`,
`os.scandir`, `glob`, renames, removals, `mkdir`, `chmod`, links and sockets are all seen.

Used as a pytest plugin: `pytest_plugins = ["gpunode_testing.boundary"]` in a conftest.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The checkout this package is installed from (editable, from testing/).
CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_TEST_CACHE = "/var/cache/gpunode-tests"  # tests/real/cache.py's default

PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
                            "os.spawn", "os.fork", "os.forkpty"})
HOST_EVENTS = frozenset({"socket.gethostname", "socket.getaddrinfo", "socket.gethostbyname",
                         "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname"})
# event → its path arguments: (index, index of its dir_fd or None, what it does to the path);
# "open" reads or writes by its mode and flags. W acts on the name itself (a symlink is
# removed, renamed, not followed); WF and R follow it.
R, W, WF, OPEN = "read", "write", "write-through", "open"
PATH_EVENTS: dict[str, tuple[tuple[int, int | None, str], ...]] = {
    "open": ((0, None, OPEN),),
    "os.listdir": ((0, None, R),),
    "os.scandir": ((0, None, R),),
    "glob.glob": ((0, None, R),),
    "os.chdir": ((0, None, R),),
    "os.remove": ((0, 1, W),),
    "os.rmdir": ((0, 1, W),),
    "os.mkdir": ((0, 2, W),),
    "os.rename": ((0, 2, W), (1, 3, W)),
    "os.link": ((0, 2, R), (1, 3, W)),
    "os.symlink": ((1, 2, W),),  # the link; its target is only text
    "os.chmod": ((0, 2, WF),),
    "os.chown": ((0, 3, WF),),
    "os.truncate": ((0, None, WF),),
    "os.utime": ((0, 3, WF),),
    "shutil.rmtree": ((0, 1, W),),
    "shutil.copyfile": ((0, None, R), (1, None, WF)),
    "shutil.copytree": ((0, None, R), (1, None, WF)),
    "shutil.move": ((0, None, W), (1, None, W)),
}
WATCHED = PROCESS_EVENTS | HOST_EVENTS | PATH_EVENTS.keys() | {
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "ctypes.dlopen"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class BoundaryViolation(BaseException):
    """A test reached the real machine without saying so (see this module's docstring)."""


class FixtureBoundaryViolation(BoundaryViolation, Exception):
    """The same, in a fixture's setup or teardown: an Exception there, so that pytest reports
    it as the test's error and still tears down the rest (a BaseException would stop it)."""


@dataclass
class Policy:
    """What the running test may touch; `violations` keeps what it was refused."""

    test: str
    writable: tuple[str, ...]  # real paths, read and write
    readable: tuple[str, ...]  # real paths, read only
    processes: bool = False  # processes, D-Bus, sockets, host name, resolver
    calling: bool = True  # False while pytest sets up or tears down the test's fixtures
    violations: list[str] = field(default_factory=list)

    def refuse(self, what: str, hint: str) -> None:
        message = f"{self.test} {what}: {hint}"
        self.violations.append(message)
        raise (BoundaryViolation if self.calling else FixtureBoundaryViolation)(message)


def unit_policy(test: str, temp_root: Path, extra: Iterable[str] = ()) -> Policy:
    """The boundary of a unit test: its temporary directory, the checkout and Python."""
    # Imports read the Python installation, the venv and every directory on sys.path.
    python = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              *(entry or os.getcwd() for entry in sys.path)]
    return Policy(
        test,
        writable=_real(str(temp_root), "/dev/null", *extra),
        readable=_real(str(CHECKOUT), *python),
    )


def integration_policy(test: str, temp_root: Path, extra: Iterable[str] = ()) -> Policy:
    # The download cache (which GPUNODE_TEST_CACHE may move) and, always, the default one:
    # namespace work directories live there (boot_harness.WORK_PARENT), outside /tmp.
    cache = os.environ.get("GPUNODE_TEST_CACHE") or DEFAULT_TEST_CACHE
    policy = unit_policy(test, temp_root, (cache, DEFAULT_TEST_CACHE, *extra))
    policy.processes = True
    return policy


_active: list[Policy] = []  # a stack: a test may guard a block more tightly
_installed = False
_local = threading.local()  # set while the hook checks: its own reads are not the test's


@contextlib.contextmanager
def guarded(policy: Policy) -> Iterator[Policy]:
    """Enforce `policy` for the block (the audit hook is installed once per process)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    _active.append(policy)
    try:
        yield policy
    finally:
        _active.pop()


def _hook(event: str, args: tuple[object, ...]) -> None:
    if event not in WATCHED or not _active or getattr(_local, "busy", False):
        return
    _local.busy = True
    try:
        _check(_active[-1], event, args)
    finally:
        _local.busy = False


def _check(policy: Policy, event: str, args: tuple[object, ...]) -> None:
    if event in PROCESS_EVENTS:
        if not policy.processes:
            policy.refuse(f"started a process ({event} {_show(args)})",
                          "give the code a fake runner, or move it to tests/integration/")
    elif event in HOST_EVENTS:
        if not policy.processes:
            policy.refuse(f"asked the machine ({event} {_show(args)})",
                          "pass the name in (a fixture's etc/hostname), or move it to "
                          "tests/integration/")
    elif event.startswith("socket."):
        _check_socket(policy, event, args)
    elif event == "ctypes.dlopen":
        name = str(args[0] or "")
        if "udev" in name:  # pyudev: libudev reads the real /sys itself
            _check_path(policy, f"loaded {name}, which reads the real /sys", "/sys", False)
    else:
        for index, dir_fd, access in PATH_EVENTS[event]:
            if access == OPEN and isinstance(args[0], int):
                continue  # open(fd): the file was checked when it was opened
            path = _path(args, index, dir_fd)
            if path is None:
                continue
            write = access in (W, WF) or (access == OPEN and _open_writes(args))
            follow = access in (R, WF) or (access == OPEN and not _flags(args) & os.O_NOFOLLOW)
            _check_path(policy, f"{'wrote' if write else 'read'} {path} ({event})", path,
                        write, follow)


def _check_socket(policy: Policy, event: str, args: tuple[object, ...]) -> None:
    address = args[1] if len(args) > 1 else None
    if isinstance(address, str | bytes) and not os.fsdecode(address).startswith("\0"):
        _check_path(policy, f"used the socket {os.fsdecode(address)} ({event})",
                    os.fsdecode(address), True)
    elif not policy.processes:
        policy.refuse(f"opened a connection ({event} {address!r})",
                      "a unit test talks to no socket outside its tmp_path (D-Bus, network); "
                      "move it to tests/integration/")


def _check_path(policy: Policy, what: str, path: str, write: bool, follow: bool = True) -> None:
    """Refuse unless the real path (symlinks followed, the last one only when the call follows
    it: O_NOFOLLOW does not) is inside the policy's roots."""
    head, tail = os.path.split(os.path.abspath(path))
    real = os.path.realpath(path) if follow else os.path.join(os.path.realpath(head), tail)
    if _under(real, policy.writable) or (not write and _under(real, policy.readable)):
        return
    # Imports write byte code beside the sources they read (the checkout, the venv).
    if write and os.path.basename(os.path.dirname(real)) == "__pycache__" and \
            _under(real, policy.readable):
        return
    if real != os.path.abspath(path):
        what += f" (that is {real})"
    policy.refuse(what, "a test reads and writes only its tmp_path (build a fixture host "
                  "there); if it must see the real machine, say where with "
                  "@pytest.mark.allow_paths(...)")


def _open_writes(args: tuple[object, ...]) -> bool:
    mode = args[1]
    if isinstance(mode, str):  # open(): its mode; os.open(): mode None, its flags
        return any(c in mode for c in "wax+")
    return bool(_flags(args) & WRITE_FLAGS)


def _flags(args: tuple[object, ...]) -> int:
    flags = args[2] if len(args) > 2 else 0
    return flags if isinstance(flags, int) else 0


def _path(args: tuple[object, ...], index: int, dir_fd: int | None) -> str | None:
    value = args[index] if index < len(args) else None
    if isinstance(value, int):  # an open directory: where it is
        return _fd_path(value)
    if not isinstance(value, str | bytes | os.PathLike):
        return None if value is not None or index else os.getcwd()  # listdir() is the cwd
    path = os.fsdecode(value)
    fd = args[dir_fd] if dir_fd is not None and dir_fd < len(args) else None
    if isinstance(fd, int) and fd >= 0 and not os.path.isabs(path):
        base = _fd_path(fd)
        return os.path.join(base, path) if base else None
    return os.path.abspath(path)


def _fd_path(fd: int) -> str | None:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") else None  # pipe:[…], socket:[…]: no path


def _real(*paths: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths))


def _under(path: str, roots: tuple[str, ...]) -> bool:
    """Inside one of the roots; a root with a `*` is a pattern (fnmatch) for names."""
    return any(fnmatch.fnmatch(path, root) or fnmatch.fnmatch(path, root + "/*") if "*" in root
               else path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _show(args: tuple[object, ...]) -> str:
    return " ".join(repr(a) for a in args[:2])[:200]


def _no_bus(*args: object, **kwargs: object) -> None:
    policy = _active[-1]
    policy.refuse("asked systemd over D-Bus", "use a fake Systemd, or move it to "
                  "tests/integration/ and start a systemd (gpunode_testing.systemd_ns)")


# -- the pytest plugin ------------------------------------------------------------------------


_CALL_FAILED = pytest.StashKey[bool]()
_POLICY = pytest.StashKey[Policy]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    policy = item.stash.get(_POLICY, None)
    if policy is not None:
        policy.calling = True
    yield
    if policy is not None:
        policy.calling = False


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    if call.when == "call" and call.excinfo is not None:
        item.stash[_CALL_FAILED] = True  # it failed already; once is enough


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: may start processes, use D-Bus and "
                            "sockets, and the test cache (see gpunode_testing.boundary)")
    config.addinivalue_line("markers", "allow_paths(*paths): the test may read and write under "
                            "these real paths (see gpunode_testing.boundary)")


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_session_directory(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """tempfile (and what uses it: capfd, tempfile.mkdtemp in code under test) writes inside
    the session's temporary directory, not in the machine's /tmp."""
    scratch = tmp_path_factory.getbasetemp() / "tempfile"
    scratch.mkdir(exist_ok=True)
    saved, tempfile.tempdir = tempfile.tempdir, str(scratch)
    yield
    tempfile.tempdir = saved


@pytest.fixture(autouse=True)
def _boundary(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Policy]:
    """Every test runs inside its boundary; what it was refused fails it even if caught."""
    extra = [str(p) for m in request.node.iter_markers("allow_paths") for p in m.args]
    make = integration_policy if request.node.get_closest_marker("integration") else unit_policy
    policy = make(request.node.nodeid, tmp_path_factory.getbasetemp(), extra)
    policy.calling = False
    request.node.stash[_POLICY] = policy
    with pytest.MonkeyPatch.context() as patch:
        if not policy.processes:  # libsystemd's socket is C: no audit event to see
            patch.setattr("gpunode.platform.systemd.DbusSystemd._connect", _no_bus)
        with guarded(policy):
            yield policy
    if policy.violations and not request.node.stash.get(_CALL_FAILED, False):
        pytest.fail("crossed the test boundary (an error was caught and hidden):\n  "
                    + "\n  ".join(dict.fromkeys(policy.violations)), pytrace=False)

