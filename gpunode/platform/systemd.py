"""The systemd adapter: what gpunode asks of the service manager, over D-Bus with pystemd.

Under `--root` there is no service manager for that tree: `NoSystemd` answers that no unit
runs, so nothing is restarted; a live host gets `DbusSystemd`.

A live host without a reachable system bus (an image build, a chroot, a container, CI) is normal,
not a crash: `DbusSystemd` then answers like `NoSystemd` — state "unknown", nothing enabled, no
ExecStart, no main process, reloads skipped — and says so once per process in the log;
`available` and `unavailable_reason` tell callers, so they can say that whoever runs the tree
must restart containerd, or what they cannot know. Only `restart` refuses.

The bus is pystemd's binding of sd-bus, the D-Bus client systemd's own tools use, imported on
the first call (it brings lxml along, which gpunode does not use). As root gpunode talks to
systemd's private socket /run/systemd/private, as systemctl does (no dbus-daemon in between),
else, or where that socket is missing, to the system bus. sd-bus authenticates, checks every
message it reads, and gives each call 25 s ($SYSTEMD_BUS_TIMEOUT changes that). Why pystemd
and not jeepney: docs/design.md, "systemd over D-Bus".
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol

from gpunode.errors import SystemdError, Unavailable

if TYPE_CHECKING:
    from pystemd.dbuslib import DBus


@dataclass(frozen=True)
class UnitExec:
    """A loaded unit's ExecStart and the environment it runs with, as systemd reports them."""

    argv: tuple[str, ...]  # ExecStart as systemd stores it (variables not yet expanded)
    environment: dict[str, str]  # Environment= only
    environment_files: tuple[str, ...] = ()  # EnvironmentFile= paths (their values override)


@dataclass(frozen=True)
class MainProcess:
    """A running service's main process as systemd recorded it when it started it."""

    pid: int
    # ExecMainStartTimestamp: CLOCK_REALTIME in microseconds, taken when systemd forked the
    # process — the same clock a file's mtime is, and unlike /proc's start time (whole-second
    # btime plus clock ticks) exact enough to order "config written" against "daemon started"
    # when gpunode writes the config a few milliseconds before containerd starts.
    started: float  # seconds since the epoch


MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER_INTERFACE = "org.freedesktop.systemd1.Manager"
UNIT_INTERFACE = "org.freedesktop.systemd1.Unit"
SERVICE_INTERFACE = "org.freedesktop.systemd1.Service"
UNKNOWN = "unknown"  # the state of every unit where no service manager can be asked
SYSTEMD_BUS_NAME = "org.freedesktop.systemd1"
PRIVATE_SOCKET = "/run/systemd/private"
SYSTEM_BUS_ADDRESS = "unix:path=/run/dbus/system_bus_socket"  # without $DBUS_SYSTEM_BUS_ADDRESS
# D-Bus errors that mean nobody is there to answer, not a refusal by somebody who is.
UNREACHABLE_ERRORS = frozenset({"org.freedesktop.DBus.Error.ServiceUnknown",
                                "org.freedesktop.DBus.Error.NameHasNoOwner",
                                "org.freedesktop.DBus.Error.Disconnected",
                                "org.freedesktop.DBus.Error.NoServer"})
class Systemd(Protocol):
    @property
    def available(self) -> bool: ...

    @property
    def unavailable_reason(self) -> str | None: ...

    def active_state(self, unit: str) -> str: ...

    def enabled(self, unit: str) -> bool: ...

    def exec_start(self, unit: str) -> UnitExec | None: ...

    def main_process(self, unit: str) -> MainProcess | None: ...

    def daemon_reload(self) -> None: ...

    def restart(self, unit: str, timeout: float) -> None: ...

    def start(self, unit: str, timeout: float) -> None: ...

    def load_state(self, unit: str) -> str: ...


