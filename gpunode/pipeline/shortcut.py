"""A CPU node's boot, answered from sysfs before the pipeline is imported.

A GPU image's units run on every node of a cluster, the CPU pools' too. Where sysfs lists no
NVIDIA PCI function, no agent config asks for anything and no CDI spec of gpunode's is left to
remove, the boot's whole answer is "no-gpu": the record says so exactly as the pipeline would
write it (one detect step), the same events are logged, and nothing else is read — no D-Bus,
no udev, no driver or containerd code. Anything not plain leaves the decision to the pipeline:
an NVIDIA function of any class, a function whose vendor cannot be read, no PCI listing, an
agent config, a CDI spec, a record that cannot be replaced.
"""

from __future__ import annotations

import re
import time

from gpunode import log
from gpunode.config import AgentConfig
from gpunode.errors import GpunodeError
from gpunode.pipeline import state
from gpunode.platform import timestamps
from gpunode.platform.host import Host
from gpunode.platform.nodepaths import (
    CDI_SPEC_PATH,
    DEFAULT_CONFIG_PATH,
    NVIDIA_VENDOR_ID,
    SYSFS_PCI_DEVICES,
)

_VENDOR = re.compile(r"0x[0-9a-f]{4}")


def boot_without_gpu(host: Host, config: AgentConfig) -> bool:
    """True once a CPU node's boot is recorded and logged; False (nothing written) where the
    pipeline must decide."""
    started_at = timestamps.utc_timestamp()
    start = time.perf_counter()
    if config.source != "defaults" or not _plainly_without_nvidia(host):
        return False
    try:
        if host.lstat(DEFAULT_CONFIG_PATH) is not None or host.lstat(CDI_SPEC_PATH) is not None:
            return False
    except GpunodeError:
        return False
    duration_ms = round((time.perf_counter() - start) * 1000, 2)
    record = state.no_gpu(started_at, timestamps.utc_timestamp(), duration_ms)
    try:
        host.write_atomic(state.STATE_PATH, record, make_parents=True)
    except GpunodeError:
        return False  # the pipeline writes it, or reports why it cannot
    log.get().info("step.done", step="detect", duration_ms=duration_ms, gpus=0, functions=0,
                   changed=False)
    return True


def _plainly_without_nvidia(host: Host) -> bool:
    """Every PCI function sysfs lists has a readable vendor ID, and none is NVIDIA's."""
    try:
        if not host.exists(SYSFS_PCI_DEVICES):
            return False  # nothing looked at is not "no GPU" (the pipeline says so)
        for address in host.list_dir(SYSFS_PCI_DEVICES):
            vendor = host.read_text(f"{SYSFS_PCI_DEVICES}/{address}/vendor", 64).strip()
            if not _VENDOR.fullmatch(vendor.lower()) or vendor.lower()[2:] == NVIDIA_VENDOR_ID:
                return False
    except GpunodeError:
        return False
    return True
