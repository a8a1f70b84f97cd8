"""plan ≡ boot: on every node the fixtures can build, `gpunode plan` names exactly the steps
`gpunode boot` then changes and exactly the steps it then fails at (with the same error code).

Both walk gpunode.pipeline.boot.STEPS with the same fake adapters: no service manager (or one
that says Flatcar's nvidia.service is enabled), and a fake kernel whose `modprobe nvidia` makes the
fixture's /proc show a loaded driver, as tests/unit/test_driver.py's does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.driver.modinfo import ModuleInfo
from gpunode.errors import GpunodeError
from gpunode.pipeline import boot
from gpunode.platform import flatcar
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from gpunode_testing import fixtures
from helpers.fake_kernel import FakeGpus, stand_in_modinfo
from hostile.support import Cli

T4 = "nc4as-t4-v3"
SYSEXT_RELEASE = "/usr/lib/extension-release.d/extension-release.flatcar-nvidia-drivers-570"
KUBEADM_UNIT = {  # a kubeadm kubelet, for the registration step
    "/etc/systemd/system/kubelet.service": "[Service]\nExecStart=/opt/bin/kubelet\n",
    "/etc/systemd/system/kubelet.service.d/10-kubeadm.conf":
        "[Service]\nExecStart=\nExecStart=/opt/bin/kubelet $KUBELET_KUBEADM_ARGS\n"}


@dataclass
class FakeKernel:
    """kmod as a kernel would answer it: `modprobe nvidia` loads the fixture's driver."""

    root: Path
    machine: fixtures.Machine
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def modinfo(self, paths: list[str]) -> dict[str, ModuleInfo]:
        deps = {"nvidia_uvm": ["nvidia"], "nvidia_modeset": ["nvidia"]}
        return {p: stand_in_modinfo(self.root, self.machine, p, deps) for p in paths}

    def run(self, argv: tuple[str, ...]) -> None:
        self.calls.append(argv)
        if Path(argv[-1]).name.split(".ko")[0] == "nvidia":
            fixtures.load_driver(self.root, self.machine)


class FlatcarNvidiaEnabled(NoSystemd):
    def enabled(self, unit: str) -> bool:
        return unit == flatcar.NVIDIA_UNIT


@dataclass(frozen=True)
class Case:
    machine: str
    state: str
    extra: dict[str, str] = field(default_factory=dict)
    runtime: bool = False  # the NVIDIA container runtime is installed
    register_with: str = "none"
    nvidia_service: bool = False  # Flatcar's nvidia.service is enabled
    dev_nodes: str = "auto"  # "plain": the device nodes are plain files (boot remakes them)
    stack: str = "gpunode"  # kubernetes.stack ("gpu-operator": the nvidia_smi step runs too)
    uninitialized: bool = False  # the GPUs show the placeholder UUID (driver just loaded)
    gpus: bool = False  # a stand-in persistenced and kernel bring them up (FakeGpus)

    def host(self, make_host: HostFactory) -> Host:
        host = make_host(self.machine, self.state, extra=self.extra, dev_nodes=self.dev_nodes)
        if self.uninitialized:
            fixtures.uninitialize_gpus(host.root)
        if self.runtime:
            binary = host.root / "usr/bin/nvidia-container-runtime"
            binary.write_text("#!/bin/sh\n")
            binary.chmod(0o755)
        return host

    def config(self) -> AgentConfig:
        return AgentConfig(kubernetes=KubernetesConfig(register_with=self.register_with,
                                                       stack=self.stack))

    def adapters(self, host: Host) -> boot.Adapters:
        systemd = FlatcarNvidiaEnabled() if self.nvidia_service else NoSystemd()
        machine = fixtures.MACHINES[self.machine]
        return boot.Adapters(systemd=systemd, kmod=FakeKernel(host.root, machine),
                             gpus=FakeGpus(host.root, machine) if self.gpus else None)


CASES = {f"{name}-{state}": Case(name, state)
         for name, machine in fixtures.MACHINES.items() for state in machine.states}
