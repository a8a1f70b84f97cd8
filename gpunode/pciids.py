"""Product names for NVIDIA PCI device ids: pci.ids when the host has it, else a small table.

Only the NVIDIA vendor block of pci.ids is scanned (the whole file is ~1.3 MB and parsing all
of it would cost more than the rest of detection).
"""

from __future__ import annotations

from gpunode.errors import HostError
from gpunode.host import Host
from gpunode.nodepaths import NVIDIA_VENDOR_ID

PCI_IDS_PATHS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids")

# Names as pci.ids spells them, for the GPUs gpunode is run on most; used when pci.ids is absent
# (Flatcar ships none) so that `detect` still says what the device is.
BUILTIN_NAMES: dict[str, str] = {
    "1db4": "GV100GL [Tesla V100 PCIe 16GB]",
    "1eb8": "TU104GL [Tesla T4]",
    "20b0": "GA100 [A100 SXM4 40GB]",
    "20b2": "GA100 [A100 SXM4 80GB]",
    "20b5": "GA100 [A100 PCIe 80GB]",
    "1af1": "GA100 [A100 NVSwitch]",
    "2236": "GA102GL [A10]",
    "2237": "GA102GL [A10G]",
    "27b8": "AD104GL [L4]",
    "26b9": "AD102GL [L40S]",
    "2321": "GH100 [H100 NVL]",
    "2330": "GH100 [H100 SXM5 80GB]",
    "2331": "GH100 [H100 PCIe]",
    "2335": "GH100 [H200 SXM 141GB]",
    "22a3": "GH100 [H100 NVSwitch]",
    "2901": "GB100 [B200]",
}


def nvidia_names(host: Host) -> tuple[dict[str, str], str]:
    """Device id → name, and where the names came from (a pci.ids path or "builtin")."""
    for path in PCI_IDS_PATHS:
        try:
            # Names only: a stray byte is replaced, and a file that is no file (a FIFO, a
            # directory) is passed over for the next one or the built-in table.
            text = host.read_optional(path, errors="replace")
        except HostError:
            continue
        if text is not None:
            names = parse_vendor_block(text, NVIDIA_VENDOR_ID)
            if names:
                return names, path
    return dict(BUILTIN_NAMES), "builtin"


def parse_vendor_block(text: str, vendor: str) -> dict[str, str]:
    """The device lines (one tab, id, two spaces, name) of one vendor in pci.ids text."""
    start = text.find(f"\n{vendor}  ")
    if start < 0:
        return {}
    names: dict[str, str] = {}
    pos = text.find("\n", start + 1)
    while pos >= 0:
        end = text.find("\n", pos + 1)
        line = text[pos + 1 : end if end >= 0 else len(text)]
        pos = end
        if line.startswith("\t\t") or line.startswith("#") or not line:
            continue  # subsystem lines and comments inside the block
        if not line.startswith("\t"):
            break  # the next vendor
        device, _, name = line[1:].partition("  ")
        names[device.lower()] = name.strip()
    return names
