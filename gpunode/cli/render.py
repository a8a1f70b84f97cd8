"""Human output: compact aligned tables, colour only on a terminal."""

from __future__ import annotations

from collections.abc import Sequence

from gpunode.gpu.detect import Detection
from gpunode.kube.label import NOTHING_TO_LABEL, Desired, Outcome
from gpunode.status import Report

_COLOURS = {"ok": "32", "warn": "33", "fail": "31", "skip": "2"}


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def detection(d: Detection) -> str:
    if not d.functions:
        lines = ["no NVIDIA PCI functions found"]
    else:
        rows = [("ADDRESS", "KIND", "ID", "PRODUCT", "NUMA", "DRIVER", "IOMMU")]
        for f in d.functions:
            rows.append((f.address, f.kind, f"{f.vendor_id}:{f.device_id or '?'}",
                         f.product_name or "unknown", _opt(f.numa_node), f.driver or "-",
                         _opt(f.iommu_group)))
        lines = table(rows)
        lines.append(f"{len(d.gpus)} GPU(s), {len(d.nvswitches)} NVSwitch(es); names from "
                     f"{d.names_source}")
    if d.nouveau_loaded:
        lines.append("warning: the nouveau module is loaded; it blocks the NVIDIA driver")
    for f in d.vfio_gpus:
        lines.append(f"warning: {f.address} is bound to vfio-pci (passthrough), not usable here")
    lines.extend(f"problem: {p}" for p in d.problems)
    return "\n".join(lines)


def status(report: Report, root: str, colour: bool) -> str:
    verdict = {"ready": "READY", "not-ready": "NOT READY", "no-gpu": "NO GPU (nothing to do)"}
    name_w = max(len("CHECK"), *(len(c.name) for c in report.checks))
    state_w = len("STATE")
    lines = [f"gpunode status ({root}): {verdict[report.verdict]}",
             f"{'CHECK'.ljust(name_w)}  {'STATE'.ljust(state_w)}  DETAIL"]
    for check in report.checks:
        state = check.state.ljust(state_w)
        if colour:
            state = f"\033[{_COLOURS[check.state]}m{state}\033[0m"
        lines.append(f"{check.name.ljust(name_w)}  {state}  {check.detail}")
        if check.hint and check.state != "ok":
            lines.append(f"{'':{name_w}}  {'':{state_w}}  hint: {check.hint}")
    return "\n".join(lines)


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def label(want: Desired, outcome: Outcome | None) -> str:
    """`gpunode label`: what it set (or, with --dry-run, would set: outcome None)."""
    if want.gpu is False:
        return NOTHING_TO_LABEL
    condition = want.condition
    if outcome is None:
        pairs = [f"{k}={v}" for k, v in sorted(want.labels.items())]
        return "\n".join([f"node {want.node}", *pairs, f"condition GPUReady={condition.status} "
                          f"({condition.reason}): {condition.message}"])
    return (f"node {outcome.node}: labels {'updated' if outcome.labels_changed else 'current'}"
            f", GPUReady={condition.status} "
            f"{'updated' if outcome.condition_changed else 'current'}")
