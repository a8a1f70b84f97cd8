"""The whole node boot in a real systemd (PID+mount namespace): gpunode.service from units/,
a real containerd.service in Flatcar's shape, a stand-in kubelet, and a fixture GPU node
bind-mounted over /sys/bus/pci/devices and /proc (the driver's files), so gpunode runs as on a
node, with root /. Everything is asserted from systemd's own records and the journal."""

from __future__ import annotations

import json
import resource
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode_testing import driver_files, fixtures
from gpunode_testing.boot_harness import (
    CONTAINERD_UNIT,
    KUBELET_UNIT,
    UNITS,
    WORK_PARENT,
    node_prepare,
)
from gpunode_testing.systemd_ns import MACHINE_PATHS, SystemdNamespace

pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS)

@pytest.fixture
def workdir() -> Iterator[Path]:
    path = WORK_PARENT / f"boot-{secrets.token_hex(4)}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def boot_node(workdir: Path, machine: str, state: str, shipped_dropin: bool = False,
              prepare: tuple[str, ...] = ()) -> SystemdNamespace:
    fixture = workdir / "fixture"
    fixtures.build(fixtures.MACHINES[machine], fixture,
                   fixtures.Options(state=state, flat_sysfs=True, dev_nodes="plain"))
    return boot_node_at(workdir, fixture, shipped_dropin, prepare)


def boot_node_at(workdir: Path, fixture: Path, shipped_dropin: bool = False,
                 prepare: tuple[str, ...] = ()) -> SystemdNamespace:
    units = {"gpunode.service": (UNITS / "gpunode.service").read_text(),
             "containerd.service": CONTAINERD_UNIT, "kubelet.service": KUBELET_UNIT}
    return SystemdNamespace(units, workdir, overlays=("usr", "var/lib"),
                            enable=("gpunode.service", "containerd.service", "kubelet.service"),
                            prepare=[*node_prepare(fixture, shipped_dropin=shipped_dropin),
                                     *prepare])


def _may_raise_rlimits() -> bool:
    """Whether this machine lets root raise a hard rlimit (CAP_SYS_RESOURCE, bit 24)."""
    status = Path("/proc/self/status").read_text()
    effective = next(line.split()[1] for line in status.splitlines()
                     if line.startswith("CapEff:"))
    return bool(int(effective, 16) >> 24 & 1)


def props(ns: SystemdNamespace, unit: str, *names: str) -> dict[str, str]:
    return ns.unit_properties(unit, *names)


def gpunode_json(ns: SystemdNamespace, *args: str) -> dict[str, object]:
    done = ns.run(["/usr/bin/gpunode", "--log-format", "json", *args], check=False)
    return dict(json.loads(done.stdout))


