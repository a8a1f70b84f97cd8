"""The metric families, computed from MetricFacts: pure.

Names follow Prometheus' conventions (docs/practices/naming.md): the `gpunode_` prefix, base
units (seconds), `_total` on counters, `_info` series (value 1) for versions, and label sets
whose values come from short fixed lists or from the node's own hardware (a GPU's PCI
address, index and UUID; an Xid code): nothing per pod, process or event, so a node has a few
dozen series at most. docs/metrics.md lists every one.
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass

from gpunode.metrics.exposition import Family
from gpunode.metrics.facts import MetricFacts
from gpunode.platform.timestamps import TIMESTAMP_FORMAT
from gpunode.watch.xid import FELL_OFF_BUS

BOOT_OUTCOMES = ("ok", "failed", "no-gpu", "none", "unreadable")
# A GPU's state, in the order one wins over the next (gpu_states)
GPU_STATES = ("fell-off-bus", "xid-fatal", "missing", "passthrough", "no-driver", "not-initialized",
              "ready")


@dataclass(frozen=True)
class GpuRow:
    """One GPU of the node and its state, as gpunode_gpu_state shows it."""

    address: str
    index: str  # its place among the GPUs the driver sees, in PCI address order ("" unknown)
    uuid: str  # "" while unknown
    state: str  # one of GPU_STATES


def families(facts: MetricFacts) -> list[Family]:
    """Every family the node has; one without samples is left out of the text."""
    return [_build(facts), *_boot(facts), *_gpus(facts), *_driver(facts), *_watch(facts)]


def _build(facts: MetricFacts) -> Family:
    return Family("gpunode_build_info", "gauge", "gpunode's version (always 1)").add(
        1, version=facts.version)


def _boot(facts: MetricFacts) -> list[Family]:
    record = facts.boot
    outcome = record.outcome if record is not None else (
        "unreadable" if facts.boot_problem else "none")
    states = Family("gpunode_boot_outcome", "gauge", "The last gpunode boot's outcome this "
                    "host boot: 1 for the one it had (none: no boot record; unreadable: one "
                    "that cannot be used)")
    for name in BOOT_OUTCOMES:
        states.add(1 if name == outcome else 0, outcome=name)
    finished = Family("gpunode_boot_finished_timestamp_seconds", "gauge",
                      "When the last gpunode boot finished, in seconds since the epoch")
    durations = Family("gpunode_boot_step_duration_seconds", "gauge",
                       "How long each step of the last gpunode boot took")
    success = Family("gpunode_boot_step_success", "gauge",
                     "Whether each step of the last gpunode boot succeeded (1) or failed (0)")
    if record is not None:
        when = _epoch(record.finished_at)
        if when is not None:
            finished.add(when)
        for step in record.steps:
            if "duration_ms" in step:
                durations.add(step["duration_ms"] / 1000, step=step["name"])
            success.add(1 if step["outcome"] == "ok" else 0, step=step["name"])
    return [states, finished, durations, success]


def _gpus(facts: MetricFacts) -> list[Family]:
    detected = Family("gpunode_gpus_detected", "gauge",
                      "NVIDIA GPUs on the PCI bus now (PCI class 0300 or 0302)")
    expected = Family("gpunode_gpus_expected", "gauge",
                      "GPUs the node's VM size has (Azure instance metadata; absent where "
                      "unknown)")
    vm_size = Family("gpunode_vm_size_info", "gauge", "The node's VM size (always 1)")
    state = Family("gpunode_gpu_state", "gauge", "Each GPU's state: 1 for the one it is in "
                   f"({', '.join(GPU_STATES)})")
    ready = Family("gpunode_gpu_ready_condition", "gauge", "The Node's GPUReady condition as "
                   "gpunode sets it: 1 True, 0 False, with its reason")
    if facts.detection is not None:
        detected.add(len(facts.detection.gpus))
    if facts.vm_size is not None:
        expected.add(facts.vm_size.gpus)
        vm_size.add(1, vm_size=facts.vm_size.size)
    for row in gpu_states(facts):
        for name in GPU_STATES:
            state.add(1 if name == row.state else 0, address=row.address, index=row.index,
                      uuid=row.uuid, state=name)
    if facts.condition is not None:
        ready.add(1 if facts.condition.status == "True" else 0, reason=facts.condition.reason)
    return [detected, expected, vm_size, state, ready]


def gpu_states(facts: MetricFacts) -> list[GpuRow]:
    """Every GPU the node has or had this boot (detected now, missing since the watch first saw
    it, or named by a fatal Xid) and its state, by PCI address."""
    present = {g.address: g for g in facts.detection.gpus} if facts.detection else {}
    watch = facts.watch
    fatal = {}
    for finding in watch.fatal if watch is not None else []:
        if fatal.get(finding.address, (0, None))[0] != FELL_OFF_BUS:
            fatal[finding.address] = (finding.code, finding.uuid)
    missing = set(watch.missing) if watch is not None else set()
    known = sorted(facts.gpu_infos)  # the driver's GPUs: the CDI spec's indexes
    rows = []
    for address in sorted({*present, *missing, *fatal}):
        info = facts.gpu_infos.get(address)
        uuid = (info.uuid if info is not None else None) or fatal.get(address, (0, None))[1] or ""
        if address in fatal:
            state = "fell-off-bus" if fatal[address][0] == FELL_OFF_BUS else "xid-fatal"
        elif address in missing or address not in present:
            state = "missing"
        elif present[address].driver == "vfio-pci":
            state = "passthrough"
        elif info is None:
            state = "no-driver"
        elif info.uuid is None:  # the driver has not initialized it (gpu/init.py)
            state = "not-initialized"
        else:
            state = "ready"
        rows.append(GpuRow(address, str(known.index(address)) if address in known else "",
                           uuid, state))
    return rows


def _driver(facts: MetricFacts) -> list[Family]:
    loaded = Family("gpunode_driver_loaded", "gauge",
                    "Whether an NVIDIA kernel driver is loaded (its version under /proc)")
    info = Family("gpunode_driver_info", "gauge", "The loaded NVIDIA driver: its version, "
                  "module flavour and the strategy gpunode boot loaded it with (always 1)")
    matches = Family("gpunode_driver_userspace_matches", "gauge", "Whether the user-space "
                     "libraries (libcuda, libnvidia-ml) of the loaded driver's version are "
                     "installed (1) or not (0)")
    userspace = Family("gpunode_driver_userspace_info", "gauge", "Versions of the driver's "
                       "user-space (libcuda) found: the loaded driver's, or else the system's "
                       "(always 1)")
    gpu_node = facts.detection is not None and bool(facts.detection.gpus)
    if facts.driver is None:
        if gpu_node:
            loaded.add(0)
        return [loaded]
    loaded.add(1)
    step = facts.boot.step("driver") if facts.boot is not None else None
    strategy = step.get("strategy") if step is not None else None
    info.add(1, version=facts.driver.version, flavour=facts.driver.flavour,
             strategy=strategy or "")
    if facts.userspace is not None:
        matches.add(1 if facts.userspace.matches else 0)
        for version in facts.userspace.versions:
            userspace.add(1, version=version)
    return [loaded, info, matches, userspace]


def _watch(facts: MetricFacts) -> list[Family]:
    watch = facts.watch
    xids = Family("gpunode_xids_total", "counter", "NVIDIA Xid errors the kernel logged this "
                  "boot, per GPU and Xid code (read by gpunode watch)")
    repairs = Family("gpunode_containerd_config_repairs_total", "counter", "Times gpunode watch "
                     "repaired containerd's config this boot (another tool had changed it)")
    regenerated = Family("gpunode_cdi_spec_regenerations_total", "counter", "Times gpunode "
                         "watch regenerated the CDI spec this boot (driver or GPUs changed)")
    pending = Family("gpunode_containerd_restart_pending", "gauge", "Whether containerd still "
                     "runs the config from before a repair (the restart policy held it back)")
    passed = Family("gpunode_watch_last_pass_timestamp_seconds", "gauge",
                    "When gpunode watch last wrote its state, in seconds since the epoch")
    if watch is None:
        return [xids]
    for key, count in sorted(watch.xids.items(), key=_xid_order):
        address, _, code = key.rpartition("/")
        xids.add(count, address=address, code=code)
    repairs.add(watch.counts.get("containerd_repairs", 0))
    regenerated.add(watch.counts.get("cdi_regenerations", 0))
    restart = watch.findings.get("containerd", {}).get("restart")
    pending.add(1 if restart == "pending" else 0)
    when = _epoch(watch.updated_at)
    if when is not None:
        passed.add(when)
    return [xids, repairs, regenerated, pending, passed]


def _xid_order(item: tuple[str, int]) -> tuple[str, int]:
    address, _, code = item[0].rpartition("/")
    return address, int(code) if code.isdigit() else 0


def _epoch(text: str | None) -> int | None:
    """A record's timestamp (timestamps.py's format) as seconds since the epoch."""
    if not text:
        return None
    try:
        return calendar.timegm(time.strptime(text, TIMESTAMP_FORMAT))
    except ValueError:
        return None
