"""The one way gpunode runs an external program: argv only (no shell), bounded in time, and a
failure that keeps the command, its exit code and its stderr. `subprocess` (with selectors,
signal, threading and locale, ~5 ms) is imported by the first program started: a boot or a
`status` that runs none does without it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpunode.errors import CommandFailed

if TYPE_CHECKING:
    import subprocess


def run(argv: Sequence[str], timeout: float = 30.0) -> str:
    """stdout of the command; CommandFailed when it cannot start, fails or runs too long."""
    return Started(argv, timeout).result()


class Started:
    """A program started now, its result asked for later, so that two can run side by side
    (the containerd probes: ~15 ms and ~30 ms of the first boot's critical path one after the
    other). `run` is one started and waited for at once."""

    def __init__(self, argv: Sequence[str], timeout: float = 30.0) -> None:
        self.argv = list(argv)
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        self._error: CommandFailed | None = None
        self._process: subprocess.Popen[str] | None = None
        import subprocess

        try:
            self._process = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            self._error = CommandFailed(argv, None, exc.strerror or str(exc),
                                        "could not be started")

    def result(self) -> str:
        """stdout of the command (waiting for it, within what is left of its timeout)."""
        if self._error is not None:
            raise self._error
        assert self._process is not None
        import subprocess

        try:
            out, err = self._process.communicate(timeout=max(0.0, self._deadline -
                                                             time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            self.discard()
            raise CommandFailed(self.argv, None, _text(exc.stderr),
                                f"timed out after {self._timeout:g} s") from exc
        if self._process.returncode != 0:
            raise CommandFailed(self.argv, self._process.returncode, err)
        return out

    def discard(self) -> None:
        """Stop it if it still runs, and reap it."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.communicate()


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