class NoSystemd:
    """No service manager owns this tree (a fixture or a mounted image): nothing runs."""

    available = False
    unavailable_reason = "no systemd manages this root"

    def active_state(self, unit: str) -> str:
        return "inactive"

    def enabled(self, unit: str) -> bool:
        return False

    def exec_start(self, unit: str) -> UnitExec | None:
        return None

    def main_process(self, unit: str) -> MainProcess | None:
        return None

    def daemon_reload(self) -> None:
        return None

    def restart(self, unit: str, timeout: float) -> None:
        raise SystemdError(unit, "restart", "no systemd manages this root")

    def start(self, unit: str, timeout: float) -> None:
        raise SystemdError(unit, "start", "no systemd manages this root")

    def load_state(self, unit: str) -> str:
        return UNKNOWN


class BusFailure(Exception):
    """What a D-Bus call gave instead of an answer: `unreachable` where nobody can be asked,
    `timed_out` where nobody answered in time, else a refusal (its D-Bus error name)."""

    def __init__(self, message: str, name: str = "", unreachable: bool = False,
                 timed_out: bool = False) -> None:
        super().__init__(message)
        self.name = name
        self.unreachable = unreachable
        self.timed_out = timed_out


def bus_failure(exc: Exception) -> BusFailure:
    """pystemd's error (sd-bus's negative errno, and the D-Bus error's name and message where
    the peer sent one) told apart: nobody to ask, no answer in time, or a refusal."""
    number = abs(int(getattr(exc, "errno", 0) or 0))
    name = _error_name(exc)
    said = _text(getattr(exc, "err_message", "") or "")
    cause = os.strerror(number) if number else type(exc).__name__
    if number == errno.ETIMEDOUT and name in ("", "org.freedesktop.DBus.Error.Timeout",
                                              "org.freedesktop.DBus.Error.NoReply"):
        return BusFailure(f"systemd did not answer in time ({cause})", timed_out=True)
    # sd-bus names an error of its own connection "System.Error.<errno>"; pystemd gives none
    # where the bus could not be opened at all
    if not name or name.startswith("System.Error.") or name in UNREACHABLE_ERRORS:
        return BusFailure(f"{said} ({cause})" if said and said != cause else cause, name,
                          unreachable=True)
    return BusFailure(said or cause, name)


def _error_name(exc: Exception) -> str:
    """The D-Bus error name: pystemd keeps it only on its base class; its subclasses name it."""
    name = _text(getattr(exc, "err_name", "") or "")
    return name or _ERROR_CLASSES.get(type(exc).__name__, "")


# pystemd.dbusexc's classes for the D-Bus errors gpunode tells apart (its DBUS_ERROR_MAP).
_ERROR_CLASSES = {"DBusServiceUnknownError": "org.freedesktop.DBus.Error.ServiceUnknown",
                  "DBusNameHasNoOwnerError": "org.freedesktop.DBus.Error.NameHasNoOwner",
                  "DBusDisconnectedError": "org.freedesktop.DBus.Error.Disconnected",
                  "DBusNoServerError": "org.freedesktop.DBus.Error.NoServer",
                  "DBusTimeoutError": "org.freedesktop.DBus.Error.Timeout",
                  "DBusNoSuchUnitError": "org.freedesktop.systemd1.NoSuchUnit",
                  "DBusAccessDeniedError": "org.freedesktop.DBus.Error.AccessDenied"}


