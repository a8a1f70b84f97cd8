"""How many GPUs an Azure VM of this size has, read from the node itself (no network).

Azure's DMI names the machine, not its size: `sys_vendor` is "Microsoft Corporation" and
`product_name` "Virtual Machine" on every Hyper-V guest (risuorg/risu,
risuclient/common.d/01-virt.sh, tells Azure from Hyper-V only by the DMI version), so the
size comes from the instance metadata. On Flatcar, Afterburn (coreos-metadata.service) reads
it from Azure's IMDS at boot and writes it to /run/metadata/flatcar as COREOS_AZURE_VMSIZE
(coreos/afterburn docs/usage/legacy-attributes.md; AFTERBURN_AZURE_VMSIZE in
/run/metadata/afterburn on other distributions, docs/usage/attributes.md). The Azure Linux
agent's files (/var/lib/waagent HostingEnvironmentConfig.xml, Azure/WALinuxAgent
tests/data/wire/hosting_env.xml) do not name the size.

The table is Microsoft's (MicrosoftDocs/azure-docs, articles/virtual-machines/sizes/
gpu-accelerated/*-series.md, the "Accelerators" tab; the NC A10 v4 sizes from
microsoft/aspire src/Aspire.Hosting.Azure.Kubernetes/AksNodeVmSizes.cs). A fractional
NVadsA10_v5 size (1/6, 1/3, 1/2 of an A10) is one vGPU device in the VM, counted as 1. A size
not in the table, a file that is not Afterburn's, or a node not on Azure: no claim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpunode import log
from gpunode.driver.flavour import AZURE_VENDOR
from gpunode.errors import GpunodeError
from gpunode.platform import envfile
from gpunode.platform.host import Host

DMI_VENDOR = "/sys/class/dmi/id/sys_vendor"
METADATA = (("/run/metadata/flatcar", "COREOS_AZURE_VMSIZE"),
            ("/run/metadata/coreos", "COREOS_AZURE_VMSIZE"),
            ("/run/metadata/afterburn", "AFTERBURN_AZURE_VMSIZE"))
METADATA_LIMIT = 64 << 10  # Afterburn's file is a few lines
_SIZE = re.compile(r"Standard_[A-Za-z0-9_]{1,60}")

# VM size (lowercase: Azure's names are case-insensitive) → GPUs the VM has.
GPUS: dict[str, int] = {
    # NCasT4_v3: Tesla T4
    "standard_nc4as_t4_v3": 1, "standard_nc8as_t4_v3": 1, "standard_nc16as_t4_v3": 1,
    "standard_nc64as_t4_v3": 4,
    # NCv3: Tesla V100
    "standard_nc6s_v3": 1, "standard_nc12s_v3": 2, "standard_nc24s_v3": 4,
    "standard_nc24rs_v3": 4,
    # NDv2: 8x V100
    "standard_nd40rs_v2": 8,
    # NC A100 v4: A100 PCIe 80GB
    "standard_nc24ads_a100_v4": 1, "standard_nc48ads_a100_v4": 2,
    "standard_nc96ads_a100_v4": 4,
    # NDasrA100_v4 and NDm A100 v4: 8x A100 (40 and 80 GB)
    "standard_nd96asr_a100_v4": 8, "standard_nd96amsr_a100_v4": 8,
    # NC A10 v4
    "standard_nc8ads_a10_v4": 1, "standard_nc16ads_a10_v4": 1, "standard_nc32ads_a10_v4": 2,
    # NCads H100 v5 and the confidential NCCads H100 v5: H100 NVL 94GB
    "standard_nc40ads_h100_v5": 1, "standard_nc80adis_h100_v5": 2,
    "standard_ncc40ads_h100_v5": 1,
    # ND H100 v5: 8x H100
    "standard_nd96isr_h100_v5": 8,
    # NVadsA10_v5: A10 partitions (one vGPU device each) and whole A10s
    "standard_nv6ads_a10_v5": 1, "standard_nv12ads_a10_v5": 1, "standard_nv18ads_a10_v5": 1,
    "standard_nv36ads_a10_v5": 1, "standard_nv36adms_a10_v5": 1, "standard_nv72ads_a10_v5": 2,
}


@dataclass(frozen=True)
class Claim:
    """The VM size says the node has `gpus` GPUs (`size` as the metadata spells it)."""

    size: str
    gpus: int
    source: str  # "/run/metadata/flatcar (COREOS_AZURE_VMSIZE)"


def gpus_of(size: str) -> int | None:
    """The GPU count of an Azure VM size, None for a size the table does not have (pure)."""
    return GPUS.get(size.strip().lower())


def claim(host: Host) -> Claim | None:
    """What the VM size says, None when nothing can be claimed (not Azure, no metadata file,
    a size the table lacks). A file that cannot be read (a FIFO, garbage) is logged once and
    makes no claim: the boot record's count still stands."""
    if _read(host, DMI_VENDOR, 4096).strip() != AZURE_VENDOR:
        return None
    for path, key in METADATA:
        text = _read(host, path, METADATA_LIMIT)
        size = envfile.values(text).get(key) if text else None
        if size is None:
            continue
        source = f"{path} ({key})"  # the node's path: it goes into the Node's condition
        if not _SIZE.fullmatch(size):
            log.get().warning("watch.vm_size_unusable", file=source, value=size[:80],
                              note="not an Azure VM size name: no GPU count is claimed")
            return None
        count = gpus_of(size)
        if count is None:
            log.get().debug("watch.vm_size_unknown", size=size, file=source,
                            note="a size gpunode's table does not have: no GPU count claimed")
            return None
        return Claim(size, count, source)
    return None


def _read(host: Host, path: str, limit: int) -> str:
    try:
        return host.read_optional(path, limit=limit, errors="replace") or ""
    except GpunodeError as exc:
        log.get().warning("watch.vm_size_unreadable", error=str(exc),
                          note="no GPU count is claimed from the VM size")
        return ""
