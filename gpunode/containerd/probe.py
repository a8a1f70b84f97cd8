"""What gpunode asks the node's containerd binary itself (its version, and its own reading of a
config with the defaults it fills in), kept apart so that tests and `--root` can say "nobody
can be asked"."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpunode import log
from gpunode.containerd import edit
from gpunode.errors import GpunodeError
from gpunode.platform import command


class Probe(Protocol):
    """What gpunode asks the containerd binary itself; None where it cannot be asked."""

    def version(self, binary: str) -> tuple[int, int] | None: ...

    def dump(self, binary: str, path: str) -> dict[str, Any] | None: ...

    def prefetch(self, binary: str, path: str | None, version: bool = True) -> None: ...

    def discard(self) -> None: ...


VERSION_TIMEOUT = 10.0
DUMP_TIMEOUT = 20.0


@dataclass
class CommandProbe:
    """Runs the node's containerd (`binary_override`: a test's real containerd instead).

    `prefetch` starts `--version` (unless told not to) and, given a path, `config dump` at
    once, side by side; `version` and `dump` then take those results. Without it each runs
    when asked."""

    binary_override: str | None = None
    _started: dict[tuple[str, ...], command.Started] = field(default_factory=dict, repr=False)
    _versions: dict[str, tuple[int, int] | None] = field(default_factory=dict, repr=False)

    def prefetch(self, binary: str, path: str | None, version: bool = True) -> None:
        for argv in (self._version_argv(binary) if version else (),
                     self._dump_argv(binary, path) if path else ()):
            if argv and argv not in self._started:
                timeout = VERSION_TIMEOUT if len(argv) == 2 else DUMP_TIMEOUT
                self._started[argv] = command.Started(argv, timeout)

    def discard(self) -> None:
        """Stop and reap what was started and never asked for (a dump nobody needed)."""
        for started in self._started.values():
            started.discard()
        self._started.clear()

    def _run(self, argv: tuple[str, ...], timeout: float) -> str:
        started = self._started.pop(argv, None) or command.Started(argv, timeout)
        return started.result()

    def _version_argv(self, binary: str) -> tuple[str, ...]:
        return (self.binary_override or binary, "--version")

    def _dump_argv(self, binary: str, path: str) -> tuple[str, ...]:
        return (self.binary_override or binary, "--config", path, "config", "dump")

    def version(self, binary: str) -> tuple[int, int] | None:
        """containerd's major and minor version (asked once per binary)."""
        if binary not in self._versions:
            self._versions[binary] = self._ask_version(binary)
        return self._versions[binary]

    def _ask_version(self, binary: str) -> tuple[int, int] | None:
        try:
            line = self._run(self._version_argv(binary), VERSION_TIMEOUT)
        except GpunodeError as exc:
            log.get().warning("containerd.version_unknown", exc=exc)
            return None
        version = parse_version(line)
        if version is None:
            log.get().warning("containerd.version_unknown", binary=binary,
                              output=line.strip()[:200], reason="no version in its output",
                              effect="the change is judged for every containerd version")
        return version

    def dump(self, binary: str, path: str) -> dict[str, Any] | None:
        """containerd's own reading of the file, with the defaults it fills into runc."""
        argv = self._dump_argv(binary, path)
        try:
            return edit.parse(self._run(argv, DUMP_TIMEOUT), f"{argv[0]} config dump")
        except GpunodeError as exc:
            log.get().warning("containerd.dump_unavailable", exc=exc,
                              effect="the runtime is copied from the file alone")
            return None


def parse_version(line: str) -> tuple[int, int] | None:
    """Major and minor of a `containerd --version` line: upstream's and Flatcar's tag
    ("containerd github.com/containerd/containerd/v2 v2.1.5 fcd43222…": the ebuild builds
    with VERSION=v${PV}) or a distribution's ("… 1.6.20~ds1 1.6.20~ds1-1+deb12u3")."""
    match = re.search(r"\sv?(\d+)\.(\d+)\.\d+", line)
    return (int(match.group(1)), int(match.group(2))) if match else None


class NoProbe:
    """Under --root the tree's containerd is not this machine's to run."""

    def version(self, binary: str) -> tuple[int, int] | None:
        return None

    def dump(self, binary: str, path: str) -> dict[str, Any] | None:
        return None

    def prefetch(self, binary: str, path: str | None, version: bool = True) -> None:
        return None

    def discard(self) -> None:
        return None