class DbusSystemd:
    """systemd over its D-Bus API (pystemd): properties read and methods called by name on one
    connection, opened on first use.

    address: a D-Bus address to use instead of systemd's private socket or the system bus
    (tests); `direct`: it is a peer-to-peer socket like the private one (no Hello)."""

    # The first adapter of a process to find no bus says so; status and boot make several.
    warned: ClassVar[bool] = False

    def __init__(self, address: str | None = None, direct: bool = False) -> None:
        self.unavailable_reason: str | None = None
        self._address = address
        self._direct = direct
        self._bus: DBus | None = None
        self._where = address or ""  # the address last opened, as the reason names it

    @property
    def available(self) -> bool:
        """False once a call found no reachable system bus (then it is not asked again)."""
        return self.unavailable_reason is None

    def _connect(self, name: str) -> DBus:
        """The connection, opened on first use (the tests' boundary refuses this call)."""
        if self.unavailable_reason is not None:
            raise Unavailable(name, "connect to", self.unavailable_reason)
        if self._bus is None:
            from pystemd.dbusexc import DBusBaseError

            try:
                self._bus = self._open()
            except DBusBaseError as exc:
                failure = bus_failure(exc)
                if failure.unreachable:
                    self._give_up(name, "connect to", failure)
                raise SystemdError(name, "connect to", str(failure)) from exc
        return self._bus

    def _open(self) -> DBus:
        """systemd's private socket as root, else the system bus (or the address given)."""
        from pystemd.dbusexc import DBusBaseError
        from pystemd.dbuslib import DBus, DBusAddress

        if self._address is not None:
            bus = DBusAddress(self._address.encode(), peer_to_peer=self._direct)
        else:
            if os.geteuid() == 0 and os.path.exists(PRIVATE_SOCKET):
                self._where = f"unix:path={PRIVATE_SOCKET}"
                bus = DBusAddress(self._where.encode(), peer_to_peer=True)
                try:
                    bus.open()
                    return bus
                except DBusBaseError:
                    pass  # e.g. a systemd that no longer listens there: the bus may work
            # sd-bus's own choice, as it says in sd_bus_open_system(3)
            self._where = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or SYSTEM_BUS_ADDRESS
            bus = DBus()
        bus.open()
        return bus

    def _drop(self) -> None:
        if self._bus is not None:
            self._bus.close()
            self._bus = None

    def _request(self, name: str, what: str, call: Callable[[DBus], Any],
                 again: bool = True) -> Any:
        """`call(connection)`, its errors told apart: nobody to ask (Unavailable) or a refusal
        (SystemdError). A kept connection that went away (the bus restarted under a
        long-lived `gpunode watch`) is opened once more before systemd counts as gone — for
        a read (`again`); a restart or reload, which must not reach systemd twice, goes out
        once on a new connection instead."""
        if not again:
            self._drop()
        for attempt in (1, 2) if again else (2,):
            kept = self._bus is not None
            bus = self._connect(name)
            from pystemd.dbusexc import DBusBaseError

            try:
                return call(bus)
            except DBusBaseError as exc:
                failure = bus_failure(exc)
                if failure.unreachable:
                    self._drop()
                    if not (kept and attempt == 1):
                        self._give_up(name, what, failure)
                    continue
                if failure.timed_out:  # a late answer must not meet the next call
                    self._drop()
                raise SystemdError(name, what, str(failure)) from exc
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _give_up(self, name: str, what: str, exc: BaseException) -> NoReturn:
        """No systemd to ask: not asked again by this adapter; said once per process."""
        self.unavailable_reason = f"no systemd on the system bus ({self._where}: {exc})"
        if not DbusSystemd.warned:
            DbusSystemd.warned = True
            from gpunode import log

            log.get().warning("systemd.unavailable", reason=self.unavailable_reason,
                              effect="no unit is asked, reloaded or restarted; whoever runs "
                              "this tree must restart what needs the changes")
        raise Unavailable(name, what, self.unavailable_reason) from exc

    def _property(self, unit: str, interface: str, name: str, signature: str) -> Any:
        return self._request(unit, "read", lambda bus: bus.get_property(
            SYSTEMD_BUS_NAME.encode(), _unit_path(unit), interface.encode(), name.encode(),
            signature.encode()))

    def _unit_state(self, unit: str, name: str) -> str:
        return _text(self._property(unit, UNIT_INTERFACE, name, "s"))

    def _call(self, unit: str, what: str, path: bytes, interface: str, method: str,
              args: tuple[str, ...] = ()) -> Any:
        from pystemd.dbuslib import apply_signature

        values = apply_signature(b"s" * len(args), [arg.encode() for arg in args])
        return self._request(unit, what, lambda bus: bus.call_method(
            SYSTEMD_BUS_NAME.encode(), path, interface.encode(), method.encode(), values),
            again=False)

    def active_state(self, unit: str) -> str:
        try:
            return self._unit_state(unit, "ActiveState")
        except Unavailable:
            return UNKNOWN

    def enabled(self, unit: str) -> bool:
        try:
            state = self._unit_state(unit, "UnitFileState")
        except Unavailable:
            return False
        return state in ("enabled", "enabled-runtime", "static", "alias")

    def exec_start(self, unit: str) -> UnitExec | None:
        """None where systemd cannot be asked (no system bus) or has no such unit."""
        try:
            if self._unit_state(unit, "LoadState") != "loaded":
                return None
            commands = self._property(unit, SERVICE_INTERFACE, "ExecStart", "a(sasbttttuii)")
            if not commands:
                return None
            environment = self._property(unit, SERVICE_INTERFACE, "Environment", "as")
            files = self._property(unit, SERVICE_INTERFACE, "EnvironmentFiles", "a(sb)")
        except Unavailable:
            return None  # the caller falls back to the unit files
        # ExecStart is a(sasbttttuii): (path, argv, ignore failure, timestamps…, pid, status)
        return UnitExec(argv=tuple(_text(w) for w in commands[-1][1]),
                        environment=dict(_split_env(_text(e)) for e in environment),
                        environment_files=tuple(_text(entry[0]) for entry in files))

    def main_process(self, unit: str) -> MainProcess | None:
        """The unit's running main process and when systemd started it; None where systemd
        cannot be asked, or the unit is not active with a main process."""
        try:
            if (self._unit_state(unit, "LoadState") != "loaded"
                    or self._unit_state(unit, "ActiveState") != "active"):
                return None
            pid = int(self._property(unit, SERVICE_INTERFACE, "MainPID", "u"))
            started = int(self._property(unit, SERVICE_INTERFACE, "ExecMainStartTimestamp",
                                         "t"))
        except Unavailable:
            return None
        except SystemdError as exc:
            raise SystemdError(unit, "read the main process of", exc.reason) from exc
        if pid == 0 or started == 0:
            return None
        return MainProcess(pid=pid, started=started / 1_000_000)

    def daemon_reload(self) -> None:
        try:
            # A timeout too is a refusal: a manager that did not answer in time.
            self._call("systemd", "reload", MANAGER_PATH.encode(), MANAGER_INTERFACE, "Reload")
        except Unavailable:
            return  # nothing to reload: no manager has read the old files either
        except SystemdError as exc:
            raise SystemdError("systemd", "reload", exc.reason,
                               "see 'journalctl -b _PID=1'; 'systemctl daemon-reload' by hand, "
                               "then run gpunode again") from exc

    def restart(self, unit: str, timeout: float) -> None:
        """Restart and wait for the job to finish and the unit to be active again."""
        self._job(unit, "Restart", timeout)

    def start(self, unit: str, timeout: float) -> None:
        """Start (a unit that is active stays as it is) and wait until it is active."""
        self._job(unit, "Start", timeout)

    def load_state(self, unit: str) -> str:
        """"loaded" where a unit file (or a transient unit) of that name exists, "not-found"
        where none does; UNKNOWN where systemd cannot be asked."""
        try:
            return self._unit_state(unit, "LoadState")
        except Unavailable:
            return UNKNOWN

    def _job(self, unit: str, method: str, timeout: float) -> None:
        verb = method.lower()
        self._call(unit, verb, _unit_path(unit), UNIT_INTERFACE, method, ("replace",))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self._property(unit, UNIT_INTERFACE, "Job", "(uo)")
            if job[0] == 0:  # the job is done (Type=notify: after READY)
                state = self._unit_state(unit, "ActiveState")
                if state == "active":
                    return
                # e.g. "activating (auto-restart)": it failed and Restart= is trying again
                sub = self._unit_state(unit, "SubState")
                raise SystemdError(unit, verb, f"it is {state} ({sub}) after the {verb}")
            time.sleep(0.05)
        raise SystemdError(unit, verb, f"the {verb} job did not finish within {timeout:g} s")


def _unit_path(unit: str) -> bytes:
    """The unit's object path, escaped by sd-bus (systemd loads the unit when asked)."""
    from pystemd.dbuslib import path_encode

    return path_encode(b"/org/freedesktop/systemd1/unit", unit.encode())


def _text(value: Any) -> str:
    """A D-Bus string as pystemd gives it (bytes) made text."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _split_env(assignment: str) -> tuple[str, str]:
    key, _, value = assignment.partition("=")
    return key, value


def for_host(is_live: bool) -> Systemd:
    return DbusSystemd() if is_live else NoSystemd()
