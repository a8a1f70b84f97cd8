"""gpunode's weight on the CPUs while a GPU node's boot keeps containerd waiting.

A kernel built with CONFIG_SCHED_AUTOGROUP (Flatcar's is: flatcar/scripts, coreos-modules
commonconfig) weighs the tasks outside any cpu cgroup by session, one share each (sched(7),
"The autogroup feature"). systemd starts every service in a session of its own, so while
gpunode works out the node on its first boot, logind, dbus, journald, PID 1 and gpunode's own
containerd probe each had as much of the CPUs as gpunode, though only gpunode keeps
containerd and the kubelet from starting. So a GPU node's boot raises the weight of its
session (`raise_for_boot`: autogroup nice BOOST, ~9x the default weight) and gives it back
(`give_back`) as soon as containerd may start (READY=1), and before a driver build, whose
minutes of compiling must not crowd out the rest of the node. In the real-systemd harness
(2 CPUs, no cpu controller: autogroup applies) this moved gpunode's READY=1 from 69 to 58 ms
after its start (medians of 12 first boots each, alternating), and its time runnable but not
running (/proc/self/schedstat at READY=1) from 21 to 10 ms, most of that now before the raise:
Python's own start.

Only where gpunode leads its session: a service does, while `gpunode boot` typed at a terminal
would raise the operator's whole session. A kernel without autogroup has no file, and one
refuses a process without CAP_SYS_NICE: the boot then runs unweighted, as it did before, with
nothing to report. Where the service's tasks are in a cpu cgroup the kernel weighs the cgroup
and ignores the value. Only `os`: raise_for_boot runs before the boot's imports.
"""

from __future__ import annotations

import os

AUTOGROUP = "/proc/self/autogroup"  # "/autogroup-<id> nice <n>\n"; writing "<n>" sets it
BOOST = -10  # weight 9548 against nice 0's 1024 (kernel/sched/core.c sched_prio_to_weight)
_given: list[int] = []  # the nice value raise_for_boot replaced, while it is raised


def raise_for_boot(root: str) -> None:
    """Give this process's session BOOST: only on the live root (`root` resolved), where it
    leads its session and the kernel lets it."""
    if root != "/" or _given or os.getsid(0) != os.getpid():
        return
    try:
        with open(AUTOGROUP, "rb") as file:
            before = int(file.read().split()[-1])
        if before <= BOOST:
            return
        _write(BOOST)
    except (OSError, ValueError, IndexError):
        return
    _given.append(before)


def give_back() -> None:
    """The nice value raise_for_boot replaced, again; nothing if it raised none."""
    if not _given:
        return
    try:
        _write(_given.pop())
    except OSError:  # without CAP_SYS_ADMIN one change per 100 ms (kernel/sched/autogroup.c)
        return  # the session keeps BOOST until gpunode, which leads it, exits


def _write(nice: int) -> None:
    fd = os.open(AUTOGROUP, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)  # as `echo n >` does
    try:
        os.write(fd, str(nice).encode())
    finally:
        os.close(fd)
