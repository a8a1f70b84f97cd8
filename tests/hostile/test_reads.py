"""Hostile reads: every file gpunode reads, replaced by something that is not a sane file.

A FIFO must never block (the open is non-blocking and refused), a directory, socket, loop,
huge file or non-UTF-8 text gets one clear refusal naming the path, and numbers in kernel
files are ASCII digits within the kernel's ranges. Records gpunode reads back (the boot
record, the input stamp) are validated: a bad one is a status warning or a full boot, never
a traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.cli.main import main
from gpunode.errors import HostError
from gpunode.platform.host import Host
from hostile.support import Cli, assert_unchanged, check_refusal, snapshot

CONFIG = "etc/gpunode/config.toml"
VERSION = "proc/driver/nvidia/version"
RECORD = "run/gpunode/state.json"
DMI = "sys/class/dmi/id/product_name"
INFO = "proc/driver/nvidia/gpus/0001:00:00.0/information"


def _replace(root: Path, path: str, make: Callable[[Path], None]) -> Path:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.is_file():
        target.unlink()
    make(target)
    return target


def fifo(p: Path) -> None:
    os.mkfifo(p)


def directory(p: Path) -> None:
    p.mkdir()


def unix_socket(p: Path) -> None:
    os.mknod(p, stat.S_IFSOCK | 0o600)


def loop(p: Path) -> None:
    p.symlink_to(p.name + ".other")
    p.with_name(p.name + ".other").symlink_to(p.name)


def non_utf8(p: Path) -> None:
    p.write_bytes(b'[log]\nlevel = "info\xff"\n')


def huge(p: Path) -> None:
    with open(p, "wb") as f:
        f.truncate(17 << 20)  # sparse: 17 MiB of zeros, over the 16 MiB cap


ODD = {"fifo": (fifo, "is a FIFO, not a regular file"),
       "directory": (directory, "is a directory, not a regular file"),
       "socket": (unix_socket, "is a socket, not a regular file"),
       "symlink-loop": (loop, "too many levels of symbolic links"),
       "huge": (huge, "is larger than 16 MiB")}


def run_bounded(action: Callable[[], object], seconds: int = 10) -> object:
    """action() under an alarm: a hang fails the test instead of blocking the suite."""

    def hang(signum: int, frame: object) -> None:
        raise AssertionError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        return action()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# -- the safe reader itself -----------------------------------------------------------------------


@pytest.mark.parametrize("odd", list(ODD), ids=list(ODD))
def test_host_refuses_what_is_not_a_regular_file_naming_the_path(tmp_path: Path, odd: str) -> None:
    make, reason = ODD[odd]
    _replace(tmp_path, "etc/file", make)
    with pytest.raises(HostError) as info:
        run_bounded(lambda: Host(tmp_path).read_optional("/etc/file"))
    assert re.fullmatch(f"Failed to (read|resolve) '{re.escape(str(tmp_path))}/etc/file': "
                        f"{reason}", str(info.value)), str(info.value)


@pytest.mark.parametrize("odd", ["fifo", "directory", "symlink-loop"])
def test_the_live_host_reader_refuses_them_too(tmp_path: Path, odd: str) -> None:
    """What `ignition --agent-config FILE` and --config read: Host() on the machine itself."""
    make, reason = ODD[odd]
    path = _replace(tmp_path, "agent.toml", make)
    with pytest.raises(HostError, match=reason):
        run_bounded(lambda: Host().read_text(str(path)))


def test_a_file_over_a_callers_own_cap_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    with pytest.raises(HostError, match="is larger than 64 bytes"):
        Host(tmp_path).read_bytes("/f", limit=64)


@pytest.mark.allow_paths("/proc/self/status")  # a real kernel file, which stat calls empty
def test_kernel_files_that_report_size_zero_are_read_to_the_end() -> None:
    assert Host().read_text("/proc/self/status").startswith("Name:")


def test_text_that_must_be_utf8_is_refused_with_the_byte_offset(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/x.json").write_bytes(b'{"a": "\xc3\x28"}')
    with pytest.raises(HostError, match=r"is not UTF-8 text \(invalid byte 0xc3 at line 1, "
                       r"byte offset 7\)"):
        Host(tmp_path).read_text("/etc/x.json")


def test_kernel_attribute_text_keeps_its_replaced_bytes(tmp_path: Path) -> None:
    _replace(tmp_path, DMI, lambda p: p.write_bytes(b"Virtual \xff Machine\n"))
    assert Host(tmp_path).read_text("/" + DMI) == "Virtual \ufffd Machine\n"


def test_a_fifo_as_a_sysfs_attribute_is_a_detection_problem_not_a_hang(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    _replace(host.root, "sys/devices/pci0001:00/0001:00:00.0/numa_node", fifo)
    result = cli("--root", str(host.root), "detect", "--json")
    assert result.code == 0
    assert any("numa_node': is a FIFO, not a regular file" in p
               for p in json.loads(result.out)["problems"])


# -- the agent config (exit 2) --------------------------------------------------------------------


@pytest.mark.parametrize("odd", [*ODD, "non-utf8"], ids=[*ODD, "non-utf8"])
def test_an_agent_config_that_is_no_file_is_refused_with_exit_2(
    make_host: HostFactory, cli: Cli, odd: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    make, reason = ODD.get(odd, (non_utf8, r"is not UTF-8 text \(invalid byte 0xff at line 2, "
                                            "byte offset 19\\)"))
    _replace(host.root, CONFIG, make)
    before = snapshot(host.root)
    result = cli("--root", str(host.root), "status")
    assert result.code == 2
    assert f"{host.root}/{CONFIG}: cannot be read: " in result.err
    assert re.search(reason, result.err), result.err
    assert snapshot(host.root) == before


def test_a_fifo_as_an_explicit_config_is_refused(tmp_path: Path, cli: Cli) -> None:
    os.mkfifo(tmp_path / "agent.toml")
    result = cli("--root", str(tmp_path), "--config", str(tmp_path / "agent.toml"), "detect")
    assert (result.code, "is a FIFO, not a regular file" in result.err) == (2, True)


def test_a_missing_explicit_config_is_an_error_even_at_the_default_path(
    make_host: HostFactory, cli: Cli
) -> None:
    """A --config FILE that does not exist is an error; only no --config means defaults."""
    host = make_host("nc4as-t4-v3", "ready")
    result = cli("--config", "/etc/gpunode/config.toml", "--root", str(host.root), "status")
    assert result.code == 2
    assert "/etc/gpunode/config.toml: does not exist (omit --config to use defaults)" in result.err


@pytest.mark.parametrize(("text", "message"), [
    ("a = " + "[" * 600 + "]" * 600 + "\n", "nested too deeply"),
    ("[log]\nlevel = 5\n", "key 'log.level': must be a string, not an integer (5)"),
    ("log = []\n", "key 'log': must be a table ([log]), not an array"),
], ids=["nested-600-deep", "an-integer", "an-array"])
def test_agent_config_refusals_read_well(
    make_host: HostFactory, cli: Cli, text: str, message: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (host.root / CONFIG).write_text(text)
    result = cli("--root", str(host.root), "status")
    assert result.code == 2
    assert message in result.err


def test_a_byte_order_mark_before_the_agent_config_is_accepted(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (host.root / CONFIG).write_bytes(b'\xef\xbb\xbf[log]\nlevel = "debug"\n')
    result = cli("--root", str(host.root), "status", "--json")
    assert result.code == 0
    assert json.loads(result.out)["config"] == f"{host.root}/{CONFIG}"


# -- --root ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("root", "message"), [
    ("", "--root is empty"),
    ("FILE", "not a directory"),
    ("MISSING", "not a directory"),
    ("FILE/below", "not a directory"),
    ("LOOP", "cannot be used ([Errno 40] Too many levels of symbolic links"),
], ids=["empty", "regular-file", "missing", "below-a-file", "symlink-loop"])
def test_a_root_that_is_no_directory_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    root: str, message: str
) -> None:
    """For `boot`, whose CPU-node shortcut reads the root first."""
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "LOOP").symlink_to("LOOP")
    value = str(tmp_path / root) if root else ""
    monkeypatch.chdir(tmp_path)
    code = run_bounded(lambda: main([f"--root={value}", "--log-format", "json", "boot"]))
    err = capsys.readouterr().err
    assert (code, "Traceback" in err) == (2, False)
    assert message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE", "LOOP"]  # nothing made


# -- the driver's /proc files ----------------------------------------------------------------------


@pytest.mark.parametrize("odd", ["fifo", "directory", "symlink-loop"])
def test_status_shows_its_table_when_the_driver_version_file_is_no_file(
    make_host: HostFactory, cli: Cli, odd: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    make, reason = ODD[odd]
    _replace(host.root, VERSION, make)
    result = cli("--root", str(host.root), "status", "--json")
    assert result.code == 1
    driver = next(c for c in json.loads(result.out)["checks"] if c["name"] == "driver")
    assert driver["state"] == "fail"
    assert f"{host.root}/{VERSION}': {reason}" in driver["detail"]


@pytest.mark.parametrize("odd", ["fifo", "directory"])
def test_driver_load_refuses_a_driver_version_file_that_is_no_file(
    make_host: HostFactory, cli: Cli, odd: str
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    make, reason = ODD[odd]
    _replace(host.root, VERSION, make)
    check_refusal(cli, host.root, ["--root", str(host.root), "driver", "load"], 1, reason)


def test_a_fifo_as_the_dmi_product_name_does_not_hold_status(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    _replace(host.root, DMI, fifo)
    result = cli("--root", str(host.root), "status", "--json")
    assert result.code == 0  # the machine's name is only a label


# -- numbers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "old", "new", "message"), [
    ("proc/devices", "195 nvidia-frontend", "¹⁹⁵ nvidia-frontend",
     "'¹⁹⁵ nvidia-frontend' is not '<major> <name>'"),
    ("proc/devices", "195 nvidia-frontend", "٣ nvidia-frontend",
     "'٣ nvidia-frontend' is not '<major> <name>'"),
    ("proc/devices", "195 nvidia-frontend", "4096 nvidia-frontend",
     "'4096 nvidia-frontend' is not '<major> <name>' with a major from 0 to 4095"),
    (INFO, "Device Minor: \t 0", "Device Minor: \t ²",
     "'Device Minor' is '²', expected an integer from 0 to 1048575"),
    (INFO, "Device Minor: \t 0", "Device Minor: \t 99999999999",
     "'Device Minor' is '99999999999', expected an integer from 0 to 1048575"),
], ids=["superscript-major", "arabic-indic-major", "major-4096", "superscript-minor",
        "minor-99999999999"])
def test_driver_load_refuses_device_numbers_the_kernel_cannot_have(
    make_host: HostFactory, cli: Cli, path: str, old: str, new: str, message: str
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    file = host.root / path
    text = file.read_text()
    assert old in text
    file.write_text(text.replace(old, new))
    for node in (host.root / "dev").glob("nvidia*"):
        node.unlink()  # so that the nodes must be made
    check_refusal(cli, host.root, ["--root", str(host.root), "driver", "load"], 1,
                  message.replace("(", r"\(").replace(")", r"\)"))


def test_boot_records_an_out_of_range_minor_as_the_driver_steps_failure(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    info = host.root / INFO
    info.write_text(info.read_text().replace("Device Minor: \t 0", "Device Minor: \t 99999999999"))
    result = cli("--root", str(host.root), "boot")
    assert result.code == 1
    record = json.loads((host.root / RECORD).read_text())
    driver = next(s for s in record["steps"] if s["name"] == "driver")
    assert (record["outcome"], driver["outcome"]) == ("failed", "failed")
    assert "'Device Minor' is '99999999999'" in driver["error"]


def test_status_names_an_out_of_range_minor_in_device_nodes(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    info = host.root / INFO
    info.write_text(info.read_text().replace("Device Minor: \t 0", "Device Minor: \t ²"))
    result = cli("--root", str(host.root), "status", "--json")
    nodes = next(c for c in json.loads(result.out)["checks"] if c["name"] == "device_nodes")
    assert (result.code, nodes["state"]) == (1, "fail")
    assert "'Device Minor' is '²'" in nodes["detail"]


@pytest.mark.parametrize(("mutate", "field", "expected"), [
    (lambda r: (r / "proc/stat").write_text("btime abc\n"), "boot_time", None),
    (lambda r: (r / "proc/stat").unlink(), "boot_time", None),
    (lambda r: _replace(r, "proc/stat", fifo), "boot_time", None),
    (lambda r: (r / "proc/812/stat").write_text("garbage\n"), "containerd_running", "ok"),
    (lambda r: (r / "proc/812/stat").write_text("812 (containerd) S\n"), "containerd_running",
     "ok"),
    (lambda r: _replace(r, "proc/812/stat", fifo), "containerd_running", "ok"),
    (lambda r: (r / "proc/²").mkdir(), "kubelet_running", "ok"),
], ids=["btime-abc", "no-proc-stat", "proc-stat-fifo", "pid-stat-garbage", "pid-stat-short",
        "pid-stat-fifo", "unicode-pid"])
def test_status_reports_unknowns_in_proc_instead_of_crashing(
    make_host: HostFactory, cli: Cli, mutate: Callable[[Path], object], field: str,
    expected: object
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    mutate(host.root)
    result = cli("--root", str(host.root), "status", "--json")
    doc = json.loads(result.out)
    assert result.code in (0, 1)
    if field == "boot_time":
        assert doc["boot_time"] is expected
    else:
        assert next(c for c in doc["checks"] if c["name"] == field)["state"] == expected


@pytest.mark.parametrize(("attribute", "value", "key", "expected"), [
    ("numa_node", "²\n", "numa_node", None),
    ("numa_node", "99999999999999999999\n", "numa_node", None),
], ids=["superscript-numa", "huge-numa"])
def test_detect_reads_numbers_as_ascii_integers(
    make_host: HostFactory, cli: Cli, attribute: str, value: str, key: str, expected: object
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / f"sys/devices/pci0001:00/0001:00:00.0/{attribute}").write_text(value)
    result = cli("--root", str(host.root), "detect", "--json")
    doc = json.loads(result.out)
    gpu = next(f for f in doc["functions"] if f["address"] == "0001:00:00.0")
    assert (result.code, gpu[key]) == (0, expected)
    assert any(f"'{attribute}' is" in p for p in doc["problems"])


def test_an_iommu_group_with_a_unicode_digit_name_is_no_group(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    link = host.root / "sys/devices/pci0001:00/0001:00:00.0/iommu_group"
    link.unlink()
    (host.root / "sys/kernel/iommu_groups/²").mkdir(parents=True)
    link.symlink_to("../../../kernel/iommu_groups/²")
    result = cli("--root", str(host.root), "detect", "--json")
    gpu = next(f for f in json.loads(result.out)["functions"] if f["address"] == "0001:00:00.0")
    assert (result.code, gpu["iommu_group"]) == (0, None)


# -- a GPU whose vendor cannot be read ---------------------------------------------------------


VENDOR = "sys/devices/pci0001:00/0001:00:00.0/vendor"
BAD_VENDOR = {
    "garbage": lambda p: p.write_text("0xzzzz\n"),
    "unicode": lambda p: p.write_text("0x\uff11\uff10\uff44\uff45\n"),  # fullwidth 10de
    "missing": lambda p: p.unlink(),
    "fifo": lambda p: (p.unlink(), os.mkfifo(p)),
    "directory": lambda p: (p.unlink(), p.mkdir()),
}


@pytest.mark.parametrize("bad", list(BAD_VENDOR))
def test_a_gpu_whose_vendor_cannot_be_read_makes_status_not_ready(
    make_host: HostFactory, cli: Cli, bad: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    BAD_VENDOR[bad](host.root / VENDOR)
    result = cli("--root", str(host.root), "status", "--json")
    doc = json.loads(result.out)
    scan = next(c for c in doc["checks"] if c["name"] == "pci_scan")
    assert (result.code, doc["verdict"], scan["state"]) == (1, "not-ready", "fail")
    assert "0001:00:00.0: " in scan["detail"] and "cannot tell whether it is NVIDIA" in \
        scan["detail"]


@pytest.mark.parametrize("bad", ["garbage", "fifo"])
def test_boot_does_not_record_no_gpu_for_a_gpu_whose_vendor_cannot_be_read(
    make_host: HostFactory, cli: Cli, bad: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    BAD_VENDOR[bad](host.root / VENDOR)
    (host.root / RECORD).unlink()
    result = cli("--root", str(host.root), "boot")
    record = json.loads((host.root / RECORD).read_text())
    assert (result.code, record["outcome"]) == (1, "failed")
    assert record["steps"][0]["name"] == "detect"
    assert "cannot tell whether 0001:00:00.0 is an NVIDIA GPU" in record["steps"][0]["error"]


def test_plan_refuses_to_decide_for_a_gpu_whose_vendor_cannot_be_read(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    BAD_VENDOR["garbage"](host.root / VENDOR)
    check_refusal(cli, host.root, ["--root", str(host.root), "plan"], 1,
                  "cannot tell whether 0001:00:00.0 is an NVIDIA GPU")


def test_a_nic_whose_vendor_cannot_be_read_is_only_a_warning(
    make_host: HostFactory, cli: Cli
) -> None:
    """Its class (network, 0200) says it is no GPU, whoever made it."""
    host = make_host("azure-d4s-v5", "bare")
    (host.root / "sys/devices/pcic3c1:00/c3c1:00:02.0/vendor").write_text("0xzzzz\n")
    result = cli("--root", str(host.root), "status", "--json")
    doc = json.loads(result.out)
    scan = next(c for c in doc["checks"] if c["name"] == "pci_scan")
    assert (result.code, doc["verdict"], scan["state"]) == (0, "no-gpu", "warn")


# -- the boot record ------------------------------------------------------------------------------


def _record(**changes: object) -> dict[str, object]:
    step = {"name": "driver", "outcome": "ok", "duration_ms": 412.0, "error": None, "hint": None,
            "strategy": "external", "modules_loaded": ["nvidia"]}
    record: dict[str, object] = {"schema_version": 1, "started_at": "2026-11-29T08:00:01Z",
                                 "finished_at": "2026-11-29T08:00:02Z", "outcome": "ok",
                                 "steps": [step]}
    for key, value in changes.items():
        if key.startswith("step_"):
            step[key.removeprefix("step_")] = value
        else:
            record[key] = value
    return record


BAD_RECORDS: dict[str, tuple[object, str]] = {
    "duration-fast": (_record(step_duration_ms="fast"),
                      "step 1 ('driver'): duration_ms is 'fast', expected a number"),
    "duration-true": (_record(step_duration_ms=True), "duration_ms is true, expected a number"),
    "error-5": (_record(step_error=5), "error is 5, expected a string or null"),
    "strategy-list": (_record(step_strategy=["x"]), "strategy is [\"x\"], expected a string"),
    "modules-not-strings": (_record(step_modules_loaded=[1]),
                            "modules_loaded is [1], expected an array of strings"),
    "modules-a-string": (_record(step_modules_loaded="nvidia"),
                         "modules_loaded is 'nvidia', expected an array"),
    "step-not-object": (_record(steps=["driver"]), "step 1 is 'driver', expected an object"),
    "steps-not-array": (_record(steps={"a": 1}), "steps is {\"a\": 1}, expected an array"),
    "step-no-name": (_record(steps=[{"outcome": "ok"}]), "step 1 has no 'name'"),
    "step-outcome": (_record(step_outcome="maybe"), "outcome is 'maybe', expected ok or failed"),
    "finished-at-5": (_record(finished_at=5), "finished_at is 5, expected a time"),
    "schema-true": (_record(schema_version=True), "schema_version is True, expected 1"),
    "not-object": ([1, 2], "not a JSON object"),
    "deep": ("[" * 100000 + "]" * 100000, "not JSON"),
}


@pytest.mark.parametrize("bad", list(BAD_RECORDS))
def test_a_boot_record_with_wrong_types_is_a_last_boot_warning(
    make_host: HostFactory, cli: Cli, bad: str
) -> None:
    record, reason = BAD_RECORDS[bad]
    text = record if isinstance(record, str) else json.dumps(record)
    host = make_host("nc4as-t4-v3", "ready", extra={"/" + RECORD: text})
    result = cli("--root", str(host.root), "status", "--json")
    doc = json.loads(result.out)
    last = next(c for c in doc["checks"] if c["name"] == "last_boot")
    driver = next(c for c in doc["checks"] if c["name"] == "driver")
    assert (result.code, last["state"], driver["state"]) == (0, "warn", "ok")
    assert reason in last["detail"], last["detail"]
    assert doc["last_boot"] is None


@pytest.mark.parametrize("odd", ["fifo", "directory", "non-utf8"])
def test_a_boot_record_that_is_no_file_is_a_last_boot_warning(
    make_host: HostFactory, cli: Cli, odd: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    make, reason = ODD.get(odd, (non_utf8, "is not UTF-8 text"))
    _replace(host.root, RECORD, make)
    result = cli("--root", str(host.root), "status", "--json")
    last = next(c for c in json.loads(result.out)["checks"] if c["name"] == "last_boot")
    assert (result.code, last["state"]) == (0, "warn")
    assert reason in last["detail"]


def test_a_valid_driver_step_still_tells_how_the_driver_was_loaded(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra={"/" + RECORD: json.dumps(_record())})
    result = cli("--root", str(host.root), "status", "--json")
    driver = next(c for c in json.loads(result.out)["checks"] if c["name"] == "driver")
    assert driver["detail"].endswith("; last boot: external, loaded nvidia in 412 ms")


@pytest.mark.parametrize("odd", ["fifo", "directory"])
def test_a_pci_ids_that_is_no_file_gives_the_builtin_names(
    make_host: HostFactory, cli: Cli, odd: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    _replace(host.root, "usr/share/misc/pci.ids", ODD[odd][0])
    result = cli("--root", str(host.root), "detect", "--json")
    assert (result.code, json.loads(result.out)["names_source"]) == (0, "builtin")


STATUS_READS = ["proc/modules", "proc/devices", VERSION, INFO, DMI, RECORD,
                "etc/containerd/config.toml", "usr/lib/systemd/system/containerd.service",
                "etc/systemd/system/containerd.service.d/10-gpunode.conf", "proc/stat",
                "proc/812/stat", "proc/812/comm", "proc/1033/cmdline",
                "sys/devices/pci0001:00/0001:00:00.0/class", "usr/share/misc/pci.ids",
                "sys/class/dmi/id/sys_vendor", "proc/sys/kernel/hostname"]


@pytest.mark.parametrize("path", STATUS_READS, ids=[p.rpartition("/")[2] + "@" + p.split("/")[0]
                                                     for p in STATUS_READS])
@pytest.mark.parametrize("odd", ["fifo", "directory"])
def test_status_always_shows_its_table_whatever_a_file_it_reads_has_become(
    make_host: HostFactory, cli: Cli, path: str, odd: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    _replace(host.root, path, ODD[odd][0])
    result = cli("--root", str(host.root), "status", "--json")
    assert result.code in (0, 1), result.err
    assert json.loads(result.out)["checks"]
    assert result.code == 0 or any(c["state"] == "fail" for c in json.loads(result.out)["checks"])


BOOT_READS = ["proc/modules", "proc/devices", VERSION, INFO, "proc/sys/kernel/osrelease",
              "etc/containerd/config.toml", "usr/lib/systemd/system/containerd.service",
              "etc/systemd/system/containerd.service.d/10-gpunode.conf",
              "sys/devices/pci0001:00/0001:00:00.0/class", "sys/class/dmi/id/sys_vendor",
              "var/lib/gpunode/containerd.json", "etc/flatcar/enabled-sysext.conf"]


@pytest.mark.parametrize("path", BOOT_READS, ids=[p.rpartition("/")[2] for p in BOOT_READS])
def test_boot_never_blocks_on_a_fifo_and_always_writes_its_record(
    make_host: HostFactory, cli: Cli, path: str
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    _replace(host.root, path, fifo)
    result = cli("--root", str(host.root), "boot")
    assert result.code in (0, 1), result.err
    record = json.loads((host.root / RECORD).read_text())
    assert record["outcome"] == ("ok" if result.code == 0 else "failed")
    assert len(result.errors) == sum(s["outcome"] == "failed" for s in record["steps"])


COMMAND_READS = [
    (["driver", "load"], "proc/modules"), (["driver", "load"], "proc/devices"),
    (["driver", "load"], "proc/sys/kernel/osrelease"), (["driver", "load"], INFO),
    (["containerd", "configure"], "etc/containerd/config.toml"),
    (["containerd", "configure"], "usr/lib/systemd/system/containerd.service"),
    (["containerd", "configure", "--dry-run"], "etc/containerd/config.toml"),
    (["containerd", "revert"], "var/lib/gpunode/containerd.json"),
]  # label reads the DMI name as status does (only a label): tests/hostile/test_consistency.py


@pytest.mark.parametrize(("argv", "path"), COMMAND_READS,
                         ids=[f"{' '.join(a)}:{p.rpartition('/')[2]}" for a, p in COMMAND_READS])
def test_every_command_refuses_a_fifo_it_would_read(
    make_host: HostFactory, cli: Cli, argv: list[str], path: str
) -> None:
    host = _runtime(make_host("nc4as-t4-v3", "ready"))
    _replace(host.root, path, fifo)
    check_refusal(cli, host.root, ["--root", str(host.root), *argv], 1,
                  f"{re.escape(path.rpartition('/')[2])}'?: is a FIFO, not a regular file")


def test_plan_names_a_fifo_as_the_step_it_would_fail_and_still_answers(
    make_host: HostFactory, cli: Cli
) -> None:
    """plan's exit is 0 whenever it could plan: a step boot would fail at is part of the plan."""
    host = _runtime(make_host("nc4as-t4-v3", "ready"))
    _replace(host.root, "proc/sys/kernel/osrelease", fifo)
    before = snapshot(host.root)
    result = cli("--root", str(host.root), "plan")
    assert result.code == 0, result.err
    assert re.search(r"driver: would fail: .*osrelease'?: is a FIFO, not a regular file",
                     result.out), result.out
    assert_unchanged(host.root, before)


