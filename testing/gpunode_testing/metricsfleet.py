"""A small fleet of fixture nodes for the metrics' tests and the dashboard's picture.

Every fixture machine in its last state (its Azure VM size in Afterburn's file where the machine
is an Azure size), an ND96 whose first GPU falls off the bus, a T4 whose VM size has 4 GPUs,
and a CPU node whose boot recorded no GPU: between them every state the alerts and the
dashboard show.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.pipeline import state
from gpunode.platform.host import Host
from gpunode_testing import fixtures

CONFIG = AgentConfig(kubernetes=KubernetesConfig(node_name="node-0"))
FELL_OFF = "NVRM: Xid (PCI:0001:00:00): 79, pid=1122, GPU has fallen off the bus."


class QuietApi:
    """An API server that takes every change (the watch passes report to it)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def get_node(self, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "status": {"conditions": []}}

    def patch_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return body


def build(root: Path) -> dict[str, Host]:
    """node name → its fixture host, under `root`."""
    hosts = {}
    for machine in fixtures.MACHINES.values():
        size = re.match(r"Azure (Standard_\w+)", machine.description)
        extra = {"/run/metadata/flatcar": f"COREOS_AZURE_VMSIZE={size.group(1)}\n"} if size else {}
        hosts[machine.name] = Host(fixtures.build(machine, root / machine.name, fixtures.Options(
            state=machine.states[-1], extra=extra)))
    hosts["nd96-fallen"] = Host(fixtures.build(
        fixtures.MACHINES["nd96amsr-a100-v4"], root / "nd96-fallen", fixtures.Options(extra={
            "/run/metadata/flatcar": "COREOS_AZURE_VMSIZE=Standard_ND96amsr_A100_v4\n"})))
    hosts["t4-of-4"] = Host(fixtures.build(fixtures.MACHINES["nc4as-t4-v3"], root / "t4-of-4",
                                           fixtures.Options(extra={  # 1 of the size's 4 GPUs
                                               "/run/metadata/flatcar":
                                               "COREOS_AZURE_VMSIZE=Standard_NC64as_T4_v3\n"})))
    cpu = Host(fixtures.build(fixtures.MACHINES["azure-d4s-v5"], root / "cpu-booted",
                              fixtures.Options(state="bare")))
    (cpu.root / "run/gpunode").mkdir(parents=True)
    (cpu.root / "run/gpunode/state.json").write_bytes(
        state.no_gpu("2026-11-29T08:00:01Z", "2026-11-29T08:00:01Z", 1.5))
    hosts["cpu-booted"] = cpu
    return hosts


def log_kernel(host: Host, *messages: str) -> None:
    """Append kernel records (priority 3) to the node's /dev/kmsg file, numbered on."""
    path = host.root / "dev/kmsg"
    path.parent.mkdir(parents=True, exist_ok=True)
    before = path.read_text() if path.exists() else ""
    seq = before.count("\n")
    path.write_text(before + "".join(f"3,{seq + n},{(seq + n) * 1_000_000},-;{m}\n"
                                     for n, m in enumerate(messages, start=1)))


def watch_pass(host: Host) -> None:
    """One `gpunode watch --once` pass, reported to a QuietApi."""
    from gpunode.watch import once

    log_kernel(host)
    once.run(host, CONFIG, False, QuietApi)


def texts(root: Path) -> dict[str, str]:
    """node name → `gpunode metrics`, after the ND96's GPU fell off the bus."""
    from gpunode import metrics

    hosts = build(root)
    log_kernel(hosts["nd96-fallen"], FELL_OFF)
    watch_pass(hosts["nd96-fallen"])
    return {name: metrics.text(host, CONFIG) for name, host in hosts.items()}
