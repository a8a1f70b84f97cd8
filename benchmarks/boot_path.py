"""The boot critical path gpunode adds, measured in a real systemd (the end-to-end test's harness).

Two flows on the same fixture GPU node (a T4 with its driver loaded), several boots each:

- gpunode: gpunode.service runs before containerd.service, which then starts once, already
  with the nvidia runtime. Measured from "Starting gpunode.service" to containerd active.
- peers: containerd starts first; a unit after it configures the runtime and restarts it (the
  GPU Operator's toolkit container and Flatcar's own flow). Measured from "Starting
  containerd.service" to containerd active again after the restart.

Both end when containerd is active with the nvidia runtime. gpunode's share is its flow
without containerd's own start: from "Starting gpunode.service" to gpunode.service active
(its READY=1), the moment systemd may start containerd. What follows is containerd's start,
systemd's part of it included: the manager spawns containerd and, before the unit leaves
"inactive", writes its PID into the new cgroup, and on this 2-CPU machine's kernel (HZ=250)
that one write waits for an RCU grace period, ~9-15 ms (strace of PID 1: `write(…/
containerd.service/cgroup.procs) <0.009238>`: systemd 252 attaches the process from the
manager after forking it). So the run also boots a control: a unit in gpunode.service's
place that only sleeps and says READY=1 (CONTROL_SLEEP, about when gpunode says it), and
reports the gap from READY=1 to containerd leaving "inactive" after each: the same gap after
both is systemd's, more after gpunode would be gpunode's exit slowing containerd's start.
The share as earlier runs measured it, to containerd leaving "inactive", is reported beside
(boot_path_gpunode_share_with_spawn_ms).

The share's ratio is against `python -c pass` (the venv's Python, as run.py's python_pass_ms)
timed here, PASS_RUNS times before each round of boots: this machine's speed drifted between
and within runs (python -c pass 11-15 ms; the same code's share 49 and 65 ms in two runs
minutes apart), and a ratio whose two halves are timed minutes apart measured the drift as
much as gpunode (runs before 2026-12-04 divided by python_pass_ms, timed as run.py begins).

Both flows run the gpunode a node runs: the bundle of gpunode's sysext
(packaging/build_sysext.py, built once per run and unpacked onto the node's /usr) under
gpunode.service as shipped, not the venv's interpreter with the site import and .pth files no
node has. Also, on a CPU-only node (the no-op every non-GPU pool runs): gpunode.service's
activation (the venv's gpunode) against a unit with the same settings that runs `python -c
pass` (the venv's Python). Timestamps are systemd's own (monotonic, from unit properties and
the journal). Run as root: `.venv/bin/python benchmarks/boot_path.py`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpunode_testing import fixtures
from gpunode_testing.boot_harness import (
    CONTAINERD_UNIT,
    KUBELET_UNIT,
    UNITS,
    WORK_PARENT,
    node_prepare,
)
from gpunode_testing.systemd_ns import SystemdNamespace

BOOTS = 7
# The harness asks systemd nothing in a boot's first half second (SystemdNamespace's
# quiet_boot): its checks, an nsenter and a systemctl each ~0.1 s, took a few ms of these 2 CPUs,
# and PID 1's, in the middle of some boots' gpunode window and not of others (perf sched).
QUIET_BOOT = 0.5
PASS_RUNS = 3  # `python -c pass` runs before each round of boots (the share's ratio)
CONTROL_SLEEP = 0.06  # seconds the control unit sleeps before READY=1 (gpunode: ~50-80 ms)
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


def build_bundle(parent: Path) -> Path:
    """gpunode's sysext, built by packaging/build_sysext.py and unpacked: the tree (its /usr)."""
    out, tree = parent / "sysext-out", parent / "sysext-tree"
    done = subprocess.run([sys.executable, str(UNITS.parent / "packaging" / "build_sysext.py"),
                           "--out", str(out), "--work", str(parent / "sysext-work")],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"building the sysext failed:\n{done.stdout}{done.stderr}")
    subprocess.run(["unsquashfs", "-no-progress", "-d", str(tree),
                    str(next(out.glob("gpunode-*.raw")))], capture_output=True, check=True)
    return tree


