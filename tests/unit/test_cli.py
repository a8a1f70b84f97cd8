"""The command line as a user meets it: output shapes, exit codes and logs. The installed
command as a process: tests/integration/test_cli_process.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode import __version__
from gpunode.cli.main import main

DETECT_KEYS = {"schema_version", "root", "source", "names_source", "gpu_count", "nvswitch_count",
               "nouveau_loaded", "vfio_gpus", "problems", "undecided", "functions"}
FUNCTION_KEYS = {"address", "vendor_id", "device_id", "subsystem_vendor_id",
                 "subsystem_device_id", "class_code", "kind", "product_name", "numa_node",
                 "driver", "iommu_group", "unreadable"}
STATUS_KEYS = {"schema_version", "root", "verdict", "ready", "config", "boot_time", "driver",
               "containerd_config", "checks", "last_boot", "baked"}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["--log-format", "json", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_detect_json_is_the_documented_document(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    code, out, _ = run(capsys, "--root", str(host.root), "detect", "--json")
    doc = json.loads(out)
    assert code == 0
    assert set(doc) == DETECT_KEYS
    assert (doc["gpu_count"], doc["nvswitch_count"], doc["source"]) == (1, 0, "sysfs")
    assert doc["functions"] == [{
        "address": "0001:00:00.0", "vendor_id": "10de", "device_id": "1eb8",
        "subsystem_vendor_id": "10de", "subsystem_device_id": "12a2", "class_code": "030200",
        "kind": "gpu", "product_name": "TU104GL [Tesla T4]", "numa_node": None,
        "driver": "nvidia", "iommu_group": 1, "unreadable": []}]
    assert set(doc["functions"][0]) == FUNCTION_KEYS


def test_detect_table_lists_each_function_and_warns_about_nouveau(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("t4-nouveau", "bare")
    code, out, _ = run(capsys, "--root", str(host.root), "detect")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split() == ["ADDRESS", "KIND", "ID", "PRODUCT", "NUMA", "DRIVER", "IOMMU"]
    assert lines[1].split() == ["0001:00:00.0", "gpu", "10de:1eb8", "TU104GL", "[Tesla", "T4]",
                                "-", "nouveau", "1"]
    assert "warning: the nouveau module is loaded; it blocks the NVIDIA driver" in lines


def test_detect_exits_0_on_a_cpu_only_host(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("azure-d4s-v5", "bare")
    code, out, _ = run(capsys, "--root", str(host.root), "detect")
    assert (code, out.strip()) == (0, "no NVIDIA PCI functions found")


@pytest.mark.parametrize(("machine", "state", "code", "verdict"), [
    ("nc4as-t4-v3", "ready", 0, "ready"),
    ("nc4as-t4-v3", "bare", 1, "not-ready"),
    ("azure-d4s-v5", "bare", 0, "no-gpu"),
    ("t4-nouveau", "bare", 1, "not-ready"),
], ids=["ready", "not-ready", "no-gpu", "nouveau"])
def test_status_exit_code_follows_the_verdict(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str], machine: str, state: str,
    code: int, verdict: str,
) -> None:
    host = make_host(machine, state)
    got, out, _ = run(capsys, "--root", str(host.root), "status", "--json")
    doc = json.loads(out)
    assert (got, doc["verdict"], doc["ready"]) == (code, verdict, code == 0)
    assert set(doc) == STATUS_KEYS
    assert all(set(c) == {"name", "state", "detail", "hint", "code"} for c in doc["checks"])


def test_status_json_reports_driver_containerd_config_and_boot_record(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc24ads-a100-v4", "ready")
    _, out, _ = run(capsys, "--root", str(host.root), "status", "--json")
    doc = json.loads(out)
    assert doc["driver"] == {"version": "550.127.08", "flavour": "open"}
    assert doc["containerd_config"] == "/etc/containerd/config.toml"
    assert doc["boot_time"] == 1764400000.0
    assert doc["last_boot"]["outcome"] == "ok"


def test_status_table_shows_hints_for_what_is_not_ok(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    _, out, _ = run(capsys, "--root", str(host.root), "status")
    lines = out.splitlines()
    assert lines[0] == f"gpunode status ({host.root}): NOT READY"
    driver = next(i for i, line in enumerate(lines) if line.startswith("driver "))
    assert lines[driver].split()[:2] == ["driver", "fail"]
    assert lines[driver + 1].strip().startswith("hint: run 'gpunode driver load'")
    assert "\033[" not in out  # no colour when stdout is not a terminal


def test_json_logs_one_event_per_step_with_duration(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    _, _, err = run(capsys, "--root", str(host.root), "status", "--json")
    events = [json.loads(line) for line in err.splitlines()]
    assert [e["event"] for e in events] == ["step.done"]
    assert events[0]["step"] == "status"
    assert events[0]["verdict"] == "ready"
    assert isinstance(events[0]["duration_ms"], float)
    assert {"timestamp", "level"} <= set(events[0])


def test_root_that_is_not_a_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "--root", str(tmp_path / "nope"), "detect")
    [event] = [json.loads(line) for line in err.splitlines()]
    assert code == 2
    assert (event["event"], event["level"], event["exit_code"]) == ("command.refused", "error", 2)
    assert event["error"] == f"--root {tmp_path / 'nope'}: not a directory"
    assert event["hint"] == "see 'gpunode --help'"


def test_unknown_command_is_a_usage_error_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "frobnicate")
    [event] = [json.loads(line) for line in err.splitlines()]
    assert (code, out) == (2, "")
    assert event["error"].startswith("argument COMMAND: invalid choice: 'frobnicate'")
    assert event["hint"] == "see 'gpunode --help'"
    assert event["usage"].startswith("usage: gpunode ")


def test_a_subcommand_s_usage_error_names_that_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "ignition", "--format", "yaml")
    [event] = [json.loads(line) for line in err.splitlines()]
    assert code == 2
    assert event["error"].startswith("argument --format: invalid choice: 'yaml'")
    assert event["hint"] == "see 'gpunode ignition --help'"


def test_the_log_format_is_honoured_even_when_argparse_refuses_the_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--log-format comes before the command; a refusal after it still uses it."""
    code = main(["--log-format=console", "detect", "--bogus"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines()[-2:] == ["gpunode detect: error: unrecognized arguments: --bogus",
                                     "gpunode: hint: see 'gpunode detect --help'"]
    assert err.startswith("usage: gpunode ")


def test_console_usage_error_is_the_plain_gpunode_line_with_its_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--log-format", "console", "--root", str(tmp_path / "nope"), "detect"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [f"gpunode: --root {tmp_path / 'nope'}: not a directory",
                                "gpunode: hint: see 'gpunode --help'"]


def test_invalid_agent_config_is_one_json_event_naming_file_key_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[log]\nlevel = \"loud\"\n")
    code, _, err = run(capsys, "--config", str(config), "detect")
    [event] = [json.loads(line) for line in err.splitlines()]
    assert code == 2
    assert (event["file"], event["key"], event["line"]) == (str(config), "log.level", 2)
    assert event["error"].startswith(f"{config}:2: key 'log.level': ")
    assert "docs/config.md lists every key" in event["hint"]


