"""Which daemons run on the host and when it booted, through psutil reading the host's /proc."""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.host import Host


@dataclass(frozen=True)
class ProcessFacts:
    boot_time: float | None  # seconds since the epoch
    running: dict[str, list[int]]  # process name → pids (empty when not running)
    started: dict[str, float]  # process name → start time of its oldest process (epoch)


def observe(host: Host, names: tuple[str, ...]) -> ProcessFacts:
    import psutil  # ~50 ms to import; only status needs it

    # psutil reads a module-wide procfs path; pointing it at the host root keeps --root honest.
    psutil.PROCFS_PATH = str(host.path("/proc"))
    running: dict[str, list[int]] = {name: [] for name in names}
    started: dict[str, float] = {}
    # Listing pids here, not with psutil.pids(), because psutil fails on a /proc with no pids.
    for pid in (int(e) for e in host.list_dir("/proc") if e.isdigit()):
        try:
            process = psutil.Process(pid)
            name = process.name()
            if name in running:
                running[name].append(pid)
                started[name] = min(started.get(name, float("inf")), process.create_time())
        except psutil.NoSuchProcess:
            continue  # it exited between the listing and the read: it is not running
    try:
        boot_time: float | None = psutil.boot_time()
    except (OSError, RuntimeError):
        boot_time = None  # a /proc without /proc/stat (a bare fixture): status shows "unknown"
    return ProcessFacts(boot_time=boot_time, running=running, started=started)