def bundle_lines(tree: Path) -> list[str]:
    """Shell lines (after node_prepare's) that put the sysext's gpunode on the node's /usr."""
    return [f"cp -a {tree}/usr/lib/gpunode /usr/lib/",
            f"cp {tree}/usr/bin/gpunode /usr/bin/gpunode"]


def control_unit(bundle: Path) -> str:
    """gpunode.service with its ExecStart replaced: the bundle's Python (`bundle`, the tree),
    which sleeps CONTROL_SLEEP and says READY=1 (systemd 252's notify socket is a path)."""
    python = min((bundle / "usr/lib/gpunode/bin").glob("python3*")).name
    script = (f"import os, socket, time; time.sleep({CONTROL_SLEEP}); "
              "socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'READY=1', "
              "os.environ['NOTIFY_SOCKET'])")
    unit = (UNITS / "gpunode.service").read_text()
    return unit.replace("ExecStart=/usr/bin/gpunode boot",
                        f'ExecStart=/usr/lib/gpunode/bin/{python} -IS -c "{script}"')


@dataclass(frozen=True)
class Boot:
    """One boot's figures (ms): `flow` from the first unit's "Starting" to containerd active;
    for gpunode's flow and the control also `share` (to gpunode.service active), `spawn`
    (from then to containerd leaving "inactive") and `with_spawn` (share + spawn)."""

    flow: float
    share: float | None
    spawn: float | None
    runtime: bool  # containerd ended with the nvidia runtime

    @property
    def with_spawn(self) -> float | None:
        return None if self.share is None or self.spawn is None else self.share + self.spawn


