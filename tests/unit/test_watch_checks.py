"""`gpunode watch --once`'s checks beyond the kernel log, on fixture nodes: the Azure VM size's
GPU count (gpunode/watch/vmsize.py), containerd's config kept as gpunode configured it and the
CDI spec kept current (gpunode/watch/checks.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import dataclass, replace
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig, KubernetesConfig, WatchConfig
from gpunode.errors import ApiError
from gpunode.platform.host import Host
from gpunode.platform.systemd import MainProcess
from gpunode.watch import checks, once, state, vmsize
from gpunode_testing import fixtures
from helpers.fake_containerd import RecordingSystemd, listening
from helpers.watch_api import FakeApi
from hostile.support import Cli

T4 = "nc4as-t4-v3"


def quiet_kernel(host: Host) -> Host:
    """An empty /dev/kmsg under the root: a kernel that logged no Xid."""
    (host.root / "dev").mkdir(exist_ok=True)
    kmsg = host.root / "dev/kmsg"
    if not kmsg.exists():
        kmsg.write_text("")
    return host


def changes(cli: Cli, host: Host, *extra: str) -> list[dict[str, Any]]:
    quiet_kernel(host)
    result = cli("--root", str(host.root), *extra, "watch", "--once", "--dry-run")
    assert result.code == 0, result.err
    return [json.loads(line) for line in result.out.splitlines()]


def metadata(size: str, key: str = "COREOS_AZURE_VMSIZE") -> dict[str, str]:
    """Afterburn's attributes file as coreos-metadata.service writes it on Flatcar."""
    return {"/run/metadata/flatcar": f"COREOS_AZURE_IPV4_DYNAMIC=10.0.0.4\n{key}={size}\n"}


# -- the VM size's GPU count ------------------------------------------------------------------


@pytest.mark.parametrize(("size", "gpus"), [
    ("Standard_NC4as_T4_v3", 1), ("Standard_NC64as_T4_v3", 4), ("Standard_NC24s_v3", 4),
    ("Standard_ND96asr_A100_v4", 8), ("Standard_ND96amsr_A100_v4", 8),
    ("Standard_NC48ads_A100_v4", 2), ("Standard_NC80adis_H100_v5", 2),
    ("Standard_ND96isr_H100_v5", 8), ("Standard_NV6ads_A10_v5", 1),
    ("Standard_NV72ads_A10_v5", 2), ("standard_nc96ads_a100_v4", 4)],
    ids=lambda v: str(v))
def test_the_table_gives_each_gpu_size_its_gpu_count_case_insensitively(size: str,
                                                                         gpus: int) -> None:
    assert vmsize.gpus_of(size) == gpus


@pytest.mark.parametrize("size", ["Standard_D4s_v5", "Standard_NC999_future_v9", ""])
def test_a_size_the_table_lacks_has_no_count(size: str) -> None:
    assert vmsize.gpus_of(size) is None