CASES |= {
    "t4-driver-with-runtime": Case(T4, "driver", runtime=True),
    "t4-ready-device-nodes-plain-files": Case(T4, "ready", dev_nodes="plain"),
    "t4-bare-sysext-with-runtime": Case(T4, "bare", {SYSEXT_RELEASE: "ID=flatcar\n"},
                                        runtime=True),
    "t4-ready-kubelet-registration": Case(T4, "ready", KUBEADM_UNIT, register_with="kubelet",
                                          stack="gpu-operator"),
    "t4-bare-kubelet-registration": Case(T4, "bare", KUBEADM_UNIT, runtime=True,
                                         register_with="kubelet"),
    "t4-ready-nvidia-service-enabled": Case(T4, "ready", nvidia_service=True),
    "cpu-nvidia-service-enabled": Case("azure-d4s-v5", "bare", nvidia_service=True),
    # Right after the driver loaded: the GPUs show GPU-????…. A stand-in persistenced brings
    # them up (boot starts it, then waits); under --root nothing does (boot fails, as planned).
    **{f"{name}-driver-uninitialized": Case(name, "driver", runtime=True, uninitialized=True,
                                            gpus=True)
       for name, machine in fixtures.MACHINES.items() if "driver" in machine.states},
    "t4-driver-uninitialized-under-root": Case(T4, "driver", runtime=True, uninitialized=True),
}


def files(root: Path) -> dict[str, Any]:
    """Every path under root but the boot record and stamp, with what a change would alter."""
    state: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        relative = "/" + str(path.relative_to(root))
        if relative in ("/run", "/run/gpunode") or relative.startswith("/run/gpunode/"):
            continue
        st = path.lstat()
        state[relative] = (st.st_mode, st.st_rdev, path.readlink() if path.is_symlink()
                           else path.read_bytes() if path.is_file() else None)
    return state


def walk(case: Case, make_host: HostFactory) -> tuple[Host, boot.Plan, boot.BootRun]:
    host = case.host(make_host)
    config, adapters = case.config(), case.adapters(host)
    the_plan = boot.plan(host, config, adapters)
    return host, the_plan, boot.boot(host, config, adapters)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_plan_names_exactly_the_steps_boot_changes_and_fails_at(
    case: Case, make_host: HostFactory
) -> None:
    host = case.host(make_host)
    config, adapters = case.config(), case.adapters(host)
    the_plan = boot.plan(host, config, adapters)
    before = files(host.root)
    run = boot.boot(host, config, adapters)

    planned = {a.step for a in the_plan.actions}
    would_fail = {p.step: (p.code, p.error, p.hint) for p in the_plan.problems}
    changed = {s["name"] for s in run.steps if s.get("changed")}
    failed = {s["name"]: (s["code"], s["error"], s["hint"]) for s in run.steps
              if s["outcome"] == "failed"}
    assert changed == planned - set(failed), (the_plan, run.steps)
    assert failed == would_fail, (the_plan, run.steps)
    assert all(isinstance(code, str) and code for code, _, _ in failed.values())
    assert all(s["code"] is None for s in run.steps if s["outcome"] == "ok")
    if not planned:
        assert files(host.root) == before  # "nothing to change" and boot changed nothing


@pytest.mark.parametrize("case", [c for c in CASES.values() if c.state != "bare" or c.runtime],
                         ids=[k for k, c in CASES.items() if c.state != "bare" or c.runtime])
def test_after_a_boot_plan_has_nothing_left_to_do_where_boot_succeeded(
    case: Case, make_host: HostFactory
) -> None:
    host, _, run = walk(case, make_host)
    again = boot.plan(host, case.config(), case.adapters(host))
    ok = {s["name"] for s in run.steps if s["outcome"] == "ok"}
    assert not {a.step for a in again.actions} & ok, again.actions


def test_plan_names_flatcars_nvidia_service_as_the_problem_boot_stops_at(
    make_host: HostFactory,
) -> None:
    _, the_plan, run = walk(CASES["t4-ready-nvidia-service-enabled"], make_host)
    (problem,) = the_plan.problems
    assert (problem.step, problem.code, the_plan.actions) == ("preflight", run.steps[1]["code"], [])
    assert "Flatcar's nvidia.service is inactive and enabled" in problem.error
    assert problem.hint and problem.hint.startswith("mask it: 'systemctl mask nvidia.service'")
    assert [s["name"] for s in run.steps] == ["detect", "preflight"]