def test_gpu_node_boot_gpunode_before_containerd_which_starts_once_with_the_runtime(
    workdir: Path,
) -> None:
    with boot_node(workdir, "nc4as-t4-v3", "driver") as ns:
        ns.wait_active("kubelet.service")
        ns.wait_active("containerd.service")
        gpunode = props(ns, "gpunode.service", "Result", "ExecMainStatus", "Type", "SubState",
                        "InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic",
                        "ExecMainExitTimestampMonotonic")
        containerd = props(ns, "containerd.service", "NRestarts", "InvocationID", "MainPID",
                           "ExecMainStartTimestampMonotonic")
        assert (gpunode["Result"], gpunode["ExecMainStatus"]) == ("success", "0")
        # Type=notify: active at the pipeline's READY=1 (the record written), before its
        # process exited; active (exited) after.
        assert (gpunode["Type"], gpunode["SubState"]) == ("notify", "exited")
        assert int(gpunode["ActiveEnterTimestampMonotonic"]) < \
            int(gpunode["ExecMainExitTimestampMonotonic"])
        assert int(gpunode["ActiveEnterTimestampMonotonic"]) <= \
            int(containerd["ExecMainStartTimestampMonotonic"])
        started = [e for e in ns.journal("containerd.service")
                   if str(e.get("MESSAGE", "")).startswith("Started ")]
        assert len(started) == 1 and containerd["NRestarts"] == "0"  # started exactly once
        assert ns.main_argv("containerd.service")[1:3] == ["--config",
                                                           "/etc/containerd/config.toml"]
        dump = ns.run(["containerd", "--config", "/etc/containerd/config.toml", "config",
                       "dump"]).stdout
        assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in dump
        # gpunode's LimitMEMLOCK drop-in landed before that one start (a daemon-reload, no
        # restart): containerd runs with it, and so do the containers it starts.
        assert props(ns, "containerd.service", "LimitMEMLOCK")["LimitMEMLOCK"] == "infinity"
        limits = ns.run(["cat", f"/proc/{containerd['MainPID']}/limits"]).stdout
        locked = next(line.split()[3:5] for line in limits.splitlines()
                      if line.startswith("Max locked memory"))
        if _may_raise_rlimits():
            assert locked == ["unlimited", "unlimited"], limits
        else:  # systemd sets the closest limit it may (setrlimit_closest)
            hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
            print(f"this machine withholds CAP_SYS_RESOURCE: containerd runs with the hard "
                  f"RLIMIT_MEMLOCK {hard} it allows, not unlimited")
            assert locked[1] == str(hard), limits

        status = gpunode_json(ns, "status", "--json")
        checks = {c["name"]: c["state"] for c in status["checks"]}  # type: ignore[attr-defined]
        assert {k: checks[k] for k in ("gpus", "driver", "device_nodes", "containerd_runtime",
                                       "containerd_running", "last_boot")} == {
            "gpus": "ok", "driver": "ok", "device_nodes": "ok", "containerd_runtime": "ok",
            "containerd_running": "ok", "last_boot": "ok"}

        # The journal has gpunode's JSON events, one per step, with durations.
        events = [json.loads(e["MESSAGE"]) for e in ns.journal("gpunode.service")
                  if str(e.get("MESSAGE", "")).startswith("{")]
        steps = {e["step"]: e for e in events if e["event"] == "step.done"}
        assert set(steps) == {"detect", "driver", "gpu_init", "cdi", "containerd"}
        assert all(isinstance(e["duration_ms"], float) for e in steps.values())

        # A second boot of gpunode changes nothing and restarts nothing. The restart returns at
        # READY=1; the process logs boot.done and exits after it.
        ns.systemctl("restart", "gpunode.service")
        ns.wait_for(lambda: props(ns, "gpunode.service", "SubState")["SubState"] != "running",
                    30, "the second boot's gpunode to exit", unit="gpunode.service")
        again = props(ns, "containerd.service", "InvocationID", "NRestarts")
        assert (again["InvocationID"], again["NRestarts"]) == (containerd["InvocationID"], "0")
        again_events = [json.loads(e["MESSAGE"]) for e in ns.journal("gpunode.service")
                        if str(e.get("MESSAGE", "")).startswith("{")][len(events):]
        assert again_events[-1]["event"] == "boot.done"
        assert [e.get("changed") for e in again_events if e["event"] == "step.done"] == [
            False, False, False, False, False]
        # the second boot says READY=1 too (without it the unit would fail: protocol)
        assert props(ns, "gpunode.service", "Result", "SubState") == {
            "Result": "success", "SubState": "exited"}

        # Every unit of units/ passes systemd-analyze verify, with /usr/bin/gpunode in place.
        for unit in sorted(UNITS.glob("*.service")):
            ns.run(["cp", str(unit), f"/run/verify-{unit.name}"])
        verify = ns.run(["systemd-analyze", "verify",
                         *(f"/run/verify-{u.name}" for u in sorted(UNITS.glob("*.service")))],
                        check=False)
        assert verify.returncode == 0, verify.stderr


def test_with_the_shipped_drop_in_the_first_boot_points_containerd_at_the_copy_unreloaded(
    workdir: Path,
) -> None:
    """gpunode's sysext ships containerd.service.d/10-gpunode-env.conf: containerd starts once,
    reading the writable copy named in /etc/gpunode/containerd.env and with LimitMEMLOCK from
    the shipped drop-in, and nobody asked systemd to reload its units."""
    with boot_node(workdir, "nc4as-t4-v3", "driver", shipped_dropin=True) as ns:
        ns.wait_active("kubelet.service")
        ns.wait_active("containerd.service")
        assert gpunode_json(ns, "status", "--json")["ready"] is True
        assert ns.main_argv("containerd.service")[1:3] == ["--config",
                                                           "/etc/containerd/config.toml"]
        assert props(ns, "containerd.service", "NRestarts")["NRestarts"] == "0"
        assert ns.run(["cat", "/etc/gpunode/containerd.env"]).stdout.endswith(
            "CONTAINERD_CONFIG=/etc/containerd/config.toml\n")
        assert ns.run(["ls", "/etc/systemd/system/containerd.service.d"],
                      check=False).stdout.strip() == ""
        assert props(ns, "containerd.service", "LimitMEMLOCK")["LimitMEMLOCK"] == "infinity"
        manager = ns.run(["journalctl", "--no-pager", "-o", "cat", "_PID=1"]).stdout
        assert "Reloading" not in manager, manager
        dump = ns.run(["containerd", "--config", "/etc/containerd/config.toml", "config",
                       "dump"]).stdout
        assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in dump


