"""What gpunode asks the node's containerd binary itself (its version, and its own reading of a
config with the defaults it fills in), kept apart so that tests and `--root` can say "nobody
can be asked"."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from gpunode import command, log
from gpunode.containerd import edit
from gpunode.errors import GpunodeError


class Probe(Protocol):
    """What gpunode asks the containerd binary itself; None where it cannot be asked."""

    def version(self, binary: str) -> tuple[int, int] | None: ...

    def dump(self, binary: str, path: str) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class CommandProbe:
    """Runs the node's containerd (`binary_override`: a test's real containerd instead)."""

    binary_override: str | None = None

    def version(self, binary: str) -> tuple[int, int] | None:
        binary = self.binary_override or binary
        try:
            line = command.run([binary, "--version"], 10)
        except GpunodeError as exc:
            log.get().warning("containerd.version_unknown", exc=exc)
            return None
        match = re.search(r"\s(\d+)\.(\d+)\.\d+", line)
        return (int(match.group(1)), int(match.group(2))) if match else None

    def dump(self, binary: str, path: str) -> dict[str, Any] | None:
        """containerd's own reading of the file, with the defaults it fills into runc."""
        binary = self.binary_override or binary
        try:
            return edit.parse(command.run([binary, "--config", path, "config", "dump"], 20),
                              f"{binary} config dump")
        except GpunodeError as exc:
            log.get().warning("containerd.dump_unavailable", exc=exc,
                              effect="the runtime is copied from the file alone")
            return None


class NoProbe:
    """Under --root the tree's containerd is not this machine's to run."""

    def version(self, binary: str) -> tuple[int, int] | None:
        return None

    def dump(self, binary: str, path: str) -> dict[str, Any] | None:
        return None
