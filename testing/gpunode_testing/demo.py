"""`make demo`: gpunode's main job on a bare fixture GPU node, shown rather than prepared.

    .venv/bin/python -m gpunode_testing.demo        # as root, on Debian after `make setup`

1. A fixture Azure NC4as T4 v3 node (one Tesla T4, driver loaded, nothing configured) boots in a
   real systemd as PID 1 of a private PID+mount namespace (gpunode_testing.boot_harness, the
   end-to-end boot test's harness): gpunode.service, Flatcar's containerd.service and a
   stand-in kubelet. The demo reports gpunode's events per step from the journal and, from
   systemd's own records, that containerd started once, after gpunode.
2. `gpunode status` on that node, its console output as an operator sees it.
3. A container (podman, gpunode_testing.podman) started with `--device nvidia.com/gpu=0` and the
   CDI spec `gpunode boot` wrote (/var/run/cdi/nvidia.yaml, the same bytes), inside the same
   namespace: what it sees of /dev/nvidia0, libcuda and nvidia-smi.

Where the machine cannot boot the namespace (not root, no util-linux namespace tools, no
systemd), the node is a fixture tree booted with `gpunode --root <fixture> boot` instead, and
the demo says so; its container then needs root and podman, and reads a copy of the spec whose
host paths are re-rooted at the fixture. `run()` returns what each step showed (the demo's
integration test asserts on it); `render()` turns it into the lines printed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpunode_testing import fixtures, podman
from gpunode_testing.boot_harness import (
    CONTAINERD_UNIT,
    KUBELET_UNIT,
    UNITS,
    WORK_PARENT,
    node_prepare,
)
from gpunode_testing.systemd_ns import PATH, SYSTEMD_BINARIES, HarnessError, SystemdNamespace

MACHINE = "nc4as-t4-v3"
DEVICE = "nvidia.com/gpu=0"
SPEC = "/var/run/cdi/nvidia.yaml"
LIB64 = "/usr/local/nvidia/lib64"
BIN = "/usr/local/nvidia/bin"  # on PATH in NVIDIA's CUDA images; busybox's PATH lacks it
TOOLKIT = "/usr/bin/nvidia-container-runtime"  # the toolkit's runtime, as boot_harness puts it
# What status rightly warns about on this node: no kubelet (a stand-in), no device plugin.
EXPECTED_WARNINGS = {"kubelet_running", "device_plugin"}


@dataclass
class Seen:
    """What the container printed, and what that means."""

    rc: int
    output: str
    error: str
    version: str  # the driver's, as the driver step reported it
    nvidia0: str | None = None  # "character device 195:0"
    libcuda: str | None = None  # the versioned file libcuda.so.1 is, when it is one
    nvidia_smi: str | None = None  # where `which` found it


@dataclass
class Demo:
    """What each step showed."""

    mode: str  # "systemd": the real-systemd namespace; "root": gpunode --root <fixture> boot
    why_not_systemd: str | None
    events: list[dict[str, Any]] = field(default_factory=list)  # gpunode's boot events
    gpunode_unit: str | None = None  # "success in 240 ms" (systemd mode)
    containerd: str | None = None  # how containerd.service started (systemd mode)
    containerd_starts: int | None = None
    status_text: str = ""
    verdict: str = ""
    warnings: list[str] = field(default_factory=list)  # the checks status warns about
    container: Seen | None = None
    container_skipped: str | None = None
    seconds: float = 0.0

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in ("step.done", "step.failed")]

    def ok(self) -> bool:
        seen = self.container
        return (self.verdict == "ready" and seen is not None and seen.rc == 0
                and bool(seen.nvidia0) and bool(seen.libcuda) and bool(seen.nvidia_smi)
                and self.containerd_starts in (None, 1))


def systemd_unavailable() -> str | None:
    """None where the namespace can boot here; else what is missing, in a few words."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    missing += [tool for tool in ("unshare", "nsenter", "setpriv")
                if shutil.which(tool, path=PATH) is None]
    if not any(p.exists() for p in SYSTEMD_BINARIES):
        missing.append("systemd")
    return f"missing here: {', '.join(missing)}" if missing else None


