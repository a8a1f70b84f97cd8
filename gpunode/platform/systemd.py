"""The systemd adapter: what gpunode asks of the service manager, over D-Bus (gpunode/dbus.py).


Under `--root` there is no service manager for that tree: `NoSystemd` answers that no unit
runs, so nothing is restarted; a live host gets `DbusSystemd`.

A live host without a reachable system bus (an image build, a chroot, a container, CI) is normal,
not a crash: `DbusSystemd` then answers like `NoSystemd` — state "unknown", nothing enabled, no
ExecStart, no main process, reloads skipped — and says so once per process in the log;
`available` and `unavailable_reason` tell callers, so they can say that whoever runs the tree
must restart containerd, or what they cannot know. Only `restart` refuses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol

from gpunode.errors import SystemdError, Unavailable

if TYPE_CHECKING:
    from gpunode.dbus import Connection


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


class DbusSystemd:
    """systemd over its D-Bus API (gpunode/dbus.py): properties read and methods called by
    name on one connection, opened on first use."""

    # The first adapter of a process to find no bus says so; status and boot make several.
    warned: ClassVar[bool] = False

    def __init__(self) -> None:
        self.unavailable_reason: str | None = None
        self._bus: Connection | None = None

    @property
    def available(self) -> bool:
        """False once a call found no reachable system bus (then it is not asked again)."""
        return self.unavailable_reason is None

    def _connect(self, name: str) -> Connection:
        """The connection, opened on first use (the tests' boundary refuses this call)."""
        from gpunode import dbus

        if self.unavailable_reason is not None:
            raise Unavailable(name, "connect to", self.unavailable_reason)
        if self._bus is None:
            try:
                self._bus = dbus.connect_systemd()
            except dbus.BusUnreachable as exc:
                self._give_up(name, "connect to", exc)
            except dbus.BusError as exc:
                raise SystemdError(name, "connect to", str(exc)) from exc
        return self._bus

    def _request(self, name: str, what: str, call: Callable[[Connection], Any],
                 again: bool = True) -> Any:
        """`call(connection)`, its errors told apart: nobody to ask (Unavailable) or a refusal
        (SystemdError). A kept connection that went away (the bus restarted under a
        long-lived `gpunode watch`) is opened once more before systemd counts as gone — for
        a read (`again`); a restart or reload, which must not reach systemd twice, goes out
        once on a new connection instead."""
        from gpunode import dbus

        if not again and self._bus is not None:
            self._bus.close()
            self._bus = None
        for attempt in (1, 2) if again else (2,):
            kept = self._bus is not None
            bus = self._connect(name)
            try:
                return call(bus)
            except dbus.BusUnreachable as exc:
                bus.close()
                self._bus = None
                if not (kept and attempt == 1):
                    self._give_up(name, what, exc)
            except dbus.BusError as exc:
                if not exc.name:  # no answer in time: a late one must not meet the next call
                    bus.close()
                    self._bus = None
                raise SystemdError(name, what, str(exc)) from exc
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _give_up(self, name: str, what: str, exc: BaseException) -> NoReturn:
        """No systemd to ask: not asked again by this adapter; said once per process."""
        self.unavailable_reason = f"no systemd on the system bus ({exc})"
        if not DbusSystemd.warned:
            DbusSystemd.warned = True
            from gpunode import log

            log.get().warning("systemd.unavailable", reason=self.unavailable_reason,
                              effect="no unit is asked, reloaded or restarted; whoever runs "
                              "this tree must restart what needs the changes")
        raise Unavailable(name, what, self.unavailable_reason) from exc

    def _property(self, unit: str, interface: str, name: str) -> Any:
        return self._request(unit, "read", lambda bus: bus.get_property(
            _unit_path(unit), interface, name))

    def _unit_state(self, unit: str, name: str) -> str:
        return str(self._property(unit, UNIT_INTERFACE, name))

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
            commands = self._property(unit, SERVICE_INTERFACE, "ExecStart")
            if not commands:
                return None
            environment = self._property(unit, SERVICE_INTERFACE, "Environment")
            files = self._property(unit, SERVICE_INTERFACE, "EnvironmentFiles")
        except Unavailable:
            return None  # the caller falls back to the unit files
        # ExecStart is a(sasbttttuii): (path, argv, ignore failure, timestamps…, pid, status)
        return UnitExec(argv=tuple(str(w) for w in commands[-1][1]),
                        environment=dict(_split_env(str(e)) for e in environment),
                        environment_files=tuple(str(path) for path, _ in files))

    def main_process(self, unit: str) -> MainProcess | None:
        """The unit's running main process and when systemd started it; None where systemd
        cannot be asked, or the unit is not active with a main process."""
        try:
            if (self._unit_state(unit, "LoadState") != "loaded"
                    or self._unit_state(unit, "ActiveState") != "active"):
                return None
            pid = int(self._property(unit, SERVICE_INTERFACE, "MainPID"))
            started = int(self._property(unit, SERVICE_INTERFACE, "ExecMainStartTimestamp"))
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
            self._request("systemd", "reload", lambda bus: bus.call(
                MANAGER_PATH, MANAGER_INTERFACE, "Reload"), again=False)
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
        self._request(unit, verb, lambda bus: bus.call(
            _unit_path(unit), UNIT_INTERFACE, method, "s", ("replace",)), again=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self._property(unit, UNIT_INTERFACE, "Job")
            if job[0] == 0:  # the job is done (Type=notify: after READY)
                state = self._unit_state(unit, "ActiveState")
                if state == "active":
                    return
                # e.g. "activating (auto-restart)": it failed and Restart= is trying again
                sub = self._unit_state(unit, "SubState")
                raise SystemdError(unit, verb, f"it is {state} ({sub}) after the {verb}")
            time.sleep(0.05)
        raise SystemdError(unit, verb, f"the {verb} job did not finish within {timeout:g} s")


def _unit_path(unit: str) -> str:
    """The unit's object path, as sd-bus escapes it (systemd loads the unit when asked)."""
    escaped = "".join(c if c.isascii() and c.isalnum() else f"_{ord(c):02x}"
                      for c in unit) if unit else "_"
    if escaped[0].isdigit():
        escaped = f"_{ord(escaped[0]):02x}" + escaped[1:]
    return f"/org/freedesktop/systemd1/unit/{escaped}"


def _split_env(assignment: str) -> tuple[str, str]:
    key, _, value = assignment.partition("=")
    return key, value


def for_host(is_live: bool) -> Systemd:
    return DbusSystemd() if is_live else NoSystemd()
