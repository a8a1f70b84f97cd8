"""Which daemons run on the host and when it booted, through psutil reading the host's /proc."""

from __future__ import annotations

import stat
from dataclasses import dataclass

from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.integers import parse_uint


@dataclass(frozen=True)
class ProcessFacts:
    boot_time: float | None  # seconds since the epoch
    running: dict[str, list[int]]  # process name → pids (empty when not running)
    started: dict[str, float]  # process name → start time of its oldest process (epoch)


# The files psutil reads for a process's name and start time, and for the boot time. On a live
# host the kernel makes them; under --root they are a tree's files, and psutil's plain open()
# of a FIFO there would block: each is checked to be a regular file (or absent) first.
_PROCESS_FILES = ("stat", "status", "comm", "cmdline")


def observe(host: Host, names: tuple[str, ...]) -> ProcessFacts:
    """Which of `names` run and since when. A process whose /proc files psutil cannot parse
    (garbage, vanished, denied) is counted as running when its name can be read, with its
    start unknown; a /proc/stat without a usable btime makes the boot time unknown."""
    import psutil  # ~50 ms to import; only status needs it

    # psutil reads a module-wide procfs path; pointing it at the host root keeps --root honest.
    psutil.PROCFS_PATH = str(host.path("/proc"))
    running: dict[str, list[int]] = {name: [] for name in names}
    started: dict[str, float] = {}
    # Listing pids here, not with psutil.pids(), because psutil fails on a /proc with no pids.
    pids = sorted(p for p in (parse_uint(e) for e in host.list_dir("/proc")) if p is not None)
    # psutil reads /proc/stat (btime) for every start time, even inside Process(): a FIFO there
    # would block, so without a regular /proc/stat no psutil call is made at all.
    stat_ok = _readable(host, "/proc", ("stat",))
    for pid in pids:
        process = None
        if stat_ok and _readable(host, f"/proc/{pid}", _PROCESS_FILES):
            try:
                process = psutil.Process(pid)
                name = process.name()
            except (psutil.Error, OSError, ValueError, LookupError, TypeError):
                process = None
        if process is None:
            name = _comm(host, pid)  # psutil could not parse it: the kernel's own short name
        if name not in running:
            continue
        running[name].append(pid)
        if process is None:
            continue  # running, but since when cannot be told
        try:
            start = float(process.create_time())
        except (psutil.Error, OSError, ValueError, LookupError, TypeError, OverflowError):
            continue
        started[name] = min(started.get(name, float("inf")), start)
    boot_time: float | None = None
    if stat_ok:
        try:
            boot_time = float(psutil.boot_time())
        except (psutil.Error, OSError, RuntimeError, ValueError, LookupError, TypeError):
            boot_time = None  # no /proc/stat, or no usable btime in it: status says "unknown"
    return ProcessFacts(boot_time=boot_time, running=running, started=started)


def _comm(host: Host, pid: int) -> str | None:
    try:
        text = host.read_optional(f"/proc/{pid}/comm", limit=4096)
    except GpunodeError:
        return None
    return text.strip() if text else None


def _readable(host: Host, directory: str, files: tuple[str, ...]) -> bool:
    """Every file psutil may open there is a regular file or absent (never a FIFO)."""
    if host.is_live:
        return True
    try:
        stats = [host.stat(f"{directory}/{name}") for name in files]
    except GpunodeError:
        return False
    return all(st is None or stat.S_ISREG(st.st_mode) for st in stats)
