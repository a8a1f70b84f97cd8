"""The systemd adapter: what gpunode asks of the service manager, over D-Bus (pystemd).

Under `--root` there is no service manager for that tree: `NoSystemd` answers that no unit
runs, so nothing is restarted; a live host gets `DbusSystemd`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from gpunode.errors import GpunodeError


class SystemdError(GpunodeError):
    """A request to systemd failed: which unit, what was asked, and what systemd said."""

    def __init__(self, unit: str, action: str, reason: str, hint: str = "") -> None:
        self.unit = unit
        self.action = action
        self.reason = reason
        self.hint = hint or f"see 'systemctl status {unit}' and 'journalctl -u {unit}'"
        super().__init__(f"Failed to {action} '{unit}': {reason}")


@dataclass(frozen=True)
class UnitExec:
    argv: tuple[str, ...]  # ExecStart as systemd stores it (variables not yet expanded)
    environment: dict[str, str]


class Systemd(Protocol):
    def active_state(self, unit: str) -> str: ...

    def enabled(self, unit: str) -> bool: ...

    def exec_start(self, unit: str) -> UnitExec | None: ...

    def daemon_reload(self) -> None: ...

    def restart(self, unit: str, timeout: float) -> None: ...


class NoSystemd:
    """No service manager owns this tree (a fixture or a mounted image): nothing runs."""

    def active_state(self, unit: str) -> str:
        return "inactive"

    def enabled(self, unit: str) -> bool:
        return False

    def exec_start(self, unit: str) -> UnitExec | None:
        return None

    def daemon_reload(self) -> None:
        return None

    def restart(self, unit: str, timeout: float) -> None:
        raise SystemdError(unit, "restart", "no systemd manages this root")


class DbusSystemd:
    """systemd over its D-Bus API; pystemd is imported on first use only."""

    def _unit(self, unit: str) -> Any:
        from pystemd.systemd1 import Unit

        handle = Unit(unit.encode())
        handle.load()
        return handle

    def active_state(self, unit: str) -> str:
        return str(self._unit(unit).Unit.ActiveState.decode())

    def enabled(self, unit: str) -> bool:
        state = self._unit(unit).Unit.UnitFileState.decode()
        return state in ("enabled", "enabled-runtime", "static", "alias")

    def exec_start(self, unit: str) -> UnitExec | None:
        """None where systemd cannot be asked (no system bus) or has no such unit."""
        from pystemd.dbusexc import DBusBaseError

        try:
            handle = self._unit(unit)
        except DBusBaseError:
            return None  # no systemd on this bus: the caller falls back to the unit files
        if handle.Unit.LoadState != b"loaded":
            return None
        commands = handle.Service.ExecStart
        if not commands:
            return None
        argv = tuple(w.decode() for w in commands[-1][1])
        env = dict(_split_env(e.decode()) for e in handle.Service.Environment)
        return UnitExec(argv=argv, environment=env)

    def daemon_reload(self) -> None:
        from pystemd.systemd1 import Manager

        manager = Manager()
        manager.load()
        manager.Manager.Reload()

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


def _split_env(assignment: str) -> tuple[str, str]:
    key, _, value = assignment.partition("=")
    return key, value


def for_host(is_live: bool) -> Systemd:
    return DbusSystemd() if is_live else NoSystemd()