def _runtime(host: Host) -> Host:
    binary = host.root / "usr/bin/nvidia-container-runtime"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return host


def test_a_root_without_a_pci_tree_is_not_a_cpu_node(make_host: HostFactory, cli: Cli) -> None:
    """Nothing looked at is not "no GPU": boot fails its detect step (and still writes its
    record) instead of recording no-gpu for a node whose GPUs it never saw."""
    host = make_host("nc4as-t4-v3", "driver")
    import shutil

    shutil.rmtree(host.root / "sys/bus/pci/devices")
    result = cli("--root", str(host.root), "boot")
    assert result.code == 1, result.err
    assert re.search(r"cannot look for NVIDIA GPUs: .*/sys/bus/pci/devices: does not exist",
                     str(result.errors[0]["error"]))
    record = json.loads((host.root / RECORD).read_text())
    assert (record["outcome"], record["steps"][-1]["name"]) == ("failed", "detect")


@pytest.mark.parametrize("release", ["6.6.60\0-flatcar", "6.6.60 flatcar", "6.6.60-fl\u00e4tcar"],
                         ids=["nul-byte", "space", "non-ascii"])
def test_a_damaged_kernel_release_fails_the_driver_step_with_its_text(
    make_host: HostFactory, cli: Cli, release: str
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    (host.root / "proc/sys/kernel/osrelease").write_text(release + "\n")
    result = cli("--root", str(host.root), "driver", "load")
    assert result.code == 1, result.err
    assert "not a kernel release" in str(result.errors[0]["error"])


def test_a_host_path_with_a_nul_byte_is_a_host_error(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="cannot contain a NUL byte"):
        Host(tmp_path).read_optional("/lib/modules/6.6\0x/modules.dep")
