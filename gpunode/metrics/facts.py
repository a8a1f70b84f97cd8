"""What the metrics are computed from, read once from facts gpunode already keeps.

The boot record (/run/gpunode/state.json), the watch's state (/run/gpunode/watch.json), the
PCI devices and the loaded driver's /proc files come from `gpunode status`'s own reading, and
GPUReady from its checks, exactly as `gpunode label` sets it (or as the watch last reported it,
when the watch's own finding is what made it False); the VM size's GPU count from the watch's
reading of the instance metadata (watch/vmsize.py); the driver's user-space from the driver
step's search for it (driver/userspace.py). Nothing here writes or contacts anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpunode import __version__
from gpunode.config import AgentConfig
from gpunode.platform.host import Host

if TYPE_CHECKING:
    from gpunode.gpu.detect import Detection
    from gpunode.gpu.driverinfo import DriverVersion, GpuInfo
    from gpunode.kube.labels import Condition
    from gpunode.pipeline.state import BootRecord
    from gpunode.status import Report
    from gpunode.watch.state import WatchState
    from gpunode.watch.vmsize import Claim


@dataclass(frozen=True)
class UserSpace:
    """The loaded driver's user-space: whether its own version's libcuda and libnvidia-ml are
    there (driver/userspace.find), and the versions of libcuda found."""

    matches: bool
    versions: tuple[str, ...]


@dataclass(frozen=True)
class MetricFacts:
    """Everything the metric families are computed from (families.py, pure)."""

    version: str  # gpunode's
    boot: BootRecord | None
    boot_problem: str | None  # why the boot record cannot be used
    detection: Detection | None  # None: the PCI devices could not be read
    gpu_infos: dict[str, GpuInfo]  # address → what the driver says of it
    driver: DriverVersion | None  # None: no NVIDIA driver loaded
    userspace: UserSpace | None  # None: no driver loaded, nothing to match
    vm_size: Claim | None
    watch: WatchState | None
    condition: Condition | None  # GPUReady as gpunode has it; None: a node without GPUs


def observe(host: Host, config: AgentConfig) -> MetricFacts:
    """The node's facts for its metrics (status's reading, without the API server)."""
    from gpunode import status
    from gpunode.gpu import driverinfo
    from gpunode.watch import vmsize

    facts = status.observe(host, config, contact_api=False)
    report = status.evaluate(facts)
    driver = driverinfo.parse_version(facts.driver_version_text or "")
    return MetricFacts(
        version=__version__, boot=facts.last_boot,
        boot_problem=facts.last_boot_error.message if facts.last_boot_error else None,
        detection=facts.detection, gpu_infos=facts.gpu_infos, driver=driver,
        userspace=_userspace(host, config, driver), vm_size=vmsize.claim(host),
        watch=facts.watch,
        condition=None if report.verdict == "no-gpu" else gpu_ready(report, facts.watch))


def gpu_ready(report: Report, watch: WatchState | None) -> Condition:
    """GPUReady as the Node has it: what `gpunode label` sets from status's checks, unless the
    watch's own finding (a fatal Xid, a GPU missing) made it False, which the watch reported
    with its own reason (watch/once.py)."""
    from gpunode.kube import labels
    from gpunode.watch.state import WATCH_REASONS

    said = watch.condition if watch is not None else None
    if said is not None and said["status"] == "False" and said["reason"] in WATCH_REASONS:
        return labels.Condition(said["status"], said["reason"], said["message"])
    return labels.condition_for([(c.name, c.state, c.detail) for c in report.checks])


def _userspace(host: Host, config: AgentConfig, driver: DriverVersion | None) -> UserSpace | None:
    if driver is None:
        return None
    from gpunode.driver import userspace
    from gpunode.errors import GpunodeError

    try:
        userspace.find(host, driver.version, prebuilt_dirs=config.driver.prebuilt_dirs)
    except GpunodeError:  # none of its version where the driver step looks
        return UserSpace(False, userspace.system_versions(host))
    return UserSpace(True, (driver.version,))