def test_fewer_gpus_than_the_vm_size_has_is_gpu_missing_naming_the_size(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host(T4, "ready", extra=metadata("Standard_NC64as_T4_v3"))
    [condition] = changes(cli, host)
    assert (condition["status"], condition["reason"]) == ("False", "GPUMissing")
    assert condition["message"] == (
        "gpunode watch: 1 of the 4 GPUs of an Azure Standard_NC64as_T4_v3 are present "
        "(/run/metadata/flatcar (COREOS_AZURE_VMSIZE))")


def test_afterburns_own_attribute_file_is_read_where_flatcars_is_absent(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host(T4, "ready", extra={
        "/run/metadata/afterburn": "AFTERBURN_AZURE_VMSIZE=Standard_NC12s_v3\n"})
    [condition] = changes(cli, host)
    assert "1 of the 2 GPUs of an Azure Standard_NC12s_v3" in condition["message"]


def test_as_many_gpus_as_the_vm_size_has_is_no_change(cli: Cli,
                                                      make_host: HostFactory) -> None:
    host = make_host("nd96amsr-a100-v4", "ready",
                     extra=metadata("Standard_ND96amsr_A100_v4"))
    assert changes(cli, host) == []


@pytest.mark.parametrize("size", ["Standard_NC999_future_v9", "Standard_D4s_v5"])
def test_a_size_the_table_lacks_makes_no_claim(cli: Cli, make_host: HostFactory,
                                               size: str) -> None:
    assert changes(cli, make_host(T4, "ready", extra=metadata(size))) == []


def test_off_azure_the_metadata_file_is_not_believed(cli: Cli,
                                                     make_host: HostFactory) -> None:
    host = make_host(T4, "ready", extra={**metadata("Standard_NC64as_T4_v3"),
                                         "/sys/class/dmi/id/sys_vendor": "QEMU\n"})
    assert changes(cli, host) == []


# -- containerd's config as gpunode configured it ----------------------------------------------

# What another tool (a chart's template, a hand) leaves: Flatcar's config, no nvidia runtime.
REWRITTEN = fixtures.FLATCAR_CONTAINERD_CONFIG
CONFIG = AgentConfig(kubernetes=KubernetesConfig(node_name="t4-0"))


def rewritten(make_host: HostFactory, **options: Any) -> Host:
    host = quiet_kernel(make_host(T4, "ready", **options))
    (host.root / "etc/containerd/config.toml").write_text(REWRITTEN)
    return host


def config_text(host: Host) -> str:
    return (host.root / "etc/containerd/config.toml").read_text()


def test_a_config_without_the_runtime_is_a_repair_that_dry_run_only_prints(
        cli: Cli, make_host: HostFactory) -> None:
    host = rewritten(make_host)
    [repair] = changes(cli, host)
    assert (repair["kind"], repair["type"], repair["reason"]) == (
        "repair", "Warning", "ContainerdConfigRepaired")
    assert repair["file"] == "/etc/containerd/config.toml"
    assert "would repair as 'gpunode containerd configure' does" in repair["message"]
    assert "add runtime 'nvidia'" in repair["message"]
    assert repair["restart"] == "unknown"  # under --root no systemd says whether it runs
    assert "no systemd manages this root" in repair["message"]
    assert config_text(host) == REWRITTEN
    assert not (host.root / "run/gpunode/watch.json").exists()


def test_the_repair_writes_what_configure_writes_and_reports_one_event(
        make_host: HostFactory) -> None:
    host = rewritten(make_host)
    api = FakeApi()
    once.run(host, CONFIG, False, lambda: api)
    text = config_text(host)
    assert 'runtimes.nvidia]' in text and 'BinaryName = "/usr/bin/nvidia-container-runtime"' in text
    assert (host.root / "etc/containerd/config.toml.gpunode-orig").read_text() == REWRITTEN
    assert (host.root / "var/lib/gpunode/containerd.json").exists()  # configure's ledger
    [event] = api.events
    assert (event["type"], event["reason"]) == ("Warning", "ContainerdConfigRepaired")
    saved = state.read(host)[0]
    assert saved is not None and saved.findings["containerd"]["status"] == "repaired"
    api.events.clear()
    once.run(host, CONFIG, False, lambda: api)
    assert api.events == [] and config_text(host) == text


class AwayApi(FakeApi):
    """An API server that cannot be reached."""

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        raise ApiError("create event", None, "connection refused")


def test_a_repair_whose_event_could_not_be_sent_is_reported_by_the_next_pass(
        make_host: HostFactory) -> None:
    host = rewritten(make_host)
    with pytest.raises(ApiError):
        once.run(host, CONFIG, False, AwayApi)
    repaired = config_text(host)
    assert "runtimes.nvidia]" in repaired
    api = FakeApi()
    once.run(host, CONFIG, False, lambda: api)
    assert [e["reason"] for e in api.events] == ["ContainerdConfigRepaired"]
    assert config_text(host) == repaired
    api.events.clear()
    once.run(host, CONFIG, False, lambda: api)
    assert api.events == []


def test_a_config_as_configured_is_left_alone(cli: Cli, make_host: HostFactory) -> None:
    host = make_host(T4, "ready")
    before = config_text(host)
    assert changes(cli, host) == []
    assert config_text(host) == before


def test_a_containerd_gpunode_never_configured_is_not_gpunodes_to_repair(
        cli: Cli, make_host: HostFactory) -> None:
    host = rewritten(make_host)
    (host.root / "run/gpunode/state.json").unlink()  # no boot record, no ledger
    assert changes(cli, host) == []


def test_a_config_reverted_after_boot_changed_it_stays_reverted(
        cli: Cli, make_host: HostFactory) -> None:
    host = rewritten(make_host)
    record = json.loads((host.root / "run/gpunode/state.json").read_text())
    record["steps"][-1].update(changed=True)  # boot wrote it (and its ledger): revert ran since
    (host.root / "run/gpunode/state.json").write_text(json.dumps(record))
    assert changes(cli, host) == []


def shim(host: Host, pid: int = 4242) -> None:
    """A container's shim process in the fixture's /proc, as the kernel names it."""
    (host.root / f"proc/{pid}").mkdir(parents=True)
    (host.root / f"proc/{pid}/comm").write_text("containerd-shim\n")


def repair_with(host: Host, policy: str) -> tuple[dict[str, Any], RecordingSystemd]:
    manager = RecordingSystemd(host=host)
    found: list[dict[str, Any]] = []
    config = AgentConfig(watch=WatchConfig(containerd_restart=policy))
    with listening(host):
        checks.run(host, config, found, {}, dry_run=False, manager=manager)
    [repair] = found
    return repair, manager


def test_when_idle_a_running_containerd_without_containers_is_restarted(
        make_host: HostFactory) -> None:
    repair, manager = repair_with(rewritten(make_host), "when-idle")
    assert repair["restart"] == "restarted"
    assert "restart containerd.service" in manager.calls
    assert repair["message"].endswith("; containerd was restarted")


def test_when_idle_running_containers_leave_the_restart_pending(
        make_host: HostFactory) -> None:
    host = rewritten(make_host)
    shim(host)
    repair, manager = repair_with(host, "when-idle")
    assert repair["restart"] == "pending"
    assert "restart containerd.service" not in manager.calls
    assert ('restart pending (1 container running; watch.containerd_restart = "when-idle")'
            in repair["message"])
    assert "runtimes.nvidia]" in config_text(host)  # repaired all the same


def test_never_leaves_the_restart_pending_even_without_containers(
        make_host: HostFactory) -> None:
    repair, manager = repair_with(rewritten(make_host), "never")
    assert repair["restart"] == "pending" and "restart containerd.service" not in manager.calls


def test_always_restarts_under_running_containers(make_host: HostFactory) -> None:
    host = rewritten(make_host)
    shim(host)
    repair, manager = repair_with(host, "always")
    assert repair["restart"] == "restarted" and "restart containerd.service" in manager.calls


@dataclass
class StartedSystemd(RecordingSystemd):
    """A recording systemd that also says when containerd's main process started."""

    started: float = 0.0

    def main_process(self, unit: str) -> MainProcess:
        return MainProcess(pid=4000, started=self.started)


def pending_repair(make_host: HostFactory) -> tuple[Host, dict[str, dict[str, str]]]:
    """A node whose repair left containerd's restart pending (a container ran then)."""
    host = rewritten(make_host)
    shim(host)
    findings: dict[str, dict[str, str]] = {}
    checks.run(host, AgentConfig(), [], findings, dry_run=False,
               manager=RecordingSystemd(host=host))
    assert findings["containerd"]["restart"] == "pending"
    return host, findings


def test_a_pending_restart_is_made_once_no_container_runs(make_host: HostFactory) -> None:
    host, findings = pending_repair(make_host)
    (host.root / "proc/4242/comm").unlink()  # the last container is gone
    manager = StartedSystemd(host=host, started=fixtures.BOOT_TIME + 10)
    found: list[dict[str, Any]] = []
    with listening(host):
        checks.run(host, AgentConfig(), found, findings, dry_run=False, manager=manager)
    assert manager.calls == ["restart containerd.service"]
    [event] = found
    assert (event["type"], event["reason"]) == ("Normal", "ContainerdRestarted")
    assert findings["containerd"]["restart"] == "restarted"


def test_a_pending_restart_waits_while_containers_run(make_host: HostFactory) -> None:
    host, findings = pending_repair(make_host)
    manager = StartedSystemd(host=host, started=fixtures.BOOT_TIME + 10)
    found: list[dict[str, Any]] = []
    checks.run(host, AgentConfig(), found, findings, dry_run=False, manager=manager)
    assert found == [] and manager.calls == []
    assert findings["containerd"]["restart"] == "pending"


def test_a_containerd_restarted_by_someone_since_is_no_longer_pending(
        make_host: HostFactory) -> None:
    host, findings = pending_repair(make_host)
    manager = StartedSystemd(host=host, started=time.time() + 60)
    found: list[dict[str, Any]] = []
    checks.run(host, AgentConfig(), found, findings, dry_run=False, manager=manager)
    assert found == [] and manager.calls == []
    assert findings["containerd"]["restart"] == "restarted"


def test_a_stopped_containerd_needs_no_restart(make_host: HostFactory) -> None:
    host = rewritten(make_host)
    manager = RecordingSystemd(state="inactive", host=host)
    found: list[dict[str, Any]] = []
    checks.run(host, AgentConfig(), found, {}, dry_run=False, manager=manager)
    assert found[0]["restart"] == "not-needed" and manager.calls == []


def test_a_restart_policy_the_config_does_not_know_is_refused_with_exit_2(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host(T4, "ready")
    config = host.root / "etc/gpunode/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[watch]\ncontainerd_restart = "sometimes"\n')
    result = cli("--root", str(host.root), "watch", "--once", "--dry-run")
    assert result.code == 2 and "watch.containerd_restart" in result.err


def test_status_shows_the_last_repair_and_its_pending_restart(
        cli: Cli, make_host: HostFactory) -> None:
    host = rewritten(make_host)
    shim(host)
    repair, _ = repair_with(host, "when-idle")
    state.write(host, state.WatchState(boot_id="", findings={"containerd": {
        "status": "repaired", "message": repair["message"], "at": "2026-12-01T10:00:00Z",
        "restart": "pending"}}))
    result = cli("--root", str(host.root), "status", "--json")
    [check] = [c for c in json.loads(result.out)["checks"] if c["name"] == "watch"]
    assert check["state"] == "warn"
    assert "repaired as 'gpunode containerd configure' does" in check["detail"]
    assert "restart pending" in check["detail"] and "2026-12-01T10:00:00Z" in check["detail"]


# -- the CDI spec, current with the driver and its GPUs ------------------------------------------

SPEC = "var/run/cdi/nvidia.yaml"
ND96 = "nd96amsr-a100-v4"


def test_a_spec_of_an_older_driver_is_regenerated_naming_both_versions(
        cli: Cli, make_host: HostFactory) -> None:
    old = make_host(T4, "ready")
    newer = make_host(replace(fixtures.MACHINES[T4], driver_version="550.144.06"), "ready")
    (newer.root / SPEC).write_bytes((old.root / SPEC).read_bytes())
    [change] = changes(cli, newer)
    assert (change["kind"], change["reason"]) == ("cdi", "CDISpecRegenerated")
    assert change["message"] == ("gpunode watch: would regenerate /var/run/cdi/nvidia.yaml "
                                 "(driver 550.127.08 → 550.144.06)")
    assert (newer.root / SPEC).read_bytes() == (old.root / SPEC).read_bytes()  # dry run
    once.run(newer, CONFIG, False, FakeApi)
    assert b"libcuda.so.550.144.06" in (newer.root / SPEC).read_bytes()
    assert b"libcuda.so.550.127.08" not in (newer.root / SPEC).read_bytes()


def test_a_gpu_the_driver_no_longer_has_is_taken_out_of_the_spec(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host(ND96, "ready")
    gone = host.root / "proc/driver/nvidia/gpus/0008:00:00.0"
    uuid = next(line.split()[-1] for line in (gone / "information").read_text().splitlines()
                if line.startswith("GPU UUID"))
    shutil.rmtree(gone)
    [change] = changes(cli, host)
    assert change["kind"] == "cdi"
    assert f"devices gone: 7, {uuid}" in change["message"]


def test_a_persistenced_socket_that_came_up_after_boot_is_mounted_by_the_next_pass(
        cli: Cli, make_host: HostFactory) -> None:
    """The same devices of the same driver, but the spec lacks a mount the node has now."""
    host = make_host(T4, "ready")
    socket_path = host.root / "run/nvidia-persistenced/socket"
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(socket_path, stat.S_IFSOCK | 0o600)
    [change] = changes(cli, host)
    assert change["kind"] == "cdi" and "its mounts or hooks differ" in change["message"]
    once.run(quiet_kernel(host), CONFIG, False, FakeApi)
    assert b"/run/nvidia-persistenced/socket" in (host.root / SPEC).read_bytes()


def test_a_current_spec_is_left_alone(cli: Cli, make_host: HostFactory) -> None:
    host = make_host(ND96, "ready")
    before = (host.root / SPEC).read_bytes()
    once.run(quiet_kernel(host), CONFIG, False, FakeApi)
    assert (host.root / SPEC).read_bytes() == before


def test_a_spec_that_is_not_gpunodes_is_not_touched(cli: Cli, make_host: HostFactory) -> None:
    old = make_host(T4, "ready")
    newer = make_host(replace(fixtures.MACHINES[T4], driver_version="550.144.06"), "ready")
    theirs = (old.root / SPEC).read_bytes().split(b"\n", 1)[1]  # nvidia-ctk's, say: no header
    (newer.root / SPEC).write_bytes(theirs)
    assert changes(cli, newer) == []


def test_a_driver_gone_is_one_event_per_boot_and_the_spec_stays(
        make_host: HostFactory) -> None:
    host = quiet_kernel(make_host(T4, "ready"))
    before = (host.root / SPEC).read_bytes()
    (host.root / "proc/driver/nvidia/version").unlink()
    api = FakeApi()
    once.run(host, CONFIG, False, lambda: api)
    [event] = [e for e in api.events if e["reason"] == "CDISpecUnchecked"]
    assert "cannot regenerate the CDI spec" in event["message"]
    api.events.clear()
    once.run(host, CONFIG, False, lambda: api)
    assert [e for e in api.events if e["reason"] == "CDISpecUnchecked"] == []
    assert (host.root / SPEC).read_bytes() == before
