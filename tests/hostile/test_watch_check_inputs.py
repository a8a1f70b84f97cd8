"""Hostile inputs to the watch's checks beyond the kernel log (gpunode/watch/vmsize.py,
checks.py): DMI and Afterburn metadata files that are garbage, FIFOs, directories, huge or
loops make no VM-size claim; a containerd config that is a FIFO, a link out of the root, huge,
not TOML or not UTF-8 is reported once as a Warning Event and never repaired, waited on or
half-written; a damaged `findings` in the watch's state is started afresh. Every file is left
as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.platform.host import Host
from gpunode.watch import once
from helpers.watch_api import FakeApi
from hostile.support import Cli, assert_unchanged, snapshot

T4 = "nc4as-t4-v3"
BIGGER = "COREOS_AZURE_VMSIZE=Standard_NC64as_T4_v3\n"  # 4 GPUs: believed, a GPUMissing
WATCH_OWN = ("run", "run/gpunode", "run/gpunode/lock", "run/gpunode/watch.json",
             "run/gpunode/watch.lock", "var/lib/node_exporter",  # and its metrics file
             "var/lib/node_exporter/textfile_collector",
             "var/lib/node_exporter/textfile_collector/gpunode.prom")


@pytest.fixture
def host(make_host: HostFactory) -> Host:
    host = make_host(T4, "ready")
    (host.root / "dev/kmsg").write_text("")
    return host


def dry_run(cli: Cli, host: Host) -> list[dict[str, Any]]:
    before = snapshot(host.root)
    result = cli("--root", str(host.root), "watch", "--once", "--dry-run")
    assert result.code == 0, result.err
    assert "Traceback" not in result.err
    assert all(json.loads(line) for line in result.err.splitlines())
    assert_unchanged(host.root, before)
    return [json.loads(line) for line in result.out.splitlines()]


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _huge(path: Path) -> None:
    with path.open("wb") as f:
        f.write(BIGGER.encode())
        f.truncate(20 << 20)


def _loop(path: Path) -> None:
    path.symlink_to(path.name)


def _not_a_size(path: Path) -> None:
    path.write_text("COREOS_AZURE_VMSIZE=$(reboot); Standard_NC64as_T4_v3\n")


def _out_of_root(path: Path) -> None:
    path.symlink_to("../" * 30 + "etc/passwd")


METADATA = {"fifo": _fifo, "directory": _directory, "binary-garbage": _garbage,
            "twenty-mib": _huge, "symlink-loop": _loop, "not-a-size-name": _not_a_size,
            "symlink-out-of-the-root": _out_of_root}


@pytest.mark.parametrize("make", METADATA.values(), ids=list(METADATA))
def test_a_metadata_file_that_is_not_afterburns_claims_no_gpu_count(
        cli: Cli, host: Host, make: Any) -> None:
    path = host.root / "run/metadata/flatcar"
    path.parent.mkdir(parents=True, exist_ok=True)
    make(path)
    assert dry_run(cli, host) == []


@pytest.mark.parametrize("make", [_fifo, _directory, _garbage, _huge, _loop],
                         ids=["fifo", "directory", "binary-garbage", "twenty-mib",
                              "symlink-loop"])
def test_a_dmi_vendor_that_is_not_text_claims_no_gpu_count(cli: Cli, host: Host,
                                                           make: Any) -> None:
    (host.root / "run/metadata").mkdir(parents=True)
    (host.root / "run/metadata/flatcar").write_text(BIGGER)
    vendor = host.root / "sys/class/dmi/id/sys_vendor"
    vendor.unlink()
    make(vendor)
    assert dry_run(cli, host) == []


def _toml_garbage(path: Path) -> None:
    path.write_text("version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"\nnot toml = = 1\n")


def _not_utf8(path: Path) -> None:
    path.write_bytes(b"version = 2\n# \xff\xfe\n")


def _config_huge(path: Path) -> None:
    with path.open("wb") as f:
        f.write(b"version = 2\n")
        f.truncate(20 << 20)


CONFIGS = {
    "fifo": (_fifo, "FIFO"),
    "symlink-out-of-the-root": (_out_of_root, "config.toml"),
    "symlink-loop": (_loop, "symbolic links"),
    "twenty-mib": (_config_huge, "config.toml"),
    "not-toml": (_toml_garbage, "config.toml"),
    "not-utf-8": (_not_utf8, "config.toml"),
    "directory": (_directory, "directory"),
}


def _replace_config(host: Host, make: Any) -> None:
    path = host.root / "etc/containerd/config.toml"
    path.unlink()
    make(path)


@pytest.mark.parametrize(("make", "word"), CONFIGS.values(), ids=list(CONFIGS))
def test_a_config_that_cannot_be_read_is_reported_not_repaired(
        cli: Cli, host: Host, make: Any, word: str) -> None:
    _replace_config(host, make)
    [event] = dry_run(cli, host)
    assert (event["kind"], event["type"], event["reason"]) == (
        "event", "Warning", "ContainerdConfigUnchecked")
    assert word in event["message"]


@pytest.mark.parametrize(("make", "word"), CONFIGS.values(), ids=list(CONFIGS))
def test_a_real_pass_leaves_such_a_config_as_it_was_and_reports_it_once(
        host: Host, make: Any, word: str) -> None:
    _replace_config(host, make)
    before = snapshot(host.root, WATCH_OWN)
    api = FakeApi()
    config = AgentConfig(kubernetes=KubernetesConfig(node_name="t4-0"))
    once.run(host, config, False, lambda: api)
    once.run(host, config, False, lambda: api)
    assert [e["reason"] for e in api.events] == ["ContainerdConfigUnchecked"]
    assert_unchanged(host.root, before, WATCH_OWN)


DAMAGED_FINDINGS = {
    "not-a-map": (b'"repaired"', "findings is not a map"),
    "a-finding-not-an-object": (b'{"containerd": 1}', "findings is not a map"),
    "a-value-not-a-string": (b'{"containerd": {"status": 1}}', "findings is not a map"),
    "an-unreported-event-not-json": (b'{"containerd": {"status": "repaired", "event": "{"}}',
                                     "unreported event is not an Event"),
    "an-unreported-event-not-an-event": (b'{"cdi": {"status": "regenerated", "event": "[1]"}}',
                                         "unreported event is not an Event"),
}


@pytest.mark.parametrize(("data", "said"), DAMAGED_FINDINGS.values(),
                         ids=list(DAMAGED_FINDINGS))
def test_damaged_findings_in_the_state_are_warned_about_once(cli: Cli, host: Host,
                                                             data: bytes, said: str) -> None:
    (host.root / "run/gpunode/watch.json").write_bytes(
        b'{"schema_version": 1, "boot_id": "", "last_seq": -1, "findings": ' + data + b"}")
    result = cli("--root", str(host.root), "watch", "--once", "--dry-run")
    assert result.code == 0, result.err
    warnings = [e for e in map(json.loads, result.err.splitlines())
                if e["event"] == "watch.state_unusable"]
    assert len(warnings) == 1 and said in str(warnings[0]["error"])


HEADER = b"# Written by gpunode (gpunode cdi generate); gpunode boot keeps it current.\n"


def _spec_huge(path: Path) -> None:
    with path.open("wb") as f:
        f.write(HEADER)
        f.truncate(5 << 20)


SPECS = {"fifo": _fifo, "directory": _directory, "five-mib": _spec_huge,
         "symlink-loop": _loop, "symlink-out-of-the-root": _out_of_root}


def _replace_spec(host: Host, make: Any) -> None:
    path = host.root / "var/run/cdi/nvidia.yaml"
    path.unlink()
    make(path)


@pytest.mark.parametrize("make", SPECS.values(), ids=list(SPECS))
def test_a_cdi_spec_that_cannot_be_read_is_one_event_and_left_alone(
        cli: Cli, host: Host, make: Any) -> None:
    _replace_spec(host, make)
    [event] = dry_run(cli, host)
    assert (event["type"], event["reason"]) == ("Warning", "CDISpecUnchecked")
    assert "cannot read the CDI spec" in event["message"]


@pytest.mark.parametrize("body", [b"devices: [1, 2\n", b"- just\n- a list\n",
                                  b"a: &a [*a, *a]\n" * 1000, os.urandom(2048)],
                         ids=["not-yaml", "not-a-mapping", "aliases", "binary"])
def test_gpunodes_own_spec_with_a_damaged_body_is_regenerated(cli: Cli, host: Host,
                                                              body: bytes) -> None:
    (host.root / "var/run/cdi/nvidia.yaml").write_bytes(HEADER + body)
    [change] = dry_run(cli, host)
    assert (change["kind"], change["reason"]) == ("cdi", "CDISpecRegenerated")