def test_help_and_version_still_exit_0_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("gpunode ")


GARBAGE_VENDOR = {"/sys/devices/pci0001:00/0001:00:00.0/vendor": "zz\n"}


@pytest.mark.parametrize("action", ["load", "build"])
def test_driver_load_and_build_refuse_a_gpu_whose_vendor_is_garbage(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    host = make_host("nc4as-t4-v3", "driver", extra=GARBAGE_VENDOR)
    code = main(["--root", str(host.root), "--log-format", "json", "driver", action])
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    errors = [e for e in map(json.loads, err.splitlines()) if e["level"] == "error"]
    assert [e["error"] for e in errors] == ["cannot tell whether 0001:00:00.0 is an NVIDIA GPU: "
                                            "0001:00:00.0: 'vendor' is 'zz', expected 0x and 4 "
                                            "hex digits; cannot tell whether it is NVIDIA"]


def test_driver_status_fails_pci_scan_for_a_gpu_whose_vendor_is_garbage(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra=GARBAGE_VENDOR)
    code = main(["--root", str(host.root), "--log-format", "json", "driver", "status", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert (code, document["ready"], document["plan"]) == (1, False, [])
    assert document["plan_error"].startswith("cannot tell whether 0001:00:00.0 is an NVIDIA GPU")
    assert {c["name"]: c["state"] for c in document["checks"]}["pci_scan"] == "fail"


def test_label_dry_run_on_an_undecided_node_shows_gpuready_false_and_exits_1(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra=GARBAGE_VENDOR)
    code = main(["--root", str(host.root), "--log-format", "json", "label", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out.splitlines() == [
        "node nc4as-t4-v3-vmss000000", "gpunode.io/ready=false",
        f"gpunode.io/version={__version__}",
        "condition GPUReady=False (GpusNotReady): gpunode: gpus: GPU detection undecided: "
        "cannot tell whether 0001:00:00.0 is an NVIDIA GPU: 0001:00:00.0: 'vendor' is 'zz', "
        "expected 0x and 4 hex digits; cannot tell whether it is NVIDIA; pci_scan: "
        "0001:00:00.0: 'vendor' is 'zz', expected 0x and 4 hex digits; cannot tell whether it "
        "is NVIDIA"]
    errors = [e for e in map(json.loads, err.splitlines()) if e["level"] == "error"]
    assert len(errors) == 1 and errors[0]["error"].startswith(
        "would label GPUReady=False: cannot tell whether 0001:00:00.0")


def test_detect_lists_what_it_read_and_names_a_gpu_it_cannot_identify(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra=GARBAGE_VENDOR)
    code = main(["--root", str(host.root), "--log-format", "json", "detect", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert (code, document["undecided"]) == (0, ["0001:00:00.0"])
