"""NVRM Xid lines from /dev/kmsg records, and what each Xid means for the node: pure functions.

A /dev/kmsg record is `<prefix>;<message>` where the prefix is `<priority>,<sequence>,<usec
since boot>,<flags>[,…]` (the kernel's Documentation/ABI/testing/dev-kmsg); continuation lines
(` KEY=value`) follow the first line of a record. The driver writes an Xid as (NVIDIA
open-gpu-kernel-modules, src/nvidia/src/kernel/gpu/rc/kernel_rc.c, krcReportXid):

    NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, <message>
    NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u): %d, pid=…           (a MIG GPU instance)
    NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u): %d, …   (and compute instance)

with pid `'<unknown>'` and name `<unknown>` when no process is known. Older branches wrote
`NVRM: Xid (PCI:0000:01:00): 79, pid=1122, GPU has fallen off the bus.` (R450), or no pid at
all, `NVRM: Xid (PCI:0000:03:00): 79, GPU has fallen off the bus.` (R375, and R570+ for 79),
and the oldest `NVRM: Xid (0000:01:00): 3, C 00000005 …` without `PCI:`. The address is the
GPU's domain:bus:device; its function is 0. Once per GPU the driver also logs `NVRM: GPU at
PCI:0000:2b:00: GPU-0b11d014-…` (_krcLogUuidOnce), which names the UUID where /proc no longer
can (a GPU that fell off the bus).

Which Xids are fatal, and which are the application's own: the defaults are the facts of
issue 15 (docs/design.md): the fatal set of Node Problem Detector's GPU plugin, and the
application errors NVIDIA's device plugin ignores (k8s-device-plugin internal/rm/health.go:
13, 31, 43, 45, 68, 109). 68 is in both lists; the fatal set wins (`classify`), as a node
whose video engine faults is not one to send GPU pods to. Both sets are the agent config's
`watch.fatal_xids` and `watch.ignored_xids` (their defaults: gpunode/config.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpunode.gpu import driverinfo

FATAL = "fatal"
IGNORED = "ignored"
EVENT = "event"  # neither: a Node Event, rate-limited

FELL_OFF_BUS = 79
MAX_XID = 65535  # far above any code the driver has (nverror.h); a bigger number is garbage
MAX_TEXT = 256  # of the driver's message kept for a report

_PREFIX_RE = re.compile(r"(\d{1,3}),(\d{1,20}),(\d{1,20}),[^;]*")
_ADDRESS = r"(?:PCI:)?([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})"
_XID_RE = re.compile(r"NVRM: Xid \(" + _ADDRESS + r"((?: GPU-C?I:\d{1,3})*)\): (\d{1,6}),\s*(.*)")
_PID_RE = re.compile(r"pid=('<unknown>'|\d{1,10}|<unknown>),\s*(?:name=(.*?),\s*)?")
_UUID_RE = re.compile(r"NVRM: GPU at " + _ADDRESS + r": (GPU-[0-9a-fA-F-]{36})\s*$")


@dataclass(frozen=True)
class Record:
    """One /dev/kmsg record's first line: its sequence number, microseconds since boot and
    message."""

    seq: int
    usec: int
    message: str


@dataclass(frozen=True)
class Xid:
    """One Xid the driver logged for a GPU, as parsed from its kernel log record."""

    seq: int
    usec: int
    address: str  # the GPU's PCI function, lowercase: "0000:3b:00.0"
    code: int
    pid: int | None  # the process the driver names, None when it says '<unknown>' or nothing
    process: str | None
    text: str  # the driver's own words after the code, pid and name, at most MAX_TEXT
    instance: str = ""  # " GPU-I:01 GPU-CI:00" on a MIG GPU, else ""


def parse_record(raw: str) -> Record | None:
    """A /dev/kmsg record, or None for anything else (a continuation line, garbage)."""
    first = raw.split("\n", 1)[0]
    prefix, sep, message = first.partition(";")
    match = _PREFIX_RE.fullmatch(prefix) if sep else None
    if match is None:
        return None
    return Record(int(match.group(2)), int(match.group(3)), message.rstrip())


def parse_xid(record: Record) -> Xid | None:
    """The Xid a record reports, or None when it is not an NVRM Xid line the driver wrote."""
    match = _XID_RE.search(record.message)
    if match is None:
        return None
    code = int(match.group(3))
    if code > MAX_XID:
        return None
    rest = match.group(4)
    pid = process = None
    said = _PID_RE.match(rest)
    if said is not None:
        pid = int(said.group(1)) if said.group(1).isdigit() else None
        name = said.group(2)
        process = name if name and name != "<unknown>" else None
        rest = rest[said.end():]
    return Xid(seq=record.seq, usec=record.usec, address=match.group(1).lower() + ".0",
               code=code, pid=pid, process=driverinfo.printable(process) if process else None,
               text=driverinfo.printable(rest.strip())[:MAX_TEXT], instance=match.group(2))


def parse_uuid(record: Record) -> tuple[str, str] | None:
    """(address, UUID) from the driver's `NVRM: GPU at PCI:…: GPU-…` line, or None."""
    match = _UUID_RE.search(record.message)
    if match is None:
        return None
    return match.group(1).lower() + ".0", match.group(2)


def classify(code: int, fatal: frozenset[int] | tuple[int, ...],
             ignored: frozenset[int] | tuple[int, ...]) -> str:
    """FATAL (GPUReady False), IGNORED (the application's own error) or EVENT; a code in both
    sets is fatal."""
    if code in fatal:
        return FATAL
    if code in ignored:
        return IGNORED
    return EVENT