def run(machine: str = MACHINE, work: Path | None = None, *, systemd: bool = True) -> Demo:
    """The whole demo on a fresh work directory (removed afterwards unless given); in the
    real-systemd namespace where this machine allows it and `systemd` asks for it."""
    start = time.monotonic()
    why = systemd_unavailable() if systemd else "--without-systemd was given"
    with _workdir(work, below=None if why else WORK_PARENT) as directory:
        if why is None:
            demo = _in_systemd(machine, directory)
        else:
            demo = _under_root(machine, directory, why)
    demo.seconds = time.monotonic() - start
    return demo


@contextmanager
def _workdir(given: Path | None, below: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    if below is not None:
        below.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"demo-{secrets.token_hex(2)}-", dir=below))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _in_systemd(machine: str, work: Path) -> Demo:
    fixture = work / "fixture"
    fixtures.build(fixtures.MACHINES[machine], fixture,
                   fixtures.Options(state="driver", flat_sysfs=True, dev_nodes="plain"))
    units = {"gpunode.service": (UNITS / "gpunode.service").read_text(),
             "containerd.service": CONTAINERD_UNIT, "kubelet.service": KUBELET_UNIT}
    demo = Demo("systemd", None)
    with SystemdNamespace(units, work, overlays=("usr", "var/lib"), enable=tuple(units),
                          prepare=node_prepare(fixture)) as ns:
        ns.wait_active("containerd.service")
        unit = ns.unit_properties("gpunode.service", "Result", "ExecMainStartTimestampMonotonic",
                                  "ExecMainExitTimestampMonotonic",
                                  "ActiveEnterTimestampMonotonic")
        took = (int(unit["ExecMainExitTimestampMonotonic"])
                - int(unit["ExecMainStartTimestampMonotonic"])) / 1000
        demo.gpunode_unit = f"{unit['Result']}, its process ran {took:.0f} ms"
        demo.events = _events(str(e.get("MESSAGE", "")) for e in ns.journal("gpunode.service"))
        demo.containerd, demo.containerd_starts = _containerd(ns, unit)
        inside = ["/usr/bin/gpunode"]
        demo.status_text = ns.run([*inside, "--log-format", "console", "status"],
                                  check=False).stdout
        demo.verdict, demo.warnings = _verdict(ns.run([*inside, "status", "--json"],
                                                      check=False).stdout)
        spec_dir = work / "cdi"  # podman's namespace puts a tmpfs on /run: the spec, copied
        spec_dir.mkdir()
        ns.run(["cp", SPEC, str(spec_dir / "nvidia.yaml")])
        if ns.run(["cmp", SPEC, str(spec_dir / "nvidia.yaml")], check=False).returncode != 0:
            raise HarnessError(f"the copy of {SPEC} differs from what gpunode wrote")

        def inside_ns(argv: Sequence[str], env: Mapping[str, str],
                      timeout: float) -> tuple[int, str, str]:
            try:
                done = ns.run(argv, check=False, env=env, timeout=timeout)
            except HarnessError as err:
                return 124, "", str(err)
            return done.returncode, done.stdout, done.stderr

        demo.container, demo.container_skipped = _container(demo, work, spec_dir, inside_ns)
    return demo


def _containerd(ns: SystemdNamespace, gpunode: Mapping[str, str]) -> tuple[str, int]:
    props = ns.unit_properties("containerd.service", "NRestarts",
                               "ExecMainStartTimestampMonotonic")
    starts = sum(1 for e in ns.journal("containerd.service")
                 if str(e.get("MESSAGE", "")).startswith("Started "))
    # gpunode.service is done at its READY=1 (Type=notify: the record written), which its
    # process's exit follows
    after = int(gpunode["ActiveEnterTimestampMonotonic"]) <= \
        int(props["ExecMainStartTimestampMonotonic"])
    argv = ns.main_argv("containerd.service")
    return (f"started {'once' if starts == 1 else f'{starts} times'}, "
            f"{'after' if after else 'BEFORE'} gpunode.service was done, as "
            f"`{' '.join(argv[:3])}` (NRestarts={props['NRestarts']})"), starts