def one_boot(machine: str, flow: str, bundle: Path) -> Boot:
    """One boot of `flow`: "gpunode" (a node with gpunode's sysext: its bundle, and its
    shipped containerd drop-in in /usr, units/containerd-env.conf), "peers", or "control"
    (gpunode's node with control_unit() as gpunode.service)."""
    work = WORK_PARENT / f"bench-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    try:
        fixture = work / "fixture"
        fixtures.build(fixtures.MACHINES[machine], fixture,
                       fixtures.Options(state="driver", flat_sysfs=True, dev_nodes="plain"))
        units = {"containerd.service": CONTAINERD_UNIT, "kubelet.service": KUBELET_UNIT}
        first = "containerd.service" if flow == "peers" else "gpunode.service"
        extra = {"peer-configure.service": PEER_UNIT} if flow == "peers" else \
            {"gpunode.service": control_unit(bundle) if flow == "control"
             else (UNITS / "gpunode.service").read_text()}
        with SystemdNamespace({**units, **extra}, work, overlays=("usr", "var/lib"),
                              enable=tuple({**units, **extra}),
                              prepare=[*node_prepare(fixture, gpunode_on_usr=False,
                                                     shipped_dropin=flow != "peers"),
                                       *bundle_lines(bundle)], quiet_boot=QUIET_BOOT) as ns:
            if flow == "peers":
                ns.wait_for(lambda: int(ns.unit_property(
                    "peer-configure.service", "ExecMainExitTimestampMonotonic") or 0) > 0,
                    timeout=60, what="the peers' configure unit to finish")
            ns.wait_active("containerd.service")
            start = journal_start(ns, first)
            times = ns.unit_properties("containerd.service", "ActiveEnterTimestampMonotonic",
                                       "InactiveExitTimestampMonotonic")
            end = int(times["ActiveEnterTimestampMonotonic"])
            share = spawn = None
            if flow != "peers":
                ready = int(ns.unit_property("gpunode.service",
                                             "ActiveEnterTimestampMonotonic"))
                share = (ready - start) / 1000
                spawn = (int(times["InactiveExitTimestampMonotonic"]) - ready) / 1000
            if flow == "control":  # nobody configured its containerd: nothing to check
                return Boot((end - start) / 1000, share, spawn, False)
            argv = ns.main_argv("containerd.service")
            config = argv[2] if len(argv) > 2 else ""
            dump = ns.run(["containerd", "--config", config, "config", "dump"]).stdout
            return Boot((end - start) / 1000, share, spawn, "nvidia-container-runtime" in dump)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(boots: int = BOOTS) -> dict[str, float]:
    """Medians (ms) of each flow, gpunode's share and the CPU node's activations, and ratios."""
    parent = WORK_PARENT / f"bench-bundle-{secrets.token_hex(4)}"
    parent.mkdir(parents=True)
    try:
        return _measure(boots, build_bundle(parent))
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def python_pass_ms() -> float:
    """One `python -c pass` of this Python, ms (as run.py times it: bytecode writing allowed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    return (time.perf_counter() - started) * 1000


def _measure(boots: int, bundle: Path) -> dict[str, float]:
    runs: dict[str, list[Boot]] = {"gpunode": [], "peers": [], "control": []}
    passes: list[float] = []
    for _ in range(boots):  # interleaved, so drift on the machine hits every flow alike
        passes += [python_pass_ms() for _ in range(PASS_RUNS)]
        for flow in runs:
            boot = one_boot("nc4as-t4-v3", flow, bundle)
            if flow != "control" and not boot.runtime:
                raise SystemExit(f"{flow}: containerd did not end with the nvidia runtime")
            runs[flow].append(boot)
    cpu = [one_boot_cpu(python_first=i % 2 == 1) for i in range(boots + 1)]
    configured = [one_boot_cpu(agent_config=True, python_first=i % 2 == 1)
                  for i in range(boots + 1)]
    gpunode_cpu = statistics.median(c[0] for c in cpu)
    python_unit = statistics.median(c[1] for c in cpu + configured)
    gpunode_configured = statistics.median(c[0] for c in configured)

    def median(flow: str, figure: str) -> float:
        return statistics.median(getattr(boot, figure) for boot in runs[flow])

    ours, peers = median("gpunode", "flow"), median("peers", "flow")
    return {"boot_path_gpunode_ms": ours, "boot_path_peers_ms": peers,
            "boot_path_peers_ratio": peers / ours,
            "boot_path_gpunode_share_ms": median("gpunode", "share"),
            "boot_path_containerd_spawn_ms": median("gpunode", "spawn"),
            "boot_path_control_spawn_ms": median("control", "spawn"),
            "boot_path_gpunode_share_with_spawn_ms": median("gpunode", "with_spawn"),
            "boot_path_python_pass_ms": statistics.median(passes),
            "cpu_node_gpunode_unit_ms": gpunode_cpu, "cpu_node_python_unit_ms": python_unit,
            "cpu_node_noop_ratio": gpunode_cpu / python_unit,
            "cpu_node_configured_unit_ms": gpunode_configured,
            "cpu_node_configured_ratio": gpunode_configured / python_unit}


def report(result: dict[str, float], boots: int = BOOTS) -> None:
    print(f"boot path in a real systemd ({boots} boots each, medians):")
    print(f"  gpunode: gpunode.service start → containerd active with the runtime: "
          f"{result['boot_path_gpunode_ms']:.0f} ms (containerd started once); gpunode's own "
          f"share (to gpunode.service active, when containerd may start): "
          f"{result['boot_path_gpunode_share_ms']:.0f} ms")
    print(f"  systemd's spawn of containerd (from READY=1 to containerd leaving inactive): "
          f"{result['boot_path_containerd_spawn_ms']:.0f} ms after gpunode, "
          f"{result['boot_path_control_spawn_ms']:.0f} ms after a unit that only sleeps "
          f"{CONTROL_SLEEP * 1000:.0f} ms and says READY=1; the share with it, as earlier runs "
          f"measured it: {result['boot_path_gpunode_share_with_spawn_ms']:.0f} ms")
    print(f"  python -c pass between the boots ({PASS_RUNS} before each round): "
          f"{result['boot_path_python_pass_ms']:.1f} ms; the share is "
          f"{result['boot_path_gpunode_share_ms'] / result['boot_path_python_pass_ms']:.2f}x it")
    print(f"  peers: containerd start → configured → restarted → active: "
          f"{result['boot_path_peers_ms']:.0f} ms (containerd started twice)")
    print(f"  ratio peers / gpunode: {result['boot_path_peers_ratio']:.2f}")
    print(f"  CPU-only node, unit activation: gpunode.service "
          f"{result['cpu_node_gpunode_unit_ms']:.0f} ms, a unit running python -c pass "
          f"{result['cpu_node_python_unit_ms']:.0f} ms: {result['cpu_node_noop_ratio']:.2f}x; "
          f"with an agent config (the pipeline checks it): "
          f"{result['cpu_node_configured_unit_ms']:.0f} ms, "
          f"{result['cpu_node_configured_ratio']:.2f}x")


def main() -> int:
    report(measure())
    return 0


PYTHON_PASS_UNIT = "python-pass.service"


def one_boot_cpu(agent_config: bool = False, python_first: bool = False) -> tuple[float, float]:
    """A CPU-only node: (gpunode.service's activation, that of a unit running `python -c pass`
    with the same settings), ms from leaving inactive to active. Without an agent config by
    default (the node gpunode decides from sysfs alone); with one, the pipeline checks it and
    runs. The two never share the CPUs: the python unit runs after gpunode.service, or with
    `python_first` before it (measure() alternates, so that neither always runs in the busier
    part of the boot), and through a shell wrapper on /usr/bin as gpunode does here."""
    work = WORK_PARENT / f"bench-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    try:
        fixture = work / "fixture"
        fixtures.build(fixtures.MACHINES["azure-d4s-v5"], fixture,
                       fixtures.Options(state="bare", flat_sysfs=True, dev_nodes="plain"))
        gpunode = (UNITS / "gpunode.service").read_text()
        order = ("\nBefore=", "\nBefore=gpunode.service ") if python_first else \
            ("\nBefore=", "\nAfter=gpunode.service\nBefore=")
        # (a oneshot: `python -c pass` cannot say READY=1 as gpunode's Type=notify does)
        python = gpunode.replace("ExecStart=/usr/bin/gpunode boot",
                                 "ExecStart=/usr/bin/python-pass").replace(
            "Type=notify\nNotifyAccess=main\n", "Type=oneshot\n").replace(*order, 1)
        units = {"containerd.service": CONTAINERD_UNIT, "gpunode.service": gpunode,
                 PYTHON_PASS_UNIT: python}
        prepare = [*node_prepare(fixture, shipped_dropin=True, agent_config=agent_config),
                   f"printf '#!/bin/sh\\nexec {sys.executable} -c pass\\n' > /usr/bin/python-pass",
                   "chmod 755 /usr/bin/python-pass"]
        with SystemdNamespace(units, work, overlays=("usr", "var/lib"), enable=tuple(units),
                              prepare=prepare, quiet_boot=QUIET_BOOT) as ns:
            ns.wait_active("containerd.service")
            ns.wait_active(PYTHON_PASS_UNIT)
            return activation(ns, "gpunode.service"), activation(ns, PYTHON_PASS_UNIT)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def activation(ns: SystemdNamespace, unit: str) -> float:
    props = ns.unit_properties(unit, "InactiveExitTimestampMonotonic",
                               "ActiveEnterTimestampMonotonic")
    return (int(props["ActiveEnterTimestampMonotonic"]) -
            int(props["InactiveExitTimestampMonotonic"])) / 1000


if __name__ == "__main__":
    sys.exit(main())
