"""The one way gpunode runs an external program: argv only (no shell), bounded in time, and a
failure that keeps the command, its exit code and its stderr.

Programs are started with os.posix_spawnp and read with select.poll, not through
`subprocess`: importing it (with selectors, threading and locale) cost ~3 ms of the first
boot's critical path, where the containerd probes start. What subprocess.Popen did for
gpunode is done here alike: the program is looked up on PATH, gets gpunode's environment and
stdin, its stdout and stderr are pipes read to the end, SIGPIPE and SIGXFSZ are back to their
defaults in it (Python ignores them; Popen's restore_signals), and its output is text as
Popen's text mode decodes it (the locale's encoding, universal newlines); stdout that is not
is a CommandFailed, not the UnicodeDecodeError Popen raised, and stderr keeps what it can.
Every descriptor gpunode opens is close-on-exec (PEP 446), so the program inherits none.
"""

from __future__ import annotations

import io
import os
import time

from gpunode.errors import CommandFailed

# typing for type checkers only (docs/design.md, the boot path): collections.abc's names, and
# contextlib, would import collections and functools before entry.py starts containerd's probe
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

_CHUNK = 1 << 16


def run(argv: Sequence[str], timeout: float = 30.0) -> str:
    """stdout of the command; CommandFailed when it cannot start, fails or runs too long."""
    return Started(argv, timeout).result()


class Started:
    """A program started now, its result asked for later, so that two can run side by side
    (the containerd probes: ~15 ms and ~30 ms of the first boot's critical path one after the
    other). `run` is one started and waited for at once."""

    def __init__(self, argv: Sequence[str], timeout: float = 30.0,
                 env: Mapping[str, str] | None = None, own_session: bool = False) -> None:
        """`env`: variables set for the program over gpunode's own environment; `own_session`:
        the program leads a session of its own (setsid). A kernel that shares the CPUs between
        sessions (CONFIG_SCHED_AUTOGROUP, on in Flatcar's; it applies to tasks outside any
        cpu cgroup, as in the real-systemd harness) gives it a share of its own: a program run
        beside gpunode's own work then takes its time from the whole machine, not half of
        gpunode's. Where the cpu controller weighs the service's cgroup instead, the session
        changes nothing."""
        self.argv = list(argv)
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        self._error: CommandFailed | None = None
        self.pid: int | None = None
        self.returncode: int | None = None  # once reaped
        self._output: dict[int, bytearray] = {}  # stdout's and stderr's read ends: so far
        self._open: set[int] = set()  # the read ends not at their end yet
        # _signal, not signal: Python imported it at its start, where signal (its enums made
        # at import, ~1.1 ms) would be on a first boot's critical path, at its first probe
        import _signal

        out, err = os.pipe(), os.pipe()  # (read, write), close-on-exec both
        try:  # SIGPIPE and SIGXFSZ: ignored by Python, and an ignored signal survives exec
            environment = {**os.environ, **env} if env else os.environ
            self.pid = os.posix_spawnp(self.argv[0], self.argv, environment, file_actions=[
                (os.POSIX_SPAWN_DUP2, out[1], 1), (os.POSIX_SPAWN_DUP2, err[1], 2)],
                setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ), setsid=own_session)
        except OSError as exc:
            self._error = CommandFailed(argv, None, exc.strerror or str(exc),
                                        "could not be started")
            os.close(out[0])
            os.close(err[0])
        else:
            self._stdout, self._stderr = out[0], err[0]
            self._output = {out[0]: bytearray(), err[0]: bytearray()}
            self._open = {out[0], err[0]}
        finally:
            os.close(out[1])
            os.close(err[1])

    def extend(self, timeout: float) -> None:
        """At least `timeout` seconds from now to answer: a program started early and asked
        late (after a wait for the node lock) still has its own bound."""
        self._deadline = max(self._deadline, time.monotonic() + timeout)

    def result(self) -> str:
        """stdout of the command (waiting for it, within what is left of its timeout)."""
        if self._error is not None:
            raise self._error
        if not self._read_until(self._deadline) or not self._reap(self._deadline):
            stderr = _text(bytes(self._output[self._stderr]))
            self.discard()
            raise CommandFailed(self.argv, None, stderr, f"timed out after {self._timeout:g} s")
        stderr = _text(bytes(self._output[self._stderr]))
        if self.returncode != 0:
            raise CommandFailed(self.argv, self.returncode, stderr)
        try:
            return _text(bytes(self._output[self._stdout]), strict=True)
        except UnicodeDecodeError as exc:
            raise CommandFailed(self.argv, None, stderr, "printed what is not text in this "
                                f"locale's encoding ({exc.reason} at byte {exc.start})") from None

    def discard(self) -> None:
        """Stop it if it still runs, and reap it (what it wrote is dropped: a child of its own
        that keeps the pipes open is not waited for)."""
        if self.pid is None or self.returncode is not None:
            return
        import _signal
        import contextlib  # here, not at the top: the header comment says why

        with contextlib.suppress(ProcessLookupError):  # it ended by itself: reaped below
            os.kill(self.pid, _signal.SIGKILL)
        for fd in self._open:
            os.close(fd)
        self._open.clear()
        self._reap(None)

    def _read_until(self, deadline: float) -> bool:
        """Read stdout and stderr to their ends; False when the deadline comes first."""
        import select

        poller = select.poll()
        for fd in self._open:
            poller.register(fd, select.POLLIN)
        while self._open:
            left = deadline - time.monotonic()
            ready = poller.poll(max(0.0, left) * 1000) if left > 0 else []
            if not ready and time.monotonic() >= deadline:
                return False
            for fd, _ in ready:
                chunk = os.read(fd, _CHUNK)
                if chunk:
                    self._output[fd] += chunk
                else:
                    poller.unregister(fd)
                    self._open.discard(fd)
                    os.close(fd)
        return True

    def _reap(self, deadline: float | None) -> bool:
        """Wait for the program's exit (its output has ended, or it was killed): False when
        it still runs at `deadline` (None: wait as long as it takes)."""
        assert self.pid is not None
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG if deadline is not None else 0)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif deadline is not None and time.monotonic() >= deadline:
                return False
            else:
                time.sleep(0.0005)
        return True


def _text(output: bytes, strict: bool = False) -> str:
    """Output as Popen's text mode gives it: universal newlines, and `strict` in the
    locale's encoding (UTF-8 on a node) as Popen decodes; else (stderr, for a message) UTF-8
    with what is not replaced."""
    if not strict:
        return output.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return io.TextIOWrapper(io.BytesIO(output)).read()
