"""`gpunode watch --once`'s checks beyond the kernel log, on fixture nodes: the Azure VM size's
GPU count (gpunode/watch/vmsize.py), containerd's config kept as gpunode configured it and the
CDI spec kept current (gpunode/watch/checks.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.host import Host
from gpunode.watch import vmsize
from hostile.support import Cli

T4 = "nc4as-t4-v3"


def changes(cli: Cli, host: Host, *extra: str) -> list[dict[str, Any]]:
    (host.root / "dev").mkdir(exist_ok=True)
    kmsg = host.root / "dev/kmsg"
    if not kmsg.exists():
        kmsg.write_text("")
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
