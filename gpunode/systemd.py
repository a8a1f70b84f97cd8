"""The systemd adapter: what gpunode asks of the service manager, over D-Bus (pystemd).

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
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from gpunode.errors import SystemdError, Unavailable


@dataclass(frozen=True)
class UnitExec:
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


class DbusSystemd:
    """systemd over its D-Bus API; pystemd is imported on first use only."""

    # The first adapter of a process to find no bus says so; status and boot make several.
    warned: ClassVar[bool] = False

    def __init__(self) -> None:
        self.unavailable_reason: str | None = None

    @property
    def available(self) -> bool:
        """False once a call found no reachable system bus (then it is not asked again)."""
        return self.unavailable_reason is None

    def _connect(self, make: Any, name: str) -> Any:
        from pystemd.dbusexc import DBusBaseError

        if self.unavailable_reason is not None:
            raise Unavailable(name, "connect to", self.unavailable_reason)
        try:
            handle = make()
            handle.load()
        except DBusBaseError as exc:
            if not isinstance(exc, _unreachable()):
                raise SystemdError(name, "load", str(exc)) from exc
            self.unavailable_reason = f"no systemd on the system bus ({exc})"
            if DbusSystemd.warned:
                raise Unavailable(name, "connect to", self.unavailable_reason) from exc
            DbusSystemd.warned = True
            from gpunode import log

            log.get().warning("systemd.unavailable", reason=self.unavailable_reason,
                              effect="no unit is asked, reloaded or restarted; whoever runs "
                              "this tree must restart what needs the changes")
            raise Unavailable(name, "connect to", self.unavailable_reason) from exc
        return handle

    def _unit(self, unit: str) -> Any:
        from pystemd.systemd1 import Unit

        return self._connect(lambda: Unit(unit.encode()), unit)

    def active_state(self, unit: str) -> str:
        try:
            return str(self._unit(unit).Unit.ActiveState.decode())
        except Unavailable:
            return UNKNOWN

    def enabled(self, unit: str) -> bool:
        try:
            state = self._unit(unit).Unit.UnitFileState.decode()
        except Unavailable:
            return False
        return state in ("enabled", "enabled-runtime", "static", "alias")

    def exec_start(self, unit: str) -> UnitExec | None:
        """None where systemd cannot be asked (no system bus) or has no such unit."""
        try:
            handle = self._unit(unit)
        except Unavailable:
            return None  # the caller falls back to the unit files
        if handle.Unit.LoadState != b"loaded":
            return None
        commands = handle.Service.ExecStart
        if not commands:
            return None
        argv = tuple(w.decode() for w in commands[-1][1])
        env = dict(_split_env(e.decode()) for e in handle.Service.Environment)
        files = tuple(path.decode() for path, _ in handle.Service.EnvironmentFiles)
        return UnitExec(argv=argv, environment=env, environment_files=files)

    def main_process(self, unit: str) -> MainProcess | None:
        """The unit's running main process and when systemd started it; None where systemd
        cannot be asked, or the unit is not active with a main process."""
        from pystemd.dbusexc import DBusBaseError

        try:
            handle = self._unit(unit)
        except Unavailable:
            return None
        try:
            if handle.Unit.LoadState != b"loaded" or handle.Unit.ActiveState != b"active":
                return None
            pid = int(handle.Service.MainPID)
            started = int(handle.Service.ExecMainStartTimestamp)
        except DBusBaseError as exc:
            raise SystemdError(unit, "read the main process of", str(exc)) from exc
        if pid == 0 or started == 0:
            return None
        return MainProcess(pid=pid, started=started / 1_000_000)

    def daemon_reload(self) -> None:
        from pystemd.dbusexc import DBusBaseError
        from pystemd.systemd1 import Manager

        try:
            manager = self._connect(Manager, "systemd")
        except Unavailable:
            return  # nothing to reload: no manager has read the old files either
        try:
            manager.Manager.Reload()
        except DBusBaseError as exc:  # a timeout too: a manager that did not answer in time
            raise SystemdError("systemd", "reload", str(exc),
                               "see 'journalctl -b _PID=1'; 'systemctl daemon-reload' by hand, "
                               "then run gpunode again") from exc

    def restart(self, unit: str, timeout: float) -> None:
        """Restart and wait for the job to finish and the unit to be active again."""
        from pystemd.dbusexc import DBusBaseError

        handle = self._unit(unit)
        try:
            handle.Unit.Restart(b"replace")
        except DBusBaseError as exc:
            raise SystemdError(unit, "restart", str(exc)) from exc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if handle.Unit.Job[0] == 0:  # the restart job is done (Type=notify: after READY)
                state = handle.Unit.ActiveState.decode()
                if state == "active":
                    return
                # e.g. "activating (auto-restart)": it failed and Restart= is trying again
                sub = handle.Unit.SubState.decode()
                raise SystemdError(unit, "restart", f"it is {state} ({sub}) after the restart")
            time.sleep(0.05)
        raise SystemdError(unit, "restart", f"the restart job did not finish within {timeout:g} s")


def _unreachable() -> tuple[type[BaseException], ...]:
    """pystemd's errors that mean "nobody to ask", as opposed to a refusal by systemd."""
    from pystemd import dbusexc

    return (dbusexc.DBusFileNotFoundError, dbusexc.DBusConnectionRefusedError,
            dbusexc.DBusNoServerError, dbusexc.DBusBadAddressError,
            dbusexc.DBusDisconnectedError, dbusexc.DBusServiceUnknownError,
            dbusexc.DBusNameHasNoOwnerError)


def _split_env(assignment: str) -> tuple[str, str]:
    key, _, value = assignment.partition("=")
    return key, value


def for_host(is_live: bool) -> Systemd:
    return DbusSystemd() if is_live else NoSystemd()
