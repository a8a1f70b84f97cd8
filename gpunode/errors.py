"""The few exceptions gpunode raises; each carries what failed, where, and what to do.

`main()` turns any of them into one log event and an exit code, so nothing below the CLI
prints or exits on its own.
"""

from __future__ import annotations


class GpunodeError(Exception):
    """Base of every error gpunode reports on purpose: a message, and what to do (`hint`)."""

    code: str = "error"  # stable, kebab-case: what operators and tests match, never the wording
    hint: str = ""

    def __init__(self, message: str = "", hint: str = "") -> None:
        if hint:
            self.hint = hint
        super().__init__(message)


class ConfigError(GpunodeError):
    """The agent config file is unreadable or invalid (exit 2)."""

    def __init__(self, file: str, key: str | None, reason: str, line: int | None = None) -> None:
        self.file = file
        self.key = key
        self.reason = reason
        self.line = line
        where = file if line is None else f"{file}:{line}"
        what = f"key '{key}': " if key else ""
        super().__init__(f"{where}: {what}{reason}")


class FileError(GpunodeError):
    """A file's content is refused: '<file>[:<line>]: <reason>', and what to do about it."""

    def __init__(self, file: str, reason: str, line: int | None = None, hint: str = "") -> None:
        self.file = file
        self.reason = reason
        self.line = line
        self.hint = hint
        super().__init__(f"{file}{'' if line is None else f':{line}'}: {reason}")


class HostError(GpunodeError):
    """A read or write on the host tree failed: 'Failed to <op> '<path>': <reason>'."""

    def __init__(self, op: str, path: str, reason: str) -> None:
        self.op = op
        self.path = path
        self.reason = reason
        super().__init__(f"Failed to {op} '{path}': {reason}")


class DriverBuildError(GpunodeError):
    """Building the NVIDIA modules failed: 'Failed to <verb> '<object>': <cause>', and what to
    do about it. (Defined here, not in driver/build.py, so that driver/cache.py, build.py and
    builders.py, which all raise it, import no cycle.)"""

    code = "driver-build-failed"

    def __init__(self, verb: str, obj: str, cause: str, hint: str = "") -> None:
        self.verb = verb
        self.obj = obj
        self.cause = cause
        self.hint = hint
        super().__init__(f"Failed to {verb} '{obj}': {cause}")


class LockTimeout(HostError):
    """Another process held a lock file (Host.lock) past the wait; `note` is what it wrote."""

    code = "lock-timeout"

    def __init__(self, path: str, note: str, waited: float) -> None:
        self.note = note
        self.waited = waited
        holder = f" ({note.strip()})" if note.strip() else ""
        super().__init__("lock", path, f"another process{holder} holds it; gave up after "
                         f"waiting {waited:g} s")


class UsageError(GpunodeError):
    """The command line asks for something that cannot be done as asked (exit 2)."""
