"""The one way gpunode runs an external program: argv only (no shell), bounded in time, and a
failure that keeps the command, its exit code and its stderr. `subprocess` (with selectors,
signal, threading and locale, ~5 ms) is imported by the first program started: a boot or a
`status` that runs none does without it."""

from __future__ import annotations

import contextlib
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

    def kill(self) -> None:
        """Stop it if it still runs; whoever waits in result() reaps it (Series.discard)."""
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(OSError):
                self._process.kill()


class Series:
    """Programs run one after the other, each started as the one before it ends (by a thread
    of their own), their results asked for later. Side by side, two of containerd's Go
    programs and gpunode's own work oversubscribe a 2-CPU node; one after the other they run
    on the CPU gpunode leaves idle (boot's early probes, containerd/locate.py). Each keeps its
    own timeout from its own start."""

    def __init__(self, commands: Sequence[tuple[Sequence[str], float]]) -> None:
        import threading

        self._lock = threading.Lock()
        self._programs = [(tuple(argv), timeout, threading.Event()) for argv, timeout in commands]
        self._untaken = {argv: ended for argv, _, ended in self._programs}
        self._outcomes: dict[tuple[str, ...], str | BaseException] = {}
        self._running: Started | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run_all, name="gpunode-series",
                                        daemon=True)
        self._thread.start()

    def __contains__(self, argv: Sequence[str]) -> bool:
        return tuple(argv) in self._untaken

    def _run_all(self) -> None:
        try:
            for argv, timeout, ended in self._programs:
                try:
                    with self._lock:
                        if self._stopped:
                            return
                        self._running = started = Started(argv, timeout)
                    self._outcomes[argv] = started.result()
                except BaseException as exc:  # the asker's to raise, in its own thread
                    self._outcomes[argv] = exc
                ended.set()
        finally:
            for _, _, ended in self._programs:  # nobody waits for what never starts
                ended.set()

    def take(self, argv: Sequence[str]) -> str:
        """stdout of that program (waiting for it), as Started.result() gives it; asked once."""
        key = tuple(argv)
        self._untaken.pop(key).wait()
        outcome = self._outcomes.pop(key, None)
        if outcome is None:
            raise CommandFailed(argv, None, "", "was stopped before it started")
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def discard(self) -> None:
        """Stop the one running and start no other; back when the thread has ended."""
        with self._lock:
            self._stopped = True
            running = self._running
        if running is not None:
            running.kill()
        self._thread.join()


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
