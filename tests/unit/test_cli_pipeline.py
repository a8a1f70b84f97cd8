"""`plan`, `boot` and `containerd configure|revert` as a user runs them on a node's root."""

from __future__ import annotations

import json

import pytest

from conftest import HostFactory
from gpunode.cli.main import main
from gpunode.platform.host import Host


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[dict]]:
    code = main(["--log-format", "json", *argv])
    out, err = capsys.readouterr()
    return code, out, [json.loads(line) for line in err.splitlines()]


@pytest.fixture
def node(flatcar: Host) -> Host:
    return flatcar


def test_plan_lists_the_changes_and_touches_nothing(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(node.root.rglob("*"))
    code, out, _ = run(capsys, "--root", str(node.root), "plan", "--json")
    doc = json.loads(out)
    assert code == 0
    assert doc["changes"] is True
    assert [a["step"] for a in doc["actions"]] == ["cdi"] + ["containerd"] * 4
    assert doc["actions"][-1]["description"].startswith(
        "write /etc/systemd/system/containerd.service.d/20-gpunode-memlock.conf")
    assert doc["actions"][0]["description"].startswith("write /var/run/cdi/nvidia.yaml: 1 GPU")
    assert doc["actions"][1]["description"].startswith("copy /usr/share/containerd/config.toml")
    assert sorted(node.root.rglob("*")) == before


def test_plan_on_a_bare_node_exits_0_and_names_what_boot_would_fail_at(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """plan could plan: that boot would fail at two steps is its answer, not its failure."""
    host = make_host("nc4as-t4-v3", "bare")
    code, out, events = run(capsys, "--root", str(host.root), "plan", "--json")
    doc = json.loads(out)
    assert code == 0
    assert (doc["changes"], doc["would_fail"]) == (False, True)
    assert [(p["step"], p["error"].split(":")[0]) for p in doc["problems"]] == [
        ("driver", "nothing can provide the NVIDIA modules for kernel 6.6.60-flatcar"),
        ("gpu_init", "no GPU to bring up"),  # no driver, no GPU it could initialize
        ("cdi", "no CDI spec"),  # it names the driver's nodes and files
        ("containerd", f"runtime binary {host.root}/usr/bin/nvidia-container-runtime is not "
                       "an executable file on this host")]
    assert all(p["hint"] for p in doc["problems"])
    assert [e["level"] for e in events] == ["info"]
    code, out, _ = run(capsys, "--root", str(host.root), "plan")
    assert code == 0
    assert out.splitlines()[0].startswith("driver: would fail: nothing can provide")
    assert out.splitlines()[1].startswith("  hint: enable the Flatcar driver sysext")


def test_boot_configures_records_and_a_second_boot_changes_nothing(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, events = run(capsys, "--root", str(node.root), "boot")
    assert code == 0
    record = json.loads((node.root / "run/gpunode/state.json").read_text())
    assert record["outcome"] == "ok"
    assert [s["name"] for s in record["steps"]] == ["detect", "driver", "gpu_init", "cdi",
                                                    "containerd"]
    assert record["steps"][1]["strategy"] == "external"  # the fixture's driver is loaded
    assert record["steps"][2]["ready"] == ["0001:00:00.0"]  # the fixture's GPU is up
    assert record["steps"][3]["changed"] is record["steps"][4]["changed"] is True
    assert {e["event"] for e in events} >= {"step.done", "boot.done"}

    code, out, _ = run(capsys, "--root", str(node.root), "plan")
    assert (code, out.strip()) == (0, "nothing to change: the node is already configured")
    code, _, _ = run(capsys, "--root", str(node.root), "boot")
    record = json.loads((node.root / "run/gpunode/state.json").read_text())
    assert [s["changed"] for s in record["steps"]] == [False] * 5


def test_boot_on_a_cpu_node_is_a_no_op(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("azure-d4s-v5", "bare")
    code, _, _ = run(capsys, "--root", str(host.root), "boot")
    record = json.loads((host.root / "run/gpunode/state.json").read_text())
    assert (code, record["outcome"], [s["name"] for s in record["steps"]]) == (0, "no-gpu",
                                                                               ["detect"])
    assert not (host.root / "etc/containerd").exists()


def test_failed_containerd_step_fails_boot_and_status_says_why(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "driver")  # no nvidia-container-runtime installed
    code, _, events = run(capsys, "--root", str(host.root), "boot")
    assert code == 1
    failed = [e for e in events if e["event"] == "step.failed"]
    assert [e["step"] for e in failed] == ["containerd"]
    code, out, _ = run(capsys, "--root", str(host.root), "status", "--json")
    last_boot = next(c for c in json.loads(out)["checks"] if c["name"] == "last_boot")
    assert last_boot["state"] == "warn"
    assert "containerd: runtime binary" in last_boot["detail"]
    assert last_boot["hint"].startswith("install the NVIDIA Container Toolkit")


def test_configure_dry_run_prints_a_diff_and_writes_nothing(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "--root", str(node.root), "containerd", "configure", "--dry-run")
    assert code == 0
    assert out.startswith("--- /usr/share/containerd/config.toml")
    assert not (node.root / "etc/containerd/config.toml").exists()


def test_configure_explicit_file_with_flags_then_revert(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    target = node.root / "srv/containerd.toml"
    target.parent.mkdir()
    target.write_text('version = 2\n')
    code, out, _ = run(capsys, "--root", str(node.root), "containerd", "configure", "--config",
                       "/srv/containerd.toml", "--runtime-name", "nvidia-gpu",
                       "--set-as-default", "--enable-cdi")
    assert code == 0
    assert "add runtime 'nvidia-gpu'" in out
    text = target.read_text()
    assert 'default_runtime_name = "nvidia-gpu"' in text
    assert "enable_cdi = true" in text
    code, out, _ = run(capsys, "--root", str(node.root), "containerd", "revert")
    assert code == 0
    assert target.read_text() == "version = 2\n"


def test_configure_refusal_exits_1_with_the_reason(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    (node.root / "etc/containerd").mkdir(parents=True)
    (node.root / "etc/containerd/config.toml").write_text("version = 9\n")
    code, _, events = run(capsys, "--root", str(node.root), "containerd", "configure",
                          "--config", "/etc/containerd/config.toml")
    assert code == 1
    (failed,) = [e for e in events if e["event"] == "step.failed"]
    assert failed["error"] == (f"{node.root}/etc/containerd/config.toml: 'version' is 9; gpunode "
                               "understands 1 (or no version), 2 and 3")


def test_driver_status_says_what_it_would_do_and_exits_by_the_checks(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = make_host("nc4as-t4-v3", "bare", extra={
        "/usr/lib/extension-release.d/extension-release.flatcar-nvidia-drivers-570": "ID=x\n"})
    code, out, _ = run(capsys, "--root", str(bare.root), "driver", "status", "--json")
    doc = json.loads(out)
    assert code == 1
    assert doc["plan"][0].startswith("flatcar-sysext: the Flatcar driver sysext "
                                     "flatcar-nvidia-drivers-570 is merged")
    assert doc["plan"][1:] == ["run modprobe nvidia", "run modprobe nvidia_uvm",
                               "run modprobe nvidia_modeset"]
    assert {c["name"]: c["state"] for c in doc["checks"]}["driver"] == "fail"


def test_driver_load_under_a_root_refuses_to_load_into_this_machines_kernel(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = make_host("nc4as-t4-v3", "bare", extra={
        "/usr/lib/extension-release.d/extension-release.flatcar-nvidia-drivers-570": "ID=x\n"})
    code, _, events = run(capsys, "--root", str(bare.root), "driver", "load")
    assert code == 1
    (failed,) = [e for e in events if e["event"] == "step.failed"]
    assert "modules are not loaded under --root" in failed["error"]


def test_status_shows_how_the_last_boot_loaded_the_driver(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra={"/run/gpunode/state.json": json.dumps({
        "schema_version": 1, "outcome": "ok", "finished_at": "2026-11-29T08:00:02Z",
        "steps": [{"name": "driver", "outcome": "ok", "duration_ms": 812.4,
                   "strategy": "flatcar-sysext", "source": "flatcar-nvidia-drivers-570",
                   "modules_loaded": ["nvidia", "nvidia_uvm", "nvidia_modeset"]}]})})
    _, out, _ = run(capsys, "--root", str(host.root), "status", "--json")
    driver = next(c for c in json.loads(out)["checks"] if c["name"] == "driver")
    assert driver["detail"] == (
        "NVIDIA 550.127.08 (proprietary kernel modules); last boot: flatcar-sysext from "
        "flatcar-nvidia-drivers-570, loaded nvidia, nvidia_uvm, nvidia_modeset in 812 ms")


def test_boot_refuses_to_run_alongside_flatcars_nvidia_service(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpunode.config import AgentConfig
    from gpunode.pipeline import boot
    from gpunode.platform.systemd import NoSystemd

    class FlatcarNvidiaEnabled(NoSystemd):
        def enabled(self, unit: str) -> bool:
            return unit == "nvidia.service"

    host = make_host("nc4as-t4-v3", "ready")
    adapters = boot.Adapters(systemd=FlatcarNvidiaEnabled(), kmod=None)  # type: ignore[arg-type]
    run = boot.boot(host, AgentConfig(), adapters)
    assert run.outcome == "failed"
    detected, step = run.steps  # detect first: only a node with a GPU can have the race
    assert (detected["name"], step["name"]) == ("detect", "preflight")
    assert "Flatcar's nvidia.service is inactive and enabled" in step["error"]
    assert step["hint"].startswith("mask it: 'systemctl mask nvidia.service'")


def test_a_cpu_node_boots_no_gpu_whatever_flatcars_nvidia_service_is(
    make_host: HostFactory,
) -> None:
    from gpunode.config import AgentConfig
    from gpunode.pipeline import boot
    from gpunode.platform.systemd import NoSystemd

    class FlatcarNvidiaEnabled(NoSystemd):
        def enabled(self, unit: str) -> bool:
            return unit == "nvidia.service"

    adapters = boot.Adapters(systemd=FlatcarNvidiaEnabled(), kmod=None)  # type: ignore[arg-type]
    run = boot.boot(make_host("azure-d4s-v5", "bare"), AgentConfig(), adapters)
    assert (run.outcome, [s["name"] for s in run.steps]) == ("no-gpu", ["detect"])