def _under_root(machine: str, work: Path, why: str) -> Demo:
    fixture = fixtures.build(fixtures.MACHINES[machine], work / "fixture",
                             fixtures.Options(state="driver"))
    toolkit = fixture / TOOLKIT.lstrip("/")  # the toolkit, as on the namespace's node
    toolkit.write_text('#!/bin/sh\nexec runc "$@"\n')
    toolkit.chmod(0o755)
    demo = Demo("root", why)
    gpunode = [str(Path(sys.executable).with_name("gpunode")), "--root", str(fixture)]
    boot = subprocess.run([*gpunode, "--log-format", "json", "boot"], capture_output=True,
                          text=True, timeout=60, check=False)
    demo.events = _events(boot.stderr.splitlines())
    demo.status_text = subprocess.run([*gpunode, "--log-format", "console", "status"],
                                      capture_output=True, text=True, timeout=60,
                                      check=False).stdout
    demo.verdict, demo.warnings = _verdict(subprocess.run(
        [*gpunode, "status", "--json"], capture_output=True, text=True, timeout=60,
        check=False).stdout)
    if os.geteuid() != 0:
        demo.container_skipped = "podman's namespace and the fixture's device nodes need root"
        return demo
    if missing := podman.missing_tools():
        demo.container_skipped = "missing " + ", ".join(missing) + " (make setup installs them)"
        return demo
    spec_dir = work / "cdi"
    spec_dir.mkdir()
    document = yaml.safe_load((fixture / SPEC.lstrip("/")).read_text())
    (spec_dir / "nvidia.yaml").write_text(yaml.safe_dump(podman.rerooted(document, fixture)))
    demo.container, demo.container_skipped = _container(demo, work, spec_dir, None)
    return demo


def container_script(version: str) -> str:
    return (f"ls -l /dev/nvidia0; "
            f"stat -c '%n %d:%i' {LIB64}/libcuda.so.1 {LIB64}/libcuda.so.{version}; "
            f"PATH={BIN}:$PATH which nvidia-smi")


def _container(demo: Demo, work: Path, spec_dir: Path,
               runner: podman.Runner | None) -> tuple[Seen | None, str | None]:
    if demo.verdict != "ready":
        return None, "the node is not ready (status above says why)"
    version = next((e.get("driver_version") for e in demo.steps() if e.get("step") == "driver"),
                   None)
    if not version:
        return None, "the driver step reported no driver version"
    script = container_script(str(version))
    rootfs = podman.make_rootfs(work / "rootfs")
    rc, out, err = podman.run_with_cdi(spec_dir, DEVICE, ["/bin/sh", "-c", script], rootfs,
                                       work / "podman", runner=runner)
    return seen(rc, out, err, str(version)), None


def seen(rc: int, out: str, err: str, version: str) -> Seen:
    """Read the container's output (container_script's three commands)."""
    result = Seen(rc, out, err, version)
    inodes: dict[str, str] = {}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("c") and line.endswith("/dev/nvidia0") and len(words) >= 6:
            result.nvidia0 = f"character device {words[4].rstrip(',')}:{words[5]}"
        elif line.startswith(f"{LIB64}/libcuda.so.") and len(words) == 2:
            inodes[words[0].rsplit("/", 1)[1]] = words[1]
        elif line.endswith("/nvidia-smi"):
            result.nvidia_smi = line.strip()
    versioned = f"libcuda.so.{version}"
    if inodes.get("libcuda.so.1") and inodes.get("libcuda.so.1") == inodes.get(versioned):
        result.libcuda = versioned
    return result


def _events(lines: Iterable[str]) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def _verdict(status_json: str) -> tuple[str, list[str]]:
    """status --json's verdict and the checks it warns about."""
    try:
        report = json.loads(status_json)
        return str(report["verdict"]), [str(c["name"]) for c in report["checks"]
                                        if c.get("state") == "warn"]
    except (ValueError, KeyError, TypeError):
        return "unknown (status --json printed no report)", []


