"""The one way gpunode runs an external program: argv only (no shell), bounded in time, and a
failure that keeps the command, its exit code and its stderr.

`Started` lets two programs run side by side (containerd's `--version` while the driver step
works, its `config dump` beside it); `run` is one started and waited for at once. Output that
is not text in the locale's encoding is a CommandFailed, never a UnicodeDecodeError.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from gpunode.errors import CommandFailed


def run(argv: Sequence[str], timeout: float = 30.0) -> str:
    """stdout of the command; CommandFailed when it cannot start, fails or runs too long."""
    return Started(argv, timeout).result()


class Started:
    """A program started now (stdin closed, stdout and stderr captured), its result asked for
    later."""

    def __init__(self, argv: Sequence[str], timeout: float = 30.0) -> None:
        self.argv = list(argv)
        self._timeout = timeout
        self._error: CommandFailed | None = None
        self._process: subprocess.Popen[bytes] | None = None
        try:
            self._process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            self._error = CommandFailed(self.argv, None, reason, "could not be started")

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    def result(self) -> str:
        """stdout of the command, waiting for it within its timeout."""
        if self._error is not None:
            raise self._error
        assert self._process is not None
        try:
            stdout, stderr = self._process.communicate(timeout=self._timeout)
        except subprocess.TimeoutExpired as exc:
            self.discard()
            raise CommandFailed(self.argv, None, _text(exc.stderr or b""),
                                f"timed out after {self._timeout:g} s") from None
        if self._process.returncode != 0:
            raise CommandFailed(self.argv, self._process.returncode, _text(stderr))
        try:
            return _text(stdout, strict=True)
        except UnicodeDecodeError as exc:
            raise CommandFailed(self.argv, None, _text(stderr), "printed what is not text in "
                                f"this locale's encoding ({exc.reason} at byte {exc.start})"
                                ) from None

    def discard(self) -> None:
        """Stop it if it still runs, and reap it; what it wrote is dropped (a child of its own
        that keeps the pipes open is not waited for)."""
        if self._process is None or self._process.returncode is not None:
            return
        self._process.kill()
        for pipe in (self._process.stdout, self._process.stderr):
            if pipe is not None:
                pipe.close()
        self._process.wait()


def _text(output: bytes, strict: bool = False) -> str:
    """Output as subprocess's text mode gives it (universal newlines); `strict`: in the
    locale's encoding, else UTF-8 with what is not replaced (stderr, for a message)."""
    if strict:
        import locale

        text = output.decode(locale.getpreferredencoding(False))
    else:
        text = output.decode(errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")
