"""NVRM Xid lines as the driver branches write them, read from /dev/kmsg records
(gpunode/watch/xid.py): address, code, process and text, and what each Xid means."""

from __future__ import annotations

import pytest

from gpunode.config import DEFAULT_FATAL, DEFAULT_IGNORED
from gpunode.watch import xid

# Each line as a driver wrote it (sources in xid.py's docstring), as one /dev/kmsg record.
LINES = {
    "r595-pid-name": ("NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, "
                      "Graphics SM Warp Exception on (GPC 7, TPC 1, SM 0)",
                      ("0000:cb:00.0", 13, None, None, "Graphics SM Warp Exception on "
                       "(GPC 7, TPC 1, SM 0)")),
    "r535-pid-process": ("NVRM: Xid (PCI:0000:00:06): 31, pid=79749, name=exe, Ch 0000000a, "
                         "intr 00000000. MMU Fault: ENGINE GRAPHICS",
                         ("0000:00:06.0", 31, 79749, "exe", "Ch 0000000a, intr 00000000. MMU "
                          "Fault: ENGINE GRAPHICS")),
    "r450-pid-only": ("NVRM: Xid (PCI:0000:01:00): 79, pid=1122, GPU has fallen off the bus.",
                      ("0000:01:00.0", 79, 1122, None, "GPU has fallen off the bus.")),
    "r375-no-pid": ("NVRM: Xid (PCI:0000:03:00): 79, GPU has fallen off the bus.",
                    ("0000:03:00.0", 79, None, None, "GPU has fallen off the bus.")),
    "oldest-no-pci-prefix": ("NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007 M 00001ffc",
                             ("0000:01:00.0", 3, None, None, "C 00000005 SC 00000007 M "
                              "00001ffc")),
    "mig-instance": ("NVRM: Xid (PCI:0000:3B:00 GPU-I:01 GPU-CI:00): 43, pid=2002, name=python, "
                     "Ch 00000008",
                     ("0000:3b:00.0", 43, 2002, "python", "Ch 00000008")),
    "row-remapper": ("NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked "
                     "for remapping, reset gpu to activate.",
                     ("0000:10:1c.0", 63, 1896, None, "Row Remapper: New row marked for "
                      "remapping, reset gpu to activate.")),
}


@pytest.mark.parametrize("line,expected", LINES.values(), ids=list(LINES))
def test_each_branch_wording_gives_address_code_process_and_text(
        line: str, expected: tuple[object, ...]) -> None:
    record = xid.parse_record(f"3,812,5107644336,-;{line}")
    assert record is not None and (record.seq, record.usec) == (812, 5107644336)
    found = xid.parse_xid(record)
    assert found is not None
    assert (found.address, found.code, found.pid, found.process, found.text) == expected


GARBAGE = {
    "empty": "",
    "no-prefix": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
    "continuation-line": " SUBSYSTEM=pci",
    "binary": "\x00\xff\x01;\x02",
    "prefix-not-numbers": "a,b,c,-;NVRM: Xid (PCI:0000:3b:00): 79, x",
    "not-an-xid": "6,5,100,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.195.03",
    "xid-without-code": "4,6,100,-;NVRM: Xid (PCI:0000:3b:00): , GPU has fallen off the bus.",
    "xid-address-garbled": "4,7,100,-;NVRM: Xid (PCI:zzzz:3b:00): 79, GPU has fallen off",
    "code-too-large": "4,8,100,-;NVRM: Xid (PCI:0000:3b:00): 999999, GPU has fallen off",
    "seq-huge": "4," + "9" * 30 + ",100,-;NVRM: Xid (PCI:0000:3b:00): 79, x",
}


@pytest.mark.parametrize("raw", GARBAGE.values(), ids=list(GARBAGE))
def test_garbage_is_no_xid_and_never_an_exception(raw: str) -> None:
    record = xid.parse_record(raw)
    assert record is None or xid.parse_xid(record) is None


def test_a_record_read_from_the_device_keeps_only_its_first_line() -> None:
    record = xid.parse_record("4,9,100,-;NVRM: Xid (PCI:0000:3b:00): 48, DBE\n"
                              " SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n")
    assert record is not None and record.message == "NVRM: Xid (PCI:0000:3b:00): 48, DBE"


def test_control_characters_in_the_driver_text_become_question_marks() -> None:
    record = xid.parse_record("4,9,100,-;NVRM: Xid (PCI:0000:3b:00): 48, bad\x1b[31m")
    assert record is not None
    found = xid.parse_xid(record)
    assert found is not None and found.text == "bad?[31m"


def test_the_uuid_line_names_the_gpu_by_address() -> None:
    record = xid.parse_record("4,2,100,-;NVRM: GPU at PCI:0000:2b:00: "
                              "GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae")
    assert record is not None
    assert xid.parse_uuid(record) == ("0000:2b:00.0", "GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae")


@pytest.mark.parametrize("code,kind", [
    (79, xid.FATAL), (48, xid.FATAL), (119, xid.FATAL), (31, xid.IGNORED), (13, xid.IGNORED),
    (109, xid.IGNORED), (68, xid.FATAL), (94, xid.EVENT), (8, xid.EVENT)],
    ids=["79-fell-off", "48-dbe", "119-gsp-timeout", "31-page-fault", "13-graphics",
         "109-ctxsw-timeout", "68-in-both-is-fatal", "94-contained-ecc", "8-stopped"])
def test_default_sets_classify_fatal_ignored_and_event(code: int, kind: str) -> None:
    assert xid.classify(code, DEFAULT_FATAL, DEFAULT_IGNORED) == kind
