"""Support for the hostile-input suite: each case is one bad input and the one refusal a user
must see.

A case runs the real command line in-process (`gpunode.cli.main.main`) with `--log-format json`,
under a wall-clock alarm so a hang fails instead of blocking the suite, and then asserts what
the issue's contract says every refusal looks like:

- the documented exit code;
- no traceback, and every stderr line is one JSON object (journald gets JSON);
- exactly one error event, whose `error` matches the case's pattern;
- every file under the root exactly as it was (content, mode, owner, link target), and no
  `*.gpunode-tmp` left behind.

Cases that are not refusals (a command that must now *succeed* on an odd input) use `cli()`
directly and assert what the user sees.

tests/hostile/ mixes markers: most cases are in-process unit cases, and the few that need a
real process or socket carry @pytest.mark.integration themselves (tests/conftest.py's
collection rule marks only tests/integration/ and polices only tests/unit/).
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpunode import log
from gpunode.cli.main import main

HANG_SECONDS = 10


class Hang(BaseException):
    """Raised by the alarm: the command blocked (a FIFO, a lock, a socket)."""


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    @property
    def events(self) -> list[dict[str, object]]:
        """stderr as JSON lines; a line that is not JSON fails the test that asks."""
        events = []
        for line in self.err.splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                raise AssertionError(f"stderr line is not JSON: {line!r}\n{self.err}") from None
            assert isinstance(event, dict), line
            events.append(event)
        return events

    @property
    def errors(self) -> list[dict[str, object]]:
        return [e for e in self.events if e.get("level") == "error"]


def _on_alarm(signum: int, frame: object) -> None:
    raise Hang(f"the command did not finish within {HANG_SECONDS} s")


Cli = Callable[..., Result]


def make_cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """cli(*argv) → Result: the command line in-process, JSON logs, bounded in time."""

    def run(*argv: str) -> Result:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(HANG_SECONDS)
        try:
            try:
                code = main(["--log-format", "json", *argv])
            except SystemExit as exc:  # argparse's own exits
                code = exc.code if isinstance(exc.code, int) else 2
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            log.configure("json")
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return Result(code, out, err)

    return run


# The node lock (platform/nodelock.py, and the directories it is made in) is made by a command
# that may change the node once it has started its work, refused there or not; it holds no
# state, so it is not a change. A usage or agent-config refusal (exit 2) comes before any work
# and takes no lock: check_refusal then counts the lock as a change like any other file.
NOT_STATE = ("run", "run/gpunode", "run/gpunode/lock")
EXIT_USAGE = 2


def snapshot(root: Path, hidden: tuple[str, ...] = NOT_STATE) -> dict[str, tuple[object, ...]]:
    """Every entry under `root` but `hidden`: type, mode, owner and content or link target."""
    seen: dict[str, tuple[object, ...]] = {}
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(directory, name)
            if str(path.relative_to(root)) in hidden:
                continue
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                what: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                what = path.read_bytes() if st.st_size <= 1 << 22 else (st.st_size, st.st_mtime_ns)
            else:
                what = st.st_rdev
            seen[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                                 st.st_uid, st.st_gid, what)
    return seen


def assert_unchanged(root: Path, before: dict[str, tuple[object, ...]],
                     hidden: tuple[str, ...] = NOT_STATE) -> None:
    after = snapshot(root, hidden)
    temps = [p for p in after if p.endswith(".gpunode-tmp")]
    assert not temps, f"temp files left behind: {temps}"
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"files changed by a refused command: {changed}"


def assert_refused(result: Result, code: int, pattern: str) -> None:
    """The documented exit code and exactly one error event matching `pattern`."""
    errors = result.errors
    assert result.code == code, (result.code, result.err)
    assert len(errors) == 1, f"expected one error event, got {errors}"
    message = f"{errors[0].get('error', '')} {errors[0].get('hint', '')}"
    assert re.search(pattern, message), f"{pattern!r} not in {message!r}"


def check_refusal(cli: Cli, root: Path, argv: list[str], code: int, pattern: str) -> Result:
    """Run `argv` against `root` and assert the whole refusal contract (module docstring)."""
    hidden = () if code == EXIT_USAGE else NOT_STATE
    before = snapshot(root, hidden)
    result = cli(*argv)
    assert_refused(result, code, pattern)
    assert_unchanged(root, before, hidden)
    return result


# What may stand where a file is expected (/dev/kmsg under --root, and others): one maker each.
def make_directory(path: Path) -> None:
    path.mkdir()


def make_link_out(path: Path) -> None:
    """A relative link that climbs above the root, to a file of this machine."""
    path.symlink_to("../" * 30 + "proc/self/status")


def make_loop(path: Path) -> None:
    path.symlink_to(path.name)


def make_absent(path: Path) -> None:
    pass