def test_cpu_node_boot_is_a_no_op(workdir: Path) -> None:
    with boot_node(workdir, "azure-d4s-v5", "bare") as ns:
        ns.wait_active("containerd.service")
        assert props(ns, "gpunode.service", "Result")["Result"] == "success"
        record = json.loads(ns.run(["cat", "/run/gpunode/state.json"]).stdout)
        assert record["outcome"] == "no-gpu"
        assert ns.run(["test", "-e", "/etc/containerd/config.toml"], check=False).returncode == 1
        assert ns.main_argv("containerd.service")[1:3] == [
            "--config", "/usr/share/containerd/config.toml"]


def test_failing_gpunode_does_not_keep_containerd_or_kubelet_down(workdir: Path) -> None:
    # A T4 whose driver is not loaded and nothing can load it: the driver step fails.
    with boot_node(workdir, "nc4as-t4-v3", "bare") as ns:
        ns.wait_active("containerd.service")
        ns.wait_active("kubelet.service")
        assert props(ns, "gpunode.service", "Result")["Result"] == "exit-code"
        status = gpunode_json(ns, "status", "--json")
        checks = {c["name"]: c for c in status["checks"]}  # type: ignore[attr-defined]
        assert checks["driver"]["state"] == "fail"
        assert checks["last_boot"]["state"] == "warn"
        assert "driver: nothing can provide the NVIDIA modules" in checks["last_boot"]["detail"]
        # the runtime step still ran: containerd came up with the nvidia runtime
        assert checks["containerd_runtime"]["state"] == "ok"


def test_boot_starts_persistenced_as_a_unit_that_outlives_it_and_waits_for_the_gpus(
    workdir: Path,
) -> None:
    """A T4 right after `modprobe nvidia` (its UUID GPU-????…): gpunode.service starts the
    driver's nvidia-persistenced as the unit nvidia-persistenced.service through the real
    systemd, waits until the GPU shows its UUID, and writes the spec with it; persistenced keeps
    running after gpunode exits, in its own unit, and a second boot starts no second one.
    The stand-in persistenced does to the fixture's /proc what the daemon's first open does
    to a GPU: it writes the GPU's information file as the driver shows it initialized."""
    fixture = workdir / "fixture"
    machine = fixtures.MACHINES["nc4as-t4-v3"]
    fixtures.build(machine, fixture, fixtures.Options(state="driver", flat_sysfs=True,
                                                      dev_nodes="plain"))
    info = fixture / "proc/driver/nvidia/gpus/0001:00:00.0/information"
    initialized = workdir / "initialized-information"
    initialized.write_text(info.read_text())
    uuid = next(line.split()[-1] for line in info.read_text().splitlines()
                if line.startswith("GPU UUID"))
    fixtures.uninitialize_gpus(fixture)
    (fixture / "usr/bin/nvidia-persistenced").write_text(
        driver_files.PERSISTENCED_STAND_IN
        + f"cat {initialized} > /{info.relative_to(fixture)}\n")
    with boot_node_at(workdir, fixture) as ns:
        ns.wait_active("containerd.service")
        assert props(ns, "gpunode.service", "Result")["Result"] == "success"
        unit = props(ns, "nvidia-persistenced.service", "ActiveState", "MainPID", "ControlGroup",
                     "InvocationID", "ExecStart")
        assert unit["ActiveState"] == "active", ns.diagnose("nvidia-persistenced.service")
        assert "/usr/bin/nvidia-persistenced --persistence-mode" in unit["ExecStart"]
        pid_file = ns.run(["cat", "/run/nvidia-persistenced/nvidia-persistenced.pid"]).stdout
        assert pid_file.strip() == unit["MainPID"]
        assert unit["ControlGroup"].endswith("/nvidia-persistenced.service")
        record = json.loads(ns.run(["cat", "/run/gpunode/state.json"]).stdout)
        gpu_init = next(s for s in record["steps"] if s["name"] == "gpu_init")
        assert (gpu_init["outcome"], gpu_init["changed"], gpu_init["ready"]) == (
            "ok", True, ["0001:00:00.0"])
        spec = json.loads(ns.run(["sed", "1d", "/var/run/cdi/nvidia.yaml"]).stdout)
        assert [d["name"] for d in spec["devices"]] == ["0", uuid, "all"]
        checks = {c["name"]: c for c in gpunode_json(ns, "status", "--json")["checks"]}  # type: ignore[attr-defined]
        assert checks["gpu_init"]["state"] == "ok"
        assert "nvidia-persistenced.service is active" in checks["gpu_init"]["detail"]
        assert checks["cdi_spec"]["state"] == "ok"

        ns.systemctl("restart", "gpunode.service")
        again = props(ns, "nvidia-persistenced.service", "InvocationID", "MainPID")
        assert again == {"InvocationID": unit["InvocationID"], "MainPID": unit["MainPID"]}
        record = json.loads(ns.run(["cat", "/run/gpunode/state.json"]).stdout)
        gpu_init = next(s for s in record["steps"] if s["name"] == "gpu_init")
        assert (gpu_init["outcome"], gpu_init["changed"]) == ("ok", False)
