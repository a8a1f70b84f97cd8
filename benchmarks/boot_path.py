"""The boot critical path gpunode adds, measured in a real systemd (the end-to-end test's harness).

Two flows on the same fixture GPU node (a T4 with its driver loaded), several boots each:

- gpunode: gpunode.service runs before containerd.service, which then starts once, already
  with the nvidia runtime. Measured from "Starting gpunode.service" to containerd active.
- peers: containerd starts first; a unit after it configures the runtime and restarts it (the
  GPU Operator's toolkit container and Flatcar's own flow). Measured from "Starting
  containerd.service" to containerd active again after the restart.

Both end when containerd is active with the nvidia runtime. Also: gpunode.service on a CPU-only
node (the no-op every non-GPU pool runs). Timestamps are systemd's own (monotonic, from unit
properties and the journal). Run as root: `.venv/bin/python benchmarks/boot_path.py`.
"""

from __future__ import annotations

import secrets
import shutil
import statistics
import sys

from gpunode_testing import fixtures
from gpunode_testing.boot_harness import (
    CONTAINERD_UNIT,
    KUBELET_UNIT,
    UNITS,
    WORK_PARENT,
    node_prepare,
)
from gpunode_testing.systemd_ns import SystemdNamespace

BOOTS = 5
PEER_UNIT = """[Unit]
Description=the peers' flow: configure the runtime after containerd started, then restart it
After=containerd.service
Requires=containerd.service

[Service]
Type=oneshot
ExecStart=/usr/bin/gpunode --log-format json containerd configure

[Install]
WantedBy=multi-user.target
"""


def journal_start(ns: SystemdNamespace, unit: str) -> int:
    """Monotonic µs of the first "Starting …" message of the unit in this boot."""
    for entry in ns.journal(unit):
        if str(entry.get("MESSAGE", "")).startswith("Starting "):
            return int(str(entry["__MONOTONIC_TIMESTAMP"]))
    raise SystemExit(f"no 'Starting' message for {unit}")


def one_boot(machine: str, flow: str) -> tuple[float, bool]:
    """(milliseconds of the flow, whether containerd ended with the nvidia runtime)."""
    work = WORK_PARENT / f"bench-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    try:
        fixture = work / "fixture"
        fixtures.build(fixtures.MACHINES[machine], fixture,
                       fixtures.Options(state="driver", flat_sysfs=True, dev_nodes="plain"))
        units = {"containerd.service": CONTAINERD_UNIT, "kubelet.service": KUBELET_UNIT}
        first = "gpunode.service" if flow == "gpunode" else "containerd.service"
        extra = {"gpunode.service": (UNITS / "gpunode.service").read_text()} \
            if flow == "gpunode" else {"peer-configure.service": PEER_UNIT}
        with SystemdNamespace({**units, **extra}, work, overlays=("usr", "var/lib"),
                              enable=tuple({**units, **extra}),
                              prepare=node_prepare(fixture)) as ns:
            if flow == "peers":
                ns.wait_for(lambda: int(ns.unit_property(
                    "peer-configure.service", "ExecMainExitTimestampMonotonic") or 0) > 0,
                    timeout=60, what="the peers' configure unit to finish")
            ns.wait_active("containerd.service")
            start = journal_start(ns, first)
            end = int(ns.unit_property("containerd.service", "ActiveEnterTimestampMonotonic"))
            argv = ns.main_argv("containerd.service")
            config = argv[2] if len(argv) > 2 else ""
            dump = ns.run(["containerd", "--config", config, "config", "dump"]).stdout
            return (end - start) / 1000, "nvidia-container-runtime" in dump
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    samples: dict[str, list[float]] = {"gpunode": [], "peers": []}
    for _ in range(BOOTS):  # interleaved, so drift on the machine hits every flow alike
        for flow in ("gpunode", "peers"):
            ms, runtime = one_boot("nc4as-t4-v3", flow)
            if not runtime:
                raise SystemExit(f"{flow}: containerd did not end with the nvidia runtime")
            samples[flow].append(ms)
    cpu = [one_boot_cpu() for _ in range(BOOTS)]
    ours, peers = statistics.median(samples["gpunode"]), statistics.median(samples["peers"])
    print(f"boot path in a real systemd ({BOOTS} boots each, medians):")
    print(f"  gpunode: gpunode.service start → containerd active with the runtime: {ours:.0f} ms "
          "(containerd started once)")
    print(f"  peers: containerd start → configured → restarted → active: {peers:.0f} ms "
          "(containerd started twice)")
    print(f"  ratio peers / gpunode: {peers / ours:.2f}")
    print(f"  gpunode.service on a CPU-only node (no-op): {statistics.median(cpu):.0f} ms")
    return 0


def one_boot_cpu() -> float:
    work = WORK_PARENT / f"bench-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    try:
        fixture = work / "fixture"
        fixtures.build(fixtures.MACHINES["azure-d4s-v5"], fixture,
                       fixtures.Options(state="bare", flat_sysfs=True, dev_nodes="plain"))
        units = {"containerd.service": CONTAINERD_UNIT,
                 "gpunode.service": (UNITS / "gpunode.service").read_text()}
        with SystemdNamespace(units, work, overlays=("usr", "var/lib"), enable=tuple(units),
                              prepare=node_prepare(fixture)) as ns:
            ns.wait_active("containerd.service")
            props = ns.unit_properties("gpunode.service", "ExecMainStartTimestampMonotonic",
                                       "ExecMainExitTimestampMonotonic")
            return (int(props["ExecMainExitTimestampMonotonic"]) -
                    int(props["ExecMainStartTimestampMonotonic"])) / 1000
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