def test_plan_names_the_kubelet_drop_in_that_boot_then_writes(make_host: HostFactory) -> None:
    _, the_plan, run = walk(CASES["t4-ready-kubelet-registration"], make_host)
    assert [a.step for a in the_plan.actions] == ["registration"]
    step = next(s for s in run.steps if s["name"] == "registration")
    assert (step["outcome"], step["changed"]) == ("ok", True)


def test_a_failed_detection_is_a_refusal_for_plan_and_the_failed_step_for_boot(
    make_host: HostFactory,
) -> None:
    host = make_host(T4, "bare")
    (host.root / "sys/devices/pci0001:00/0001:00:00.0/vendor").write_text("0xzzzz\n")
    adapters = boot.Adapters(systemd=NoSystemd(), kmod=None)  # type: ignore[arg-type]
    with pytest.raises(GpunodeError) as refused:
        boot.plan(host, AgentConfig(), adapters)
    run = boot.boot(host, AgentConfig(), adapters)
    assert [(s["name"], s["code"]) for s in run.steps] == [("detect", refused.value.code)]


def test_plans_json_problems_carry_the_code_boots_record_then_carries(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpunode.cli.main import main

    host = make_host(T4, "bare")
    assert main(["--log-format", "json", "--root", str(host.root), "plan", "--json"]) == 0
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert main(["--log-format", "json", "--root", str(host.root), "boot"]) == 1
    record = json.loads((host.root / "run/gpunode/state.json").read_text())
    assert [(p["step"], p["code"]) for p in problems] == [
        (s["name"], s["code"]) for s in record["steps"] if s["outcome"] == "failed"]
    assert all(p["code"] for p in problems)


def test_the_record_read_back_gives_each_step_boot_ran_by_name(make_host: HostFactory) -> None:
    from gpunode.pipeline.state import read_record

    host, _, _ = walk(CASES["t4-bare-sysext-with-runtime"], make_host)
    record = read_record(host)
    assert record is not None
    driver = record.step("driver")
    assert driver is not None
    assert (driver["strategy"], driver["changed"]) == ("flatcar-sysext", True)
    assert record.step("registration") is None  # not asked for: boot did not run it


def test_plan_names_the_rollback_of_an_interrupted_change_that_boot_then_does(
    make_host: HostFactory, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`containerd configure --enable-cdi` killed before its ledger write leaves a journal:
    plan says boot rolls it back, and boot's record says containerd changed the node."""
    from gpunode.containerd import journal, ledger

    case = CASES["t4-driver-with-runtime"]
    host = case.host(make_host)
    assert cli("--root", str(host.root), "containerd", "configure").code == 0
    real = Host.write_atomic

    def killed(self: Host, path: str, *args: Any, **kwargs: Any) -> None:
        if path == ledger.LEDGER:
            raise SystemExit(137)  # nothing after this runs, as after a SIGKILL
        real(self, path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Host, "write_atomic", killed)
        cli("--root", str(host.root), "containerd", "configure", "--enable-cdi")
    assert journal.pending(host)
    config, adapters = case.config(), case.adapters(host)
    the_plan = boot.plan(host, config, adapters)
    located = located_while(monkeypatch, lambda: journal.pending(host))
    run = boot.boot(host, config, adapters)
    assert located == [False]  # not early (locate.early): only after the rollback
    # (a driver-state fixture has no CDI spec yet: boot writes it too)
    assert [a.step for a in the_plan.actions] == ["cdi", "containerd"]
    assert "roll back the interrupted change" in the_plan.actions[1].description
    assert {s["name"] for s in run.steps if s.get("changed")} == {"cdi", "containerd"}
    assert not journal.pending(host)


@pytest.mark.parametrize("name", ["t4-driver-with-runtime", f"{T4}-ready"])
def test_a_loaded_driver_s_user_space_is_searched_once_a_boot(
        make_host: HostFactory, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A driver already loaded (the driver step's "verify"): its plan finds the user-space,
    its apply and the cdi step take that instead of searching again."""
    from gpunode.driver import userspace

    case = CASES[name]
    host = case.host(make_host)
    calls: list[str] = []
    real = userspace.find

    def counted(*args: Any, **kwargs: Any) -> userspace.DriverRoot:
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(userspace, "find", counted)
    run = boot.boot(host, case.config(), case.adapters(host))
    assert run.outcome == "ok"
    driver, cdi = (next(s for s in run.steps if s["name"] == n) for n in ("driver", "cdi"))
    assert (driver["action"], driver["driver_root"]["libraries"]) == ("verify", 10)
    assert (cdi["outcome"], cdi["devices"]) == ("ok", 3)
    assert calls == ["550.127.08"]


def located_while(monkeypatch: pytest.MonkeyPatch, observe: Callable[[], object]) -> list[object]:
    """What `observe` said at each call of locate.locate from now on."""
    from gpunode.containerd import locate

    seen: list[object] = []
    real = locate.locate

    def recorded(*args: Any, **kwargs: Any) -> locate.Located:
        seen.append(observe())
        return real(*args, **kwargs)

    monkeypatch.setattr(locate, "locate", recorded)
    return seen


@dataclass
class RecordingProbe:
    """containerd's answers for a boot, noting whether the CDI spec existed at each start."""

    spec: Path
    started: list[tuple[str, str | None, bool, bool]] = field(default_factory=list)

    def prefetch(self, binary: str, path: str | None, version: bool = True) -> None:
        self.started.append((binary, path, version, self.spec.exists()))

    def version(self, binary: str) -> tuple[int, int] | None:
        return (1, 7)

    def dump(self, binary: str, path: str) -> dict[str, Any] | None:
        return None

    def discard(self) -> None:
        pass


def test_containerd_is_located_and_probed_before_the_driver_and_cdi_steps_run(
        make_host: HostFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Boot locates containerd's config once, right after detect (locate.early), and starts
    `--version` then: it runs while the driver and cdi steps work, before the spec is
    written."""
    case = CASES["t4-driver-with-runtime"]
    host = case.host(make_host)
    from gpunode.containerd import discover, locate, step

    probe = RecordingProbe(host.root / "var/run/cdi/nvidia.yaml")
    adapters = boot.Adapters(systemd=NoSystemd(), kmod=case.adapters(host).kmod, probe=probe)
    cdi_written = located_while(monkeypatch, probe.spec.exists)
    asked: list[str] = []  # containerd's unit asked for its config (over D-Bus on a node)

    def active_config(*args: Any) -> discover.ActiveConfig:
        asked.append("unit")
        return discover.active_config(*args)

    for module in (locate, step):
        monkeypatch.setattr(module, "active_config", active_config)
    run = boot.boot(host, case.config(), adapters)
    assert run.outcome == "ok" and probe.spec.exists()
    assert cdi_written == [False]  # one locating, before the cdi step
    assert asked == ["unit"]  # and no other (recover() has no journal to check it against)
    # early, the version alone (one Go program beside gpunode), taken by the step's plan; a
    # version whose defaults gpunode knows (1.7) is not asked for its dump
    assert probe.started == [("/usr/bin/containerd", None, True, False),
                             ("/usr/bin/containerd", None, True, True)]
    step = next(s for s in run.steps if s["name"] == "containerd")
    assert (step["outcome"], step["changed"]) == ("ok", True)


def test_a_failure_to_locate_early_is_the_containerd_step_s_own(
        make_host: HostFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """An /etc/containerd/config.toml containerd does not read: located early, refused in the
    containerd step's turn with the step's own message, the steps before it unaffected."""
    case = CASES["t4-driver-with-runtime"]
    host = case.host(make_host)
    (host.root / "etc/containerd").mkdir(parents=True, exist_ok=True)
    (host.root / "etc/containerd/config.toml").write_text("version = 2\n")
    tries = located_while(monkeypatch, lambda: None)
    run = boot.boot(host, case.config(), case.adapters(host))
    outcomes = {s["name"]: s["outcome"] for s in run.steps}
    assert outcomes == {"detect": "ok", "driver": "ok", "gpu_init": "ok", "cdi": "ok",
                        "containerd": "failed"}
    step = next(s for s in run.steps if s["name"] == "containerd")
    assert "exists but is not the config containerd uses" in step["error"]
    assert step["code"] == "containerd-step-failed" and len(tries) == 1
