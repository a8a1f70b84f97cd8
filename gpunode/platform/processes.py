"""Which daemons run on the host and when it booted, read from the host's /proc.

The kernel's own short name of a process (`/proc/PID/comm`, at most 15 characters: enough for
"containerd" and "kubelet") and the boot time (`btime` in `/proc/stat`) are all status needs;
when containerd started is systemd's to say (status.DaemonStart), not /proc's. Everything is
read through the Host, so a FIFO, garbage or a vanished process under --root or on a live host
is "not running" or "unknown", never a crash or a wait.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.errors import GpunodeError
from gpunode.platform.host import Host
from gpunode.platform.integers import parse_uint


@dataclass(frozen=True)
class ProcessFacts:
    """Which of the named daemons run on the host, and when it booted, as /proc says."""

    boot_time: float | None  # seconds since the epoch; None when /proc/stat does not say
    running: dict[str, list[int]]  # process name → pids (empty when not running)


def observe(host: Host, names: tuple[str, ...]) -> ProcessFacts:
    running: dict[str, list[int]] = {name: [] for name in names}
    pids = sorted(p for p in (parse_uint(e) for e in host.list_dir("/proc")) if p is not None)
    for pid in pids:
        name = _read(host, f"/proc/{pid}/comm")
        if name is not None and name.strip() in running:
            running[name.strip()].append(pid)
    return ProcessFacts(boot_time=_boot_time(_read(host, "/proc/stat")), running=running)


def _boot_time(text: str | None) -> float | None:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "btime":
            seconds = parse_uint(value.strip())
            return float(seconds) if seconds is not None else None
    return None


def _read(host: Host, path: str) -> str | None:
    """The file's text; None when it is absent, unreadable or not a regular file (a process
    that exited between the listing and the read is simply not running)."""
    try:
        return host.read_optional(path, limit=1 << 16)
    except GpunodeError:
        return None
