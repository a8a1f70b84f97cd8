"""Boot's gpu_init step (gpunode/gpu/init.py) on fixture nodes whose GPUs show the placeholder
UUID, as a node does right after `modprobe nvidia`: persistenced started (or each GPU opened
once), the wait, a GPU that does not come up named by address, and what the spec, `status`,
`label` and `watch` then say.

The fixture world cannot initialize a GPU: tests/helpers/fake_kernel.py's FakeGpus stands in for
nvidia-persistenced and the kernel's side of a first open (it writes the UUID back, or logs
`RmInitAdapter failed!` to the fixture's /dev/kmsg)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode import status
from gpunode.cdi import spec as cdi
from gpunode.config import AgentConfig, GpuConfig
from gpunode.gpu import driverinfo
from gpunode.gpu import init as gpu_init
from gpunode.kube import label
from gpunode.pipeline import boot
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from gpunode.watch import once
from gpunode_testing import fixtures
from helpers.fake_kernel import FakeGpus, FakeKernel

T4, ND96 = "nc4as-t4-v3", "nd96amsr-a100-v4"
DRIVER_MACHINES = [n for n, m in fixtures.MACHINES.items() if "driver" in m.states]
PERSISTENCED = "/usr/bin/nvidia-persistenced"  # the fixture driver's (driver_files)


def node(make_host: HostFactory, machine: str) -> Host:
    """The machine with its driver loaded and no GPU initialized yet."""
    host = make_host(machine, "driver")
    fixtures.uninitialize_gpus(host.root)
    runtime = host.root / "usr/bin/nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    return host


def adapters(host: Host, machine: str, **gpus: object) -> boot.Adapters:
    spec = fixtures.MACHINES[machine]
    return boot.Adapters(systemd=NoSystemd(), kmod=FakeKernel(host.root, spec),
                         gpus=FakeGpus(host.root, spec, **gpus))  # type: ignore[arg-type]


def config(**gpu: object) -> AgentConfig:
    return AgentConfig(gpu=GpuConfig(**gpu))  # type: ignore[arg-type]


def step(run: boot.BootRun, name: str) -> dict[str, object]:
    return next(s for s in run.steps if s["name"] == name)


def spec_names(host: Host) -> list[str]:
    data = (host.root / cdi.SPEC_PATH.lstrip("/")).read_bytes()
    return [str(d["name"]) for d in cdi.parse(data)["devices"]]


def checks(host: Host) -> dict[str, status.Check]:
    report = status.evaluate(status.observe(host, AgentConfig(), contact_api=False))
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize("machine", DRIVER_MACHINES)
def test_boot_brings_every_gpu_up_and_the_spec_status_and_watch_agree(
    make_host: HostFactory, machine: str
) -> None:
    """On every fixture machine: plan says it starts persistenced, boot does and every GPU
    shows its UUID; the spec has each GPU by index and UUID, status's gpu_init and cdi_spec
    pass, and the watch sees the UUIDs the spec names."""
    host = node(make_host, machine)
    fake = adapters(host, machine)
    the_plan = boot.plan(host, config(), fake)
    assert next(a.description for a in the_plan.actions if a.step == "gpu_init").startswith(
        f"start {PERSISTENCED} --persistence-mode")
    run = boot.boot(host, config(), fake)
    record = step(run, "gpu_init")
    infos = driverinfo.read_gpu_infos(host)
    assert (record["outcome"], record["changed"], record["not_ready"]) == ("ok", True, {})
    assert record["ready"] == sorted(infos) and str(record["persistenced"]).startswith("pid 4242")
    uuids = [infos[a].uuid for a in sorted(infos)]
    assert all(uuids)
    assert spec_names(host) == [*sorted([str(i) for i in range(len(infos))] + uuids), "all"]
    found = checks(host)
    assert (found["gpu_init"].state, found["cdi_spec"].state) == ("ok", "ok")
    assert "nvidia-persistenced runs (pid 4242" in found["gpu_init"].detail
    assert once.observe(host, AgentConfig(), kmsg=[]).uuids == {a: infos[a].uuid for a in infos}
    # a second boot starts nothing: persistenced runs
    again = boot.plan(host, config(), adapters(host, machine))
    assert not [a for a in again.actions if a.step == "gpu_init"]


def test_without_persistenced_each_gpu_not_up_is_opened_once(make_host: HostFactory) -> None:
    host = node(make_host, ND96)
    fixtures.initialize_gpu(host.root, fixtures.MACHINES[ND96], "0003:00:00.0")
    fake = adapters(host, ND96)
    run = boot.boot(host, config(persistenced=False), fake)
    opened = [f"/dev/nvidia{i}" for i in (0, 1, 3, 4, 5, 6, 7)]  # 0003:00:00.0 is minor 2
    assert fake.gpus.calls == [("open", path) for path in opened]
    assert (step(run, "gpu_init")["opened"], step(run, "gpu_init")["persistenced"]) == (opened,
                                                                                       None)
    assert checks(host)["gpu_init"].detail.endswith("no nvidia-persistenced runs (no "
                                                    "persistence mode)")


def test_a_persistenced_that_fails_to_start_falls_back_to_opening(
    make_host: HostFactory,
) -> None:
    host = node(make_host, T4)
    fake = adapters(host, T4, start_error="Job for nvidia-persistenced.service failed")
    run = boot.boot(host, config(), fake)
    record = step(run, "gpu_init")
    assert record["outcome"] == "ok" and record["opened"] == ["/dev/nvidia0"]
    assert "not started" in str(record["persistenced"])


def test_a_gpu_whose_initialization_fails_is_named_and_gets_no_device(
    make_host: HostFactory,
) -> None:
    """RmInitAdapter fails on one of eight: the step fails naming it with the kernel's line,
    the other seven are up and in the spec, the failed one is in no device (not even `all`),
    status and GPUReady say not ready because of it."""
    host = node(make_host, ND96)
    run = boot.boot(host, config(), adapters(host, ND96, fail=("0005:00:00.0",)))
    record = step(run, "gpu_init")
    assert (record["outcome"], record["code"]) == ("failed", "gpu-init-failed")
    assert record["not_ready"] == {"0005:00:00.0": "NVRM: GPU 0005:00:00.0: RmInitAdapter "
                                   "failed! (0x22:0x56:667)"}
    assert "0005:00:00.0: NVRM: GPU 0005:00:00.0: RmInitAdapter failed!" in str(record["error"])
    assert len(record["ready"]) == 7  # type: ignore[arg-type]
    names = spec_names(host)
    assert "4" not in names and len(names) == 7 + 7 + 1  # index 4 stays taken
    document = cdi.parse((host.root / cdi.SPEC_PATH.lstrip("/")).read_bytes())
    every = [n["path"] for n in document["devices"][-1]["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidia4" not in every and len(every) == 7
    found = checks(host)
    assert found["gpu_init"].state == "fail" and "0005:00:00.0: NVRM: GPU 0005:00:00.0: " \
        "RmInitAdapter failed!" in found["gpu_init"].detail
    assert found["cdi_spec"].state == "ok"  # the spec leaves it out, as it should
    want = label.for_host(host, AgentConfig(kubernetes=dataclasses.replace(
        AgentConfig().kubernetes, node_name="gpu-node")))
    assert (want.condition.status, want.condition.reason) == ("False", "GpuInitNotReady")
    assert "0005:00:00.0" in want.condition.message
    assert want.labels["gpunode.io/ready"] == "false"


def test_a_gpu_that_never_comes_up_fails_the_step_within_the_bound(
    make_host: HostFactory,
) -> None:
    host = node(make_host, T4)
    run = boot.boot(host, config(init_timeout=1), adapters(host, T4, hang=("0001:00:00.0",)))
    record = step(run, "gpu_init")
    assert record["outcome"] == "failed"
    assert str(record["not_ready"]["0001:00:00.0"]).endswith("not up within 1 s")  # type: ignore[index]
    assert 900 <= float(record["waited_ms"]) < 5000  # type: ignore[arg-type]
    assert spec_names(host) == ["0", "all"]  # its index device while it may still come up


def test_under_root_plan_and_boot_name_the_gpus_not_up(make_host: HostFactory) -> None:
    """No initializer (gpunode --root): nothing is started or opened, no wait; the GPUs not up
    are named by plan and by boot, with the same code."""
    host = node(make_host, T4)
    bare = boot.Adapters(systemd=NoSystemd(), kmod=FakeKernel(host.root, fixtures.MACHINES[T4]))
    problem = next(p for p in boot.plan(host, AgentConfig(), bare).problems
                   if p.step == "gpu_init")
    record = step(boot.boot(host, AgentConfig(), bare), "gpu_init")
    assert (problem.code, record["code"]) == ("gpu-init-failed", "gpu-init-failed")
    assert "under --root gpunode starts nothing" in problem.error
    assert float(record["waited_ms"]) < 500  # type: ignore[arg-type]


def test_a_stale_pid_file_is_no_running_persistenced(tmp_path: Path) -> None:
    (tmp_path / "run/nvidia-persistenced").mkdir(parents=True)
    (tmp_path / "run/nvidia-persistenced/nvidia-persistenced.pid").write_text("77\n")
    (tmp_path / "proc/77").mkdir(parents=True)
    (tmp_path / "proc/77/comm").write_text("bash\n")
    assert gpu_init.persistenced_running(Host(tmp_path)) is None
    (tmp_path / "proc/77/comm").write_text("nvidia-persiste\n")
    assert gpu_init.persistenced_running(Host(tmp_path)) == (
        "pid 77 (/run/nvidia-persistenced/nvidia-persistenced.pid)")
    assert gpu_init.persistenced_running(Host(tmp_path), "active") == (
        "nvidia-persistenced.service is active")


@pytest.mark.parametrize(("lines", "expected"), [
    (["3,1,1,-;NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x22:0x56:667)"],
     {"0000:3b:00.0": "NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x22:0x56:667)"}),
    (["3,1,1,-;NVRM: GPU 0000:3B:00.0: rm_init_adapter failed, device minor number 1"],
     {"0000:3b:00.0": "NVRM: GPU 0000:3B:00.0: rm_init_adapter failed, device minor number 1"}),
    # older drivers name only the minor
    (["3,1,1,-;NVRM: RmInitAdapter failed! (0x26:0xffff:1228)",
      "3,2,1,-;NVRM: rm_init_adapter failed for device bearing minor number 1"],
     {"0000:af:00.0": "NVRM: rm_init_adapter failed for device bearing minor number 1"}),
    (["3,1,1,-;NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x22:0x56:667)",
      "6,2,1,-;NVRM: GPU 0000:3b:00.0: RmInitAdapter succeeded!"], {}),
    (["6,1,1,-;usb 1-1: RmInitAdapter failed! (not NVRM's)",
      "3,1,1,-;NVRM: rm_init_adapter failed for device bearing minor number 7"], {}),
], ids=["550", "550-minor-line", "older-by-minor", "failed-then-succeeded", "not-ours"])
def test_the_kernel_logs_initialization_failures_are_placed_by_address(
    lines: list[str], expected: dict[str, str]
) -> None:
    minors = {0: "0000:3b:00.0", 1: "0000:af:00.0"}
    assert gpu_init.init_failures(lines, minors) == expected


def test_status_names_a_gpu_not_yet_up_and_fails(make_host: HostFactory) -> None:
    host = node(make_host, T4)
    check = checks(host)["gpu_init"]
    assert (check.state, check.code) == ("fail", "gpu-init-failed")
    assert check.detail.startswith("1 GPU not initialized: 0001:00:00.0: /proc/driver/nvidia/"
                                   "gpus/0001:00:00.0/information shows the placeholder UUID")
    assert "gpunode boot" in (check.hint or "")
    document = status.to_json(status.observe(host, AgentConfig(), contact_api=False),
                              status.evaluate(status.observe(host, AgentConfig(),
                                                             contact_api=False)))
    assert "????" not in json.dumps([c for c in document["checks"] if c["name"] != "gpu_init"])
    assert once.observe(host, AgentConfig(), kmsg=[]).uuids == {}  # the watch: no UUID known


class Manager(NoSystemd):
    """A service manager that answers: `unit` has this load state; starts are recorded."""

    available = True

    def __init__(self, load: str) -> None:
        self.load = load
        self.started: list[str] = []

    def load_state(self, unit: str) -> str:
        return self.load

    def start(self, unit: str, timeout: float) -> None:
        self.started.append(unit)


def test_a_unit_file_of_the_node_is_started_as_it_is(tmp_path: Path) -> None:
    from gpunode.gpu.initializers import LiveInitializer

    manager = Manager("loaded")
    said = LiveInitializer(Host(tmp_path), manager).start_persistenced(PERSISTENCED, 60)
    assert manager.started == ["nvidia-persistenced.service"] and "its unit file" in said


def test_without_a_unit_file_persistenced_is_a_transient_unit_of_that_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpunode.gpu import initializers

    ran: list[list[str]] = []
    monkeypatch.setattr(initializers.command, "run", lambda argv, timeout: ran.append(argv))
    initializers.LiveInitializer(Host(tmp_path), Manager("not-found")).start_persistenced(
        PERSISTENCED, 60)
    assert ran == [["systemd-run", "--unit=nvidia-persistenced.service", "--collect",
                    "--service-type=forking",
                    "--property=PIDFile=/run/nvidia-persistenced/nvidia-persistenced.pid",
                    "--description=NVIDIA Persistence Daemon (started by gpunode)",
                    f"{tmp_path}{PERSISTENCED}", "--persistence-mode"]]


def test_where_no_service_manager_answers_nothing_is_started(tmp_path: Path) -> None:
    from gpunode.errors import SystemdError
    from gpunode.gpu.initializers import LiveInitializer

    with pytest.raises(SystemdError, match="no systemd manages this root"):
        LiveInitializer(Host(tmp_path), NoSystemd()).start_persistenced(PERSISTENCED, 60)


def test_opening_reports_each_device_that_could_not_be_opened(tmp_path: Path) -> None:
    from gpunode.gpu.initializers import LiveInitializer

    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidia0").write_text("")
    failed = LiveInitializer(Host(tmp_path), NoSystemd()).open_devices(
        ["/dev/nvidia0", "/dev/nvidia1"], 5)
    assert failed == {"/dev/nvidia1": "No such file or directory"}


def test_a_failed_persistenced_start_that_took_the_whole_bound_leaves_the_opens_their_time(
    make_host: HostFactory,
) -> None:
    """The start ran into the step's bound and failed: the opens it falls back to still get
    the seconds a GPU's first open takes, not nothing."""
    host = node(make_host, T4)
    fake = FakeGpus(host.root, fixtures.MACHINES[T4], start_error="timed out")
    now = [0.0]
    given: list[float] = []
    open_devices = fake.open_devices

    def start_persistenced(binary: str, timeout: float) -> str:
        now[0] += timeout  # the whole bound, then it fails
        return FakeGpus.start_persistenced(fake, binary, timeout)

    def opens(paths: object, timeout: float) -> dict[str, str]:
        given.append(timeout)
        return open_devices(paths, timeout)  # type: ignore[arg-type]

    object.__setattr__(fake, "start_persistenced", start_persistenced)
    object.__setattr__(fake, "open_devices", opens)
    facts = gpu_init.observe(host, [PERSISTENCED])
    the_plan = gpu_init.plan(facts, True)
    outcome = gpu_init.apply(host, the_plan, fake, 5, {}, [PERSISTENCED],
                             clock=lambda: now[0], sleep=lambda s: None)
    assert given == [gpu_init.OPEN_SECONDS] and outcome.opened == ["/dev/nvidia0"]
    assert outcome.not_ready == {}


def test_a_gpu_gone_between_plan_and_open_is_not_opened() -> None:
    """open_paths takes the GPUs the driver still lists: one gone since the plan is skipped."""
    info = driverinfo.GpuInfo(address="0001:00:00.0", model="Tesla T4", minor=0)
    assert gpu_init.open_paths({"0001:00:00.0": info}, ["0001:00:00.0", "0002:00:00.0"]) == (
        "/dev/nvidia0",)


def test_an_external_driver_s_gpus_are_its_owner_s_to_bring_up(make_host: HostFactory) -> None:
    """driver.strategy = "external": gpunode starts and opens nothing; a GPU not up yet is named
    as its owner's to bring up."""
    host = node(make_host, T4)
    fake = adapters(host, T4)
    external = AgentConfig(driver=dataclasses.replace(AgentConfig().driver, strategy="external"))
    run = boot.boot(host, external, fake)
    record = step(run, "gpu_init")
    assert fake.gpus.calls == [] and record["outcome"] == "failed"
    assert gpu_init.EXTERNAL in str(record["not_ready"]["0001:00:00.0"])  # type: ignore[index]