def _step_line(event: dict[str, Any]) -> str:
    step, ms = event.get("step", "?"), event.get("duration_ms", 0.0)
    if event["event"] == "step.failed":
        what = f"FAILED: {event.get('error')}"
    elif step == "detect":
        what = f"{event.get('gpus')} GPU(s) of {event.get('functions')} NVIDIA PCI function(s)"
    elif step == "driver":
        made = [n.split()[0] for n in event.get("device_nodes", []) if n.endswith("missing")]
        what = (f"{event.get('reason')} ({event.get('strategy')}); "
                + (f"made {', '.join(made)}" if made else "device nodes already there"))
    elif step == "gpu_init":
        persistenced = event.get("persistenced") or "no nvidia-persistenced"
        what = (f"{len(event.get('ready') or [])} GPU(s) up ({persistenced})"
                + (f"; not up: {', '.join(event.get('not_ready') or {})}"
                   if event.get("not_ready") else ""))
    elif step == "cdi":
        what = (f"{'wrote' if event.get('changed') else 'kept'} {event.get('path')}: "
                f"{event.get('devices')} devices, {event.get('layout')} layout, "
                f"cdiVersion {event.get('cdi_version')}")
    elif step == "containerd":
        what = (f"{'added' if event.get('changed') else 'kept'} the nvidia runtime in "
                f"{event.get('config')}; restarted containerd: "
                f"{'yes' if event.get('restarted') else 'no'}")
    else:
        what = ", ".join(f"{k}={v}" for k, v in event.items()
                         if k not in ("event", "step", "duration_ms", "level", "timestamp"))
    return f"   {step:<11}{ms:>7.1f} ms  {what}"


def render(demo: Demo, machine: str = MACHINE) -> list[str]:
    """The lines the demo prints."""
    description = fixtures.MACHINES[machine].description
    lines = [f"gpunode demo: {description}; NVIDIA driver loaded, nothing configured"]
    if demo.mode == "systemd":
        lines.append("   booted in a real systemd (private PID+mount namespace): "
                     "gpunode.service, Flatcar's containerd.service, a stand-in kubelet")
    else:
        lines.append(f"   no real-systemd namespace ({demo.why_not_systemd}): booted with "
                     "`gpunode --root <fixture> boot` instead")
    unit = f" (gpunode.service: {demo.gpunode_unit})" if demo.gpunode_unit else ""
    lines += ["", f"1. gpunode boot{unit}", *map(_step_line, demo.steps())]
    if demo.containerd:
        lines.append(f"   containerd.service {demo.containerd}")
    lines += ["", "2. gpunode status",
              *(f"   {line}" for line in demo.status_text.rstrip().splitlines())]
    if demo.verdict == "ready" and set(demo.warnings) <= EXPECTED_WARNINGS:
        lines.append(f"   verdict ready; warnings: {', '.join(demo.warnings) or 'none'} (expected: "
                     "no real kubelet and no device plugin run in this demo)")
    else:
        lines.append(f"   verdict: {demo.verdict}; warnings: {', '.join(demo.warnings) or 'none'}")
    spec = "as gpunode wrote it" if demo.mode == "systemd" else \
        "with its host paths re-rooted at the fixture"
    lines += ["", f"3. a container: podman run --device {DEVICE}, the CDI spec {SPEC} {spec}"]
    seen = demo.container
    if seen is None:
        lines.append(f"   skipped: {demo.container_skipped}")
    else:
        lines += [f"   $ {line}" for line in container_script(seen.version).split("; ")]
        lines += [f"   {line}" for line in seen.output.rstrip().splitlines()]
        if seen.rc != 0:
            lines += [f"   podman exited {seen.rc}:",
                      *(f"   {line}" for line in seen.error.rstrip().splitlines()[-15:])]
        lines.append(f"   the container saw /dev/nvidia0: {seen.nvidia0 or 'NOT'}; libcuda.so.1: "
                     f"{'the driver' + chr(39) + 's ' + seen.libcuda if seen.libcuda else 'NOT'}"
                     f"; nvidia-smi: {seen.nvidia_smi or 'NOT on PATH'}")
    verdict = "OK" if demo.ok() else "NOT OK"
    lines += ["", f"demo {verdict} in {demo.seconds:.1f} s (fixture, boot, status, container)"]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpunode_testing.demo",
                                     description="gpunode boot on a bare fixture GPU node, "
                                     "then status, then a container given its GPU by CDI")
    parser.add_argument("--machine", default=MACHINE, choices=sorted(fixtures.MACHINES))
    parser.add_argument("--without-systemd", action="store_true",
                        help="boot with gpunode --root <fixture> boot, not in a real systemd")
    args = parser.parse_args(argv)
    try:
        demo = run(args.machine, systemd=not args.without_systemd)
    except (HarnessError, OSError, subprocess.SubprocessError) as err:
        print(f"gpunode demo failed: {err}", file=sys.stderr)
        return 1
    print("\n".join(render(demo, args.machine)))
    return 0 if demo.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
