"""Detection: NVIDIA PCI functions read from sysfs match what the machine description says."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode import log
from gpunode.gpu.detect import PciFunction, classify, detect
from gpunode.gpu.pciids import BUILTIN_NAMES, VendorBlock, nvidia_names, parse_vendor_block
from gpunode.platform.host import Host
from gpunode_testing import fixtures

EXPECTED_NAMES = {
    "1eb8": "TU104GL [Tesla T4]",
    "20b5": "GA100 [A100 PCIe 80GB]",
    "20b2": "GA100 [A100 SXM4 80GB]",
    "1af1": "GA100 [A100 NVSwitch]",
    "2236": "GA102GL [A10]",
    "1db4": "GV100GL [Tesla V100 PCIe 16GB]",
    "2321": "GH100 [H100 NVL]",
    "2901": "GB100 [B200]",
}


def expected_records(machine: fixtures.Machine, loaded: bool) -> list[PciFunction]:
    """What detect must report, derived independently from the compact description."""
    records = []
    for fn in machine.functions:
        if fn.vendor != "10de":
            continue
        sub_vendor, sub_device = fn.subsystem.split(":")
        kind = {"0302": "gpu", "0300": "gpu", "0680": "nvswitch", "0403": "audio"}.get(
            fn.cls[:4], "other")
        records.append(PciFunction(
            address=fn.address, vendor_id="10de", device_id=fn.device,
            subsystem_vendor_id=sub_vendor, subsystem_device_id=sub_device, class_code=fn.cls,
            kind=kind, product_name=EXPECTED_NAMES[fn.device],
            numa_node=None if fn.numa < 0 else fn.numa,
            driver=fn.driver or ("nvidia" if loaded else None), iommu_group=fn.iommu))
    return sorted(records, key=lambda r: r.address)


CASES = [(name, state) for name, m in fixtures.MACHINES.items() for state in m.states]


@pytest.mark.parametrize(("machine", "state"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_records_match_the_machine_description_field_by_field(
    make_host: HostFactory, machine: str, state: str
) -> None:
    spec = fixtures.MACHINES[machine]
    result = detect(make_host(machine, state))
    loaded = state != "bare" and not spec.nouveau
    assert list(result.functions) == expected_records(spec, loaded)
    assert result.source == "sysfs"
    assert result.problems == ()


def test_nd96_has_eight_gpus_and_six_nvswitches_across_two_numa_nodes(
    make_host: HostFactory,
) -> None:
    result = detect(make_host("nd96amsr-a100-v4", "driver"))
    assert len(result.gpus) == 8
    assert len(result.nvswitches) == 6
    assert {g.numa_node for g in result.gpus} == {0, 1}


def test_non_nvidia_functions_are_left_out(make_host: HostFactory) -> None:
    result = detect(make_host("azure-d4s-v5", "bare"))
    assert result.functions == ()
    assert len(detect(make_host("azure-d4s-v5", "bare"), vendor=None).functions) == 1


def test_loaded_nouveau_is_flagged(make_host: HostFactory) -> None:
    result = detect(make_host("t4-nouveau", "bare"))
    assert result.nouveau_loaded
    assert result.gpus[0].driver == "nouveau"


def test_gpu_bound_to_vfio_is_flagged(make_host: HostFactory) -> None:
    result = detect(make_host("a100-vfio", "driver"))
    assert [g.address for g in result.vfio_gpus] == ["0002:00:00.0"]


def test_names_come_from_builtin_table_when_pci_ids_is_absent(make_host: HostFactory) -> None:
    result = detect(make_host("nc4as-t4-v3", "bare", pci_ids=False))
    assert result.names_source == "builtin"
    assert result.gpus[0].product_name == "TU104GL [Tesla T4]"


def test_unknown_device_without_pci_ids_has_no_name(make_host: HostFactory) -> None:
    machine = fixtures.Machine("future", "an unknown GPU",
                               (fixtures.gpu("0001:00:00.0", "ffff"),))
    result = detect(make_host(machine, "bare", pci_ids=False))
    assert result.gpus[0].product_name is None


@pytest.mark.parametrize(
    ("class_code", "kind"),
    [("030000", "gpu"), ("030200", "gpu"), ("068000", "nvswitch"), ("040300", "audio"),
     ("0c0330", "other"), ("030100", "other"), (None, "other")],
)
def test_classification_by_pci_class(class_code: str | None, kind: str) -> None:
    assert classify(class_code) == kind


def test_garbage_class_file_is_a_problem_not_a_crash(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare",
                     extra={"/sys/devices/pci0001:00/0001:00:00.0/class": "banana\n"})
    result = detect(host)
    assert result.functions[0].class_code is None
    assert result.functions[0].kind == "other"
    assert result.problems == ("0001:00:00.0: 'class' is 'banana', expected 0x and 6 hex digits",)


def test_unreadable_attribute_is_a_problem_not_a_crash(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    numa = host.root / "sys/devices/pci0001:00/0001:00:00.0/numa_node"
    numa.unlink()
    numa.mkdir()  # reading it now fails with EISDIR, like an attribute the kernel refuses
    result = detect(host)
    assert [g.address for g in result.gpus] == ["0001:00:00.0"]  # one bad attribute hides no GPU
    assert result.gpus[0].numa_node is None
    assert result.problems == (f"0001:00:00.0: Failed to read '{host.root}/sys/bus/pci/devices/"
                               "0001:00:00.0/numa_node': is a directory, not a regular file",)


def test_function_without_vendor_is_reported(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    (host.root / "sys/devices/pci0001:00/0001:00:00.0/vendor").unlink()
    result = detect(host)
    assert result.problems == ("0001:00:00.0: no 'vendor' attribute; cannot tell whether it is "
                               "NVIDIA",)


def test_missing_sysfs_is_a_problem_not_an_empty_machine(tmp_path: Path) -> None:
    result = detect(Host(tmp_path))
    assert result.functions == ()
    assert result.problems == (f"{tmp_path}/sys/bus/pci/devices: does not exist; is sysfs mounted "
                               "(and --root the node's root)?",)


def test_pci_ids_vendor_block_skips_subsystems_and_stops_at_next_vendor() -> None:
    text = fixtures.PCI_IDS_EXCERPT
    names = parse_vendor_block(text, "10de")
    assert names["1eb8"] == "TU104GL [Tesla T4]"
    assert "0720" not in names
    assert "10de" not in names


def test_pci_ids_lookup_finds_each_asked_device_as_the_whole_block_parse_does() -> None:
    data = fixtures.PCI_IDS_EXCERPT.encode()
    names = VendorBlock.find(data, "10de")
    assert names is not None
    assert dict(names) == parse_vendor_block(fixtures.PCI_IDS_EXCERPT, "10de")
    assert (names.get("1eb8"), names.get("1EB8"), len(names)) == ("TU104GL [Tesla T4]",) * 2 + (8,)
    # a subsystem line, the next vendor's device and the vendor's own id are no devices of it
    assert [names.get(key) for key in ("12a2", "0720", "10de", "")] == [None] * 4


def test_pci_ids_names_keep_a_stray_byte_replaced_and_lose_a_carriage_return() -> None:
    data = b"10df  Other\n\t0001  x\n10de  NVIDIA\r\n\t1eb8  T\xff4 \r\n\t\t10de 1  s\r\n"
    names = VendorBlock.find(data, "10de")
    assert names is not None and names.get("1eb8") == "T\ufffd4"


@pytest.mark.parametrize("text", ["10de  NVIDIA\n\t\t10de 0001  a subsystem only\n",
                                  "10df  Emulex\n\t0720  NIC\n", ""])
def test_pci_ids_without_an_nvidia_device_gives_the_builtin_names(tmp_path: Path,
                                                                   text: str) -> None:
    (tmp_path / "usr/share/misc").mkdir(parents=True)
    (tmp_path / "usr/share/misc/pci.ids").write_text("# pci.ids\n" + text)
    names, source = nvidia_names(Host(tmp_path))
    assert (names, source) == (BUILTIN_NAMES, "builtin")


def test_a_pci_ids_link_to_nothing_gives_the_next_file(tmp_path: Path) -> None:
    (tmp_path / "usr/share/misc").mkdir(parents=True)
    (tmp_path / "usr/share/misc/pci.ids").symlink_to("/usr/share/misc/gone.ids")
    (tmp_path / "usr/share/hwdata").mkdir(parents=True)
    (tmp_path / "usr/share/hwdata/pci.ids").write_text(fixtures.PCI_IDS_EXCERPT)
    names, source = nvidia_names(Host(tmp_path))
    assert (names.get("2901"), source) == ("GB100 [B200]", "/usr/share/hwdata/pci.ids")


def test_builtin_table_covers_the_gpus_named_in_the_design() -> None:
    for device in ("1eb8", "20b5", "20b0", "20b2", "2330", "2331", "2321", "2236", "2237", "27b8",
                   "26b9", "1db4", "2335"):
        assert device in BUILTIN_NAMES


def test_flat_sysfs_layout_reads_the_same(make_host: HostFactory) -> None:
    """The layout the end-to-end boot test bind-mounts over a real /sys/bus/pci/devices."""
    normal = detect(make_host("nd96amsr-a100-v4", "driver"))
    flat = detect(make_host("nd96amsr-a100-v4", "driver", flat_sysfs=True))
    assert flat.functions == normal.functions


def test_loaded_modules_come_from_sys_module_without_proc_modules(make_host: HostFactory) -> None:
    from gpunode.gpu.detect import loaded_modules

    host = make_host("nc4as-t4-v3", "driver")
    with_proc = loaded_modules(host)
    (host.root / "proc/modules").unlink()
    assert loaded_modules(host) == with_proc
    assert {"nvidia", "nvidia_uvm", "nvidia_modeset"} <= with_proc


def test_udev_asked_for_under_a_root_reads_the_roots_sysfs_not_this_machines(
        make_host: HostFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    monkeypatch.setattr(log, "_logger", log.get())  # the test's logger is undone afterwards
    stream = io.StringIO()
    log.configure("json", stream=stream)
    assert detect(host, use_udev=True) == detect(host, use_udev=False)
    assert detect(host, use_udev=True).source == "sysfs"
    warned = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert warned[0]["event"] == "detect.udev_not_under_root"
    assert warned[0]["fallback"] == "sysfs"
