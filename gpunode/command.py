"""The one way gpunode runs an external program: argv only (no shell), bounded in time, and a
failure that keeps the command, its exit code and its stderr."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from gpunode.errors import GpunodeError


class CommandFailed(GpunodeError):
    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        status = "timed out" if returncode is None else f"exited {returncode}"
        tail = stderr.strip().splitlines()[-3:]
        super().__init__(f"'{' '.join(self.argv)}' {status}" + (f": {' / '.join(tail)}"
                                                                  if tail else ""))


def run(argv: Sequence[str], timeout: float = 30.0) -> str:
    """stdout of the command; CommandFailed when it cannot start, fails or runs too long."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise CommandFailed(argv, None, str(exc.stderr or "")) from exc
    except OSError as exc:
        raise CommandFailed(argv, None, exc.strerror or str(exc)) from exc
    if done.returncode != 0:
        raise CommandFailed(argv, done.returncode, done.stderr)
    return done.stdout
