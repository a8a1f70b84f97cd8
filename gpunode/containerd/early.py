"""containerd's `--version`, started at the very start of a GPU node's boot.

The containerd step cannot plan without containerd's version (the schema it reads the config
with), and the Go program takes ~17 ms to answer on an idle 2-CPU machine, ~20 to 50 ms while
systemd starts the rest of the boot beside it. Started when boot has located containerd (after
detect), the step still waited ~11 ms for it (median of the real-systemd harness, up to ~50 ms
on a busy one): gpunode's own imports and steps before it are shorter than the program. So
entry.py starts it as soon as it knows the boot is a GPU node's on the live root, before its
imports: the program it guesses, Flatcar's (containerd.service runs /usr/bin/containerd; the
unit's ExecStart is only read later, over D-Bus). probe.CommandProbe takes the started program
when the located binary is the guessed one, and stops and reaps it otherwise, at the end of the
boot at the latest (entry.run). Only this module, command.py and the standard library are
imported for it: nothing the boot would not import anyway.
"""

from __future__ import annotations

import os

from gpunode.platform import command

BINARY = "/usr/bin/containerd"  # Flatcar's containerd.service, and what a unit without one runs
VERSION_TIMEOUT = 10.0
# The probes run without Go's garbage collector (GOGC=off; GOMEMLIMIT, Go 1.19+, still
# collects near the bound, far above what either allocates): each program only starts,
# answers and exits, and the collections during containerd's start were a fifth of
# `--version` (29.7 → 23.8 ms here) and more than a fourth of `config dump`
# (54.3 → 39.3 ms), which run on a GPU node's first boot, mostly on its critical path.
PROBE_ENV = {"GOGC": "off", "GOMEMLIMIT": "512MiB"}
_started: dict[tuple[str, ...], command.Started] = {}


def started(argv: tuple[str, ...], timeout: float) -> command.Started:
    """A containerd probe, started now: in PROBE_ENV and in a session of its own (setsid), so
    that the Go program, run beside gpunode's imports and steps, does not take its CPU time
    from gpunode's share (command.Started; in the real-systemd harness on 2 CPUs this moved
    gpunode's READY=1 from 80 to 71 ms after its start, medians of 10 first boots each)."""
    return command.Started(argv, timeout, PROBE_ENV, own_session=True)


def version_argv(binary: str) -> tuple[str, ...]:
    return (binary, "--version")


def start(root: str) -> None:
    """`BINARY --version`, started now: only on the live root (`root` resolved), and only where
    BINARY is an executable regular file (anything else is for the step to find and report)."""
    if root != "/" or _started:
        return
    try:
        if not (os.path.isfile(BINARY) and os.access(BINARY, os.X_OK)):
            return
    except (OSError, ValueError):
        return
    argv = version_argv(BINARY)
    _started[argv] = started(argv, VERSION_TIMEOUT)


def take(argv: tuple[str, ...]) -> command.Started | None:
    """The program started early with exactly `argv`, now the caller's, with VERSION_TIMEOUT
    from now (the boot may have waited for the node lock since); None if none was."""
    started = _started.pop(argv, None)
    if started is not None:
        started.extend(VERSION_TIMEOUT)
    return started


def discard() -> None:
    """Stop and reap what was started early and never taken."""
    for started in _started.values():
        started.discard()
    _started.clear()
