"""The no-op boot: decide "nothing changed since the last successful boot" from cheap reads.

A successful `gpunode boot` writes /run/gpunode/inputs.json: for every file it depends on
(agent config, containerd's config, drop-ins and unit, the driver's /proc files, the device
nodes, the PCI function list, the kernel and boot id) a signature — lstat fields, or the
content for /proc files and listings for directories. A later `gpunode boot` in the same boot
recomputes them; when all are equal it logs one event and exits, without importing the
pipeline (which costs several times Python's own start). /run is empty after a reboot, so the
first boot of every kernel always runs in full.

This module must stay cheap to import: os and json only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

STAMP = "/run/gpunode/inputs.json"
STAMP_VERSION = 1
_CONTENT_PREFIXES = ("/proc/",)
_LISTED = ("/sys/bus/pci/devices", "/proc/driver/nvidia/gpus",
           "/etc/systemd/system/containerd.service.d", "/etc/containerd/conf.d")


def signature(root: str, path: str) -> Any:
    """What must stay equal for `path` (a host path): listing, content, or lstat fields."""
    real = root.rstrip("/") + path
    try:
        if path in _LISTED:
            return sorted(os.listdir(real))
        if path.startswith(_CONTENT_PREFIXES):
            with open(real, encoding="utf-8", errors="replace") as f:
                return f.read()
        st = os.lstat(real)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    return [st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_rdev]


def compute(root: str, paths: list[str], version: str, config: str | None) -> dict[str, Any]:
    return {"stamp_version": STAMP_VERSION, "gpunode": version, "config": config,
            "inputs": {p: signature(root, p) for p in sorted(set(paths))}}


def unchanged(root: str, version: str, config: str | None) -> bool:
    """True when the last successful boot's inputs are all as they were."""
    try:
        with open(root.rstrip("/") + STAMP, encoding="utf-8") as f:
            stamp = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if not isinstance(stamp, dict) or stamp.get("stamp_version") != STAMP_VERSION:
        return False
    if stamp.get("gpunode") != version or stamp.get("config") != config:
        return False
    inputs = stamp.get("inputs")
    if not isinstance(inputs, dict) or not inputs:
        return False
    # json turns the lstat tuples into lists; signature() returns lists for the same reason
    return all(signature(root, path) == value for path, value in inputs.items())


def boot_args(argv: list[str]) -> tuple[str, str | None, str | None] | None:
    """(root, config, log format) when argv is a plain `boot`, else None (use the full CLI)."""
    root, config, log_format = "/", None, None
    rest = list(argv)
    while rest and rest[0].startswith("--"):
        option = rest.pop(0)
        name, eq, value = option.partition("=")
        if name not in ("--root", "--config", "--log-format"):
            return None
        if not eq:
            if not rest:
                return None
            value = rest.pop(0)
        if name == "--root":
            root = value
        elif name == "--config":
            config = os.path.abspath(value)
        else:
            log_format = value
    if rest != ["boot"]:
        return None
    return os.path.abspath(root), config, log_format


def report_unchanged(log_format: str | None) -> None:
    """The one event a no-op boot logs (the console format stays readable by hand)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if log_format == "console" or (log_format is None and sys.stderr.isatty()):
        sys.stderr.write(f"{stamp} [info     ] boot.unchanged  nothing changed since the last "
                         "successful boot\n")
    else:
        sys.stderr.write(json.dumps({"event": "boot.unchanged", "outcome": "ok", "level": "info",
                                     "timestamp": stamp}, separators=(",", ":")) + "\n")
