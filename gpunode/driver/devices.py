"""The /dev/nvidia* nodes containers need: what they must be (pure), and making them so.

udev does not create the UVM nodes at boot; every peer runs `nvidia-modprobe -u -c=0` or
mknod. Majors come from /proc/devices (the driver registers `nvidia-frontend`, some builds
`nvidia`), minors from the driver: one per GPU (`Device Minor:`), 255 control, 254 modeset,
0/1 for UVM and UVM tools, and the MIG capability minors it publishes.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from gpunode import log
from gpunode.errors import MissingMajor
from gpunode.gpu import detect, driverinfo
from gpunode.platform.host import Host
from gpunode.platform.integers import MAX_MINOR, parse_uint

MODE = 0o666  # every node but the MIG capabilities: what nvidia-modprobe and udev rules give
CAPS_DIR = f"{driverinfo.PROC_NVIDIA}/capabilities/mig"
CAPS_NODE_DIR = "/dev/nvidia-caps"
# A capability file that states no DeviceFileMode: read-only for everyone, never wider than the
# driver could have meant.
CAP_DEFAULT_MODE = 0o444


@dataclass(frozen=True)
class Capability:
    """A MIG capability as the driver publishes it: its /dev/nvidia-caps minor and the mode it
    says the node has (`DeviceFileMode:`, decimal: 256 is 0400, 292 is 0444)."""

    minor: int
    mode: int


@dataclass(frozen=True)
class Node:
    """One /dev/nvidia* character device node the loaded driver calls for, as it must be."""

    path: str
    major: int
    minor: int
    mode: int = MODE

    @property
    def char_link(self) -> str:
        return f"/dev/char/{self.major}:{self.minor}"


def for_host(host: Host) -> list[Node]:
    """The nodes the loaded driver calls for, from its /proc files; MissingMajor when they
    name no usable number (a GPU whose minor is unknown or out of range is never silently
    left out)."""
    infos = driverinfo.read_gpu_infos(host)
    bad = [i.minor_problem for i in infos.values() if i.minor_problem]
    if bad:
        raise MissingMajor("; ".join(bad))
    problems: list[str] = []
    majors = driverinfo.parse_char_majors(host.read_optional("/proc/devices") or "", problems)
    return wanted(majors, [i.minor for i in infos.values() if i.minor is not None],
                  detect.module_loaded(host, "nvidia_modeset"), capabilities(host), problems)


def wanted(majors: dict[str, int], gpu_minors: list[int], modeset: bool,
           caps: dict[str, Capability], problems: list[str] | None = None) -> list[Node]:
    also = f" ({'; '.join(problems)})" if problems else ""
    nvidia = driverinfo.nvidia_major(majors)
    if nvidia is None:
        raise MissingMajor(f"/proc/devices has no nvidia-frontend (or nvidia) major{also}")
    uvm = majors.get("nvidia-uvm")
    if uvm is None:
        raise MissingMajor(f"/proc/devices has no nvidia-uvm major: is nvidia_uvm loaded?{also}")
    nodes = [Node("/dev/nvidiactl", nvidia, 255)]
    nodes += [Node(f"/dev/nvidia{m}", nvidia, m) for m in sorted(gpu_minors)]
    if modeset:
        nodes.append(Node("/dev/nvidia-modeset", nvidia, 254))
    nodes += [Node("/dev/nvidia-uvm", uvm, 0), Node("/dev/nvidia-uvm-tools", uvm, 1)]
    caps_major = majors.get("nvidia-caps")
    if caps_major is not None:
        nodes += [Node(f"{CAPS_NODE_DIR}/nvidia-cap{cap.minor}", caps_major, cap.minor, cap.mode)
                  for cap in sorted(caps.values(), key=lambda c: c.minor)]
    return nodes


def capabilities(host: Host) -> dict[str, Capability]:
    """MIG capability name → its minor and mode, from the driver's `DeviceFileMinor:` and
    `DeviceFileMode:` lines (NVIDIA's MIG user guide, "Device Nodes and Capabilities")."""
    found: dict[str, Capability] = {}
    for name in ("config", "monitor"):
        fields: dict[str, int] = {}
        for line in (host.read_optional(f"{CAPS_DIR}/{name}") or "").splitlines():
            key, _, value = line.partition(":")
            number = parse_uint(value, MAX_MINOR if key.strip() == "DeviceFileMinor" else 0o777)
            if number is not None:
                fields[key.strip()] = number
        if "DeviceFileMinor" in fields:
            found[name] = Capability(fields["DeviceFileMinor"],
                                     fields.get("DeviceFileMode", CAP_DEFAULT_MODE))
    return found


MISSING, NOT_CHAR = "missing", "not a character device"


def problem(host: Host, node: Node) -> str | None:
    """Why the existing node is not right, or None when it is."""
    return judge(node, host.lstat(node.path))


def judge(node: Node, st: os.stat_result | None) -> str | None:
    """Why the entry at the node's path (its lstat, None when absent) is not the node: the one
    judgement `driver load` fixes by and `status` reports."""
    if st is None:
        return MISSING
    if not stat.S_ISCHR(st.st_mode):
        return NOT_CHAR
    actual = (os.major(st.st_rdev), os.minor(st.st_rdev))
    if actual != (node.major, node.minor):
        return f"is {actual[0]}:{actual[1]}, expected {node.major}:{node.minor}"
    if stat.S_IMODE(st.st_mode) != node.mode:
        return f"has mode {stat.S_IMODE(st.st_mode):o}, expected {node.mode:o}"
    return None


def link_problem(host: Host, node: Node) -> str | None:
    """Why the node's /dev/char link (what runc and systemd look devices up by) is not right,
    or None when it is."""
    target = host.read_link(node.char_link)
    if target == _link_target(node):
        return None
    return f"no {node.char_link} link" if target is None else \
        f"{node.char_link} links to {target!r}, not {_link_target(node)!r}"


def _link_target(node: Node) -> str:
    return os.path.relpath(node.path, "/dev/char")


def ensure(host: Host, nodes: list[Node]) -> list[str]:
    """Create or fix each node and its /dev/char link; what was done, for the log and record."""
    done: list[str] = []
    for node in nodes:
        reason = problem(host, node)
        if reason is not None:
            if reason != "missing":
                log.get().info("devices.replace", path=node.path, reason=reason)
            host.make_char_device(node.path, node.major, node.minor, node.mode)
        link = link_problem(host, node)
        if link is not None:
            host.symlink(node.char_link, _link_target(node))
        if reason or link:
            done.append(f"{node.path} ({node.major}:{node.minor}): {reason or link}")
    return done
