"""`gpunode watch --once` on fixture nodes: fatal Xids make GPUReady False, non-fatal ones a
rate-limited Event, the device plugin's application errors nothing; a GPU lost against the
boot's count is GPUMissing, and GPUReady comes back when it returns; the state file keeps a
rerun from reporting twice (gpunode/watch/once.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.platform.host import Host
from gpunode.watch import once, state
from gpunode_testing.driver_files import gpu_uuid
from helpers.watch_api import FakeApi
from hostile.support import Cli

ND96 = "nd96amsr-a100-v4"
GPU0, GPU1 = "0001:00:00.0", "0002:00:00.0"  # the ND96 fixture's first GPUs
XID0, XID1 = "PCI:0001:00:00", "PCI:0002:00:00"  # how the driver names them in an Xid
SECOND = 1_000_000  # /dev/kmsg timestamps are microseconds


def kmsg(host: Host, *lines: tuple[int, str]) -> None:
    """/dev/kmsg as records (usec, message), numbered from 1."""
    text = "".join(f"4,{n},{usec},-;{message}\n" for n, (usec, message) in
                   enumerate(lines, start=1))
    (host.root / "dev/kmsg").write_text(text)


def changes(cli: Cli, host: Host, *extra: str) -> list[dict[str, Any]]:
    result = cli("--root", str(host.root), *extra, "watch", "--once", "--dry-run")
    assert result.code == 0, result.err
    return [json.loads(line) for line in result.out.splitlines()]


@pytest.fixture
def nd96(make_host: HostFactory) -> Host:
    return make_host(ND96, "ready")


def test_xid_79_is_gpu_ready_false_fell_off_the_bus_naming_address_and_uuid(
        cli: Cli, nd96: Host) -> None:
    kmsg(nd96, (5 * SECOND, f"NVRM: Xid ({XID0}): 79, pid=1122, GPU has fallen off the bus."))
    uuid = gpu_uuid(ND96, GPU0)
    assert changes(cli, nd96) == [{
        "kind": "condition", "type": "GPUReady", "status": "False", "reason": "GPUFellOffBus",
        "message": f"gpunode watch: Xid 79 on GPU {GPU0} ({uuid}): GPU has fallen off the bus.",
        "gpu": {"address": GPU0, "uuid": uuid}}]


def test_another_fatal_xid_is_gpu_xid_fatal_and_several_gpus_are_all_named(
        cli: Cli, nd96: Host) -> None:
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 48, pid='<unknown>', name=<unknown>, An "
                "uncorrectable double bit error (DBE) has been detected on GPU"),
         (2 * SECOND, f"NVRM: Xid ({XID1}): 119, pid=77, name=nvidia-smi, Timeout after 6s"))
    [condition] = changes(cli, nd96)
    assert (condition["status"], condition["reason"]) == ("False", "GPUXidFatal")
    assert f"Xid 48 on GPU {GPU0}" in condition["message"]
    assert f"Xid 119 on GPU {GPU1}" in condition["message"]
    assert condition["gpu"]["address"] == GPU0


def test_an_application_error_the_device_plugin_ignores_reports_nothing(
        cli: Cli, nd96: Host) -> None:
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 31, pid=79749, name=exe, Ch 0000000a, MMU Fault"),
         (2 * SECOND, f"NVRM: Xid ({XID0}): 13, pid=5, name=python, Graphics Exception"))
    assert changes(cli, nd96) == []


def test_a_non_fatal_xid_is_one_warning_event_per_gpu_and_code_in_ten_minutes(
        cli: Cli, nd96: Host) -> None:
    contained = f"NVRM: Xid ({XID0}): 94, pid='<unknown>', name=<unknown>, Contained ECC error."
    kmsg(nd96, (SECOND, contained), (2 * SECOND, contained), (3 * SECOND, contained),
         (3 * SECOND, f"NVRM: Xid ({XID1}): 94, pid=9, name=a.out, Contained ECC error."),
         (700 * SECOND, contained))
    events = changes(cli, nd96)
    assert [(e["kind"], e["type"], e["reason"], e["gpu"]["address"], e["xid"]) for e in events] \
        == [("event", "Warning", "GPUXid", GPU0, 94), ("event", "Warning", "GPUXid", GPU1, 94),
            ("event", "Warning", "GPUXid", GPU0, 94)]
    assert events[1]["message"] == (f"gpunode watch: Xid 94 on GPU {GPU1} "
                                    f"({gpu_uuid(ND96, GPU1)}), pid 9 (a.out): Contained ECC "
                                    "error.")
    assert events[2]["message"].endswith("(2 more since the last Event)")


def test_the_fatal_set_is_the_agent_config_s(cli: Cli, nd96: Host, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[watch]\nfatal_xids = [94]\nignored_xids = []\n")
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 94, Contained ECC error."),
         (SECOND, f"NVRM: Xid ({XID0}): 31, MMU Fault"))
    assert [(c["kind"], c.get("reason")) for c in changes(cli, nd96, "--config", str(config))] \
        == [("condition", "GPUXidFatal"), ("event", "GPUXid")]


def test_garbage_around_an_xid_is_skipped(cli: Cli, nd96: Host) -> None:
    (nd96.root / "dev/kmsg").write_bytes(
        b"\x00\xff garbage\n SUBSYSTEM=pci\n6,1,1,-;Linux version\n"
        b"4,2,100,-;NVRM: Xid (PCI:0001:00:00): 79, GPU has fallen off the bus.\n"
        b"4,x,100,-;NVRM: Xid (PCI:0002:00:00): 79, GPU has fallen off the bus.\n")
    assert [c["gpu"]["address"] for c in changes(cli, nd96)] == [GPU0]


def test_dry_run_writes_no_state(cli: Cli, nd96: Host) -> None:
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 79, GPU has fallen off the bus."))
    changes(cli, nd96)
    assert not (nd96.root / "run/gpunode/watch.json").exists()


def test_dry_run_without_once_is_refused_with_exit_2(cli: Cli, nd96: Host) -> None:
    result = cli("--root", str(nd96.root), "watch", "--dry-run")
    assert result.code == 2 and "--once" in result.err


CONFIG = AgentConfig(kubernetes=KubernetesConfig(node_name="nd96-0"))


def test_a_rerun_reports_nothing_twice_and_a_new_line_once(nd96: Host) -> None:
    api = FakeApi()
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 94, Contained ECC error."),
         (2 * SECOND, f"NVRM: Xid ({XID0}): 79, GPU has fallen off the bus."))
    once.run(nd96, CONFIG, False, lambda: api)
    assert api.calls == ["GET nd96-0", "PATCH nd96-0/status", "POST default/events"]
    assert api.events[0]["involvedObject"] == {"apiVersion": "v1", "kind": "Node",
                                               "name": "nd96-0", "uid": "nd96-0"}
    once.run(nd96, CONFIG, False, lambda: api)
    assert len(api.calls) == 3  # nothing new: not even a GET
    with (nd96.root / "dev/kmsg").open("a") as f:
        f.write(f"4,3,{900 * SECOND},-;NVRM: Xid ({XID1}): 94, Contained ECC error.\n")
    once.run(nd96, CONFIG, False, lambda: api)
    assert api.calls[3:] == ["POST default/events"]
    saved = json.loads((nd96.root / "run/gpunode/watch.json").read_text())
    assert (saved["last_seq"], [f["code"] for f in saved["fatal"]]) == (3, [79])


def test_a_new_boot_reports_what_its_kernel_logged(nd96: Host) -> None:
    api = FakeApi()
    boot_id = nd96.root / "proc/sys/kernel/random/boot_id"
    boot_id.parent.mkdir(parents=True, exist_ok=True)
    boot_id.write_text("1b9c0e4e-0000-4000-8000-000000000001\n")
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 94, Contained ECC error."))
    once.run(nd96, CONFIG, False, lambda: api)
    boot_id.write_text("1b9c0e4e-0000-4000-8000-000000000002\n")
    once.run(nd96, CONFIG, False, lambda: api)
    assert api.calls == ["POST default/events", "POST default/events"]


def test_a_lost_gpu_is_gpu_missing_and_its_return_gpu_ready_again(nd96: Host) -> None:
    api = FakeApi()
    kmsg(nd96)
    record = nd96.root / "run/gpunode/state.json"
    doc = json.loads(record.read_text())
    doc["steps"][0]["gpus"] = 8
    record.write_text(json.dumps(doc))
    once.run(nd96, CONFIG, False, lambda: api)
    assert api.calls == []  # all 8 there: GPUReady is gpunode label's
    link = nd96.root / "sys/bus/pci/devices" / GPU1
    target = os.readlink(link)
    link.unlink()
    once.run(nd96, CONFIG, False, lambda: api)
    [missing] = api.conditions
    assert (missing["status"], missing["reason"]) == ("False", "GPUMissing")
    assert missing["message"] == (f"gpunode watch: 7 of the 8 GPUs this boot detected are "
                                  f"present (missing: {GPU1})")
    link.symlink_to(target)
    once.run(nd96, CONFIG, False, lambda: api)
    [back] = api.conditions
    assert (back["status"], back["reason"]) == ("True", "GPUReady")
    assert api.calls.count("PATCH nd96-0/status") == 2
    saved, problem = state.read(nd96)
    assert problem is None and saved is not None and saved.missing == []


def test_status_shows_the_watch_s_fatal_finding_and_is_not_ready(cli: Cli, nd96: Host) -> None:
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 79, GPU has fallen off the bus."))
    once.run(nd96, CONFIG, False, FakeApi)
    result = cli("--root", str(nd96.root), "status", "--json")
    checks = {c["name"]: c for c in json.loads(result.out)["checks"]}
    assert result.code == 1
    assert checks["watch"]["state"] == "fail"
    assert checks["watch"]["detail"] == (f"fatal Xid this boot: Xid 79 on GPU {GPU0} "
                                         f"({gpu_uuid(ND96, GPU0)}): GPU has fallen off the bus.")


def test_status_says_ok_after_a_clean_watch_run(cli: Cli, nd96: Host) -> None:
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 31, MMU Fault"))
    once.run(nd96, CONFIG, False, FakeApi)
    result = cli("--root", str(nd96.root), "status", "--json")
    checks = {c["name"]: c for c in json.loads(result.out)["checks"]}
    assert checks["watch"]["state"] == "ok"
    assert checks["watch"]["detail"].startswith("no fatal Xid and no GPU lost this boot "
                                                "(kernel log read to record 1, at ")


def test_when_the_gpu_returns_but_the_driver_failed_gpu_ready_says_what_label_would(
        nd96: Host) -> None:
    api = FakeApi()
    kmsg(nd96)
    link = nd96.root / "sys/bus/pci/devices" / GPU1
    once.run(nd96, CONFIG, False, lambda: api)  # the watch sees all 8 first
    target = os.readlink(link)
    link.unlink()
    once.run(nd96, CONFIG, False, lambda: api)
    link.symlink_to(target)
    (nd96.root / "proc/driver/nvidia/version").unlink()
    once.run(nd96, CONFIG, False, lambda: api)
    [now] = api.conditions
    assert (now["status"], now["reason"]) == ("False", "DriverNotReady")
    once.run(nd96, CONFIG, False, lambda: api)
    assert api.calls.count("PATCH nd96-0/status") == 2  # and then nothing more


def test_two_passes_at_once_report_a_change_once(nd96: Host) -> None:
    import threading
    import time

    class SlowApi(FakeApi):
        def get_node(self, name: str) -> dict[str, Any]:
            time.sleep(0.2)  # the first pass is still reporting when the second starts
            return super().get_node(name)

    api = SlowApi()
    kmsg(nd96, (SECOND, f"NVRM: Xid ({XID0}): 79, GPU has fallen off the bus."))
    passes = [threading.Thread(target=once.run, args=(nd96, CONFIG, False, lambda: api))
              for _ in range(2)]
    for thread in passes:
        thread.start()
    for thread in passes:
        thread.join(10)
    assert api.calls == ["GET nd96-0", "PATCH nd96-0/status"]


def test_a_gpu_not_initialized_is_gpu_ready_false_until_it_is_up(nd96: Host) -> None:
    """A GPU the driver lists but never brought up (boot's gpu_init failed): GPUReady False
    GPUNotInitialized naming it, never its placeholder as a UUID, and the spec the watch keeps
    gives it to no pod; once it shows its UUID, GPUReady is what `gpunode label` says and the
    spec has it again."""
    from gpunode_testing import fixtures

    api = FakeApi()
    kmsg(nd96, (SECOND, f"NVRM: GPU {GPU1}: RmInitAdapter failed! (0x22:0x56:667)"))
    info = nd96.root / f"proc/driver/nvidia/gpus/{GPU1}/information"
    text = info.read_text()
    info.write_text(text.replace(gpu_uuid(ND96, GPU1), fixtures.UNINITIALIZED_UUID))
    once.run(nd96, CONFIG, False, lambda: api)
    [down] = api.conditions
    assert (down["status"], down["reason"]) == ("False", "GPUNotInitialized")
    assert down["message"].startswith(f"gpunode watch: 1 of the driver's GPUs not initialized: "
                                      f"{GPU1}: ")
    spec = nd96.root / "var/run/cdi/nvidia.yaml"
    assert '"name": "1"' not in spec.read_text() and '"name": "0"' in spec.read_text()
    once.run(nd96, CONFIG, False, lambda: api)
    assert len(api.conditions) == 1  # said once
    info.write_text(text)
    kmsg(nd96, (SECOND, f"NVRM: GPU {GPU1}: RmInitAdapter succeeded!"))
    once.run(nd96, CONFIG, False, lambda: api)
    back = api.conditions[-1]
    assert back["status"] == "True", back
    assert "????" not in json.dumps(api.conditions)
    assert gpu_uuid(ND96, GPU1) in spec.read_text()
