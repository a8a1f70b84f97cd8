"""The one way gpunode runs an external program: argv only (no shell), bounded in time, and a
failure that keeps the command, its exit code and its stderr."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from gpunode.errors import CommandFailed


def run(argv: Sequence[str], timeout: float = 30.0) -> str:
    """stdout of the command; CommandFailed when it cannot start, fails or runs too long."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise CommandFailed(argv, None, _text(exc.stderr),
                            f"timed out after {timeout:g} s") from exc
    except OSError as exc:
        raise CommandFailed(argv, None, exc.strerror or str(exc), "could not be started") from exc
    if done.returncode != 0:
        raise CommandFailed(argv, done.returncode, done.stderr)
    return done.stdout


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
