"""Product names for NVIDIA PCI device ids: pci.ids when the host has it, else a small table.

Of pci.ids (~1.3 MB) only the NVIDIA vendor block is looked in, and in it only the lines of the
devices asked for (`VendorBlock`), not the whole file decoded and parsed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from gpunode.errors import HostError
from gpunode.platform.host import Host
from gpunode.platform.nodepaths import NVIDIA_VENDOR_ID

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


def nvidia_names(host: Host) -> tuple[Mapping[str, str], str]:
    """Device id → name, and where the names came from (a pci.ids path or "builtin")."""
    for path in PCI_IDS_PATHS:
        try:
            # A file that is no file (a FIFO, a directory, a link to nothing) is passed over
            # for the next one or the built-in table.
            data = host.read_optional_bytes(path)
        except HostError:
            continue
        if data is not None:
            names = VendorBlock.find(data, NVIDIA_VENDOR_ID)
            if names is not None:
                return names, path
    return dict(BUILTIN_NAMES), "builtin"


class VendorBlock(Mapping[str, str]):
    """One vendor's device lines of pci.ids (bytes), a device's line found when its id is
    asked for. Ids are pci.ids' lowercase hex; a name's stray bytes are replaced (names only)."""

    # The line after the vendor's block: the next vendor's (or a device class's), one that
    # starts with neither a tab (devices, subsystems), '#' (comments) nor is empty. Compiled
    # when a pci.ids is first read (re keeps them), not at every import: Flatcar has none.
    _END = rb"\n[^\t#\n]"
    _DEVICE = rb"\n\t(?!\t)"  # a device's line, not a subsystem's

    def __init__(self, block: bytes, vendor: str) -> None:
        self._block = block  # from the newline before the vendor's line to its block's end
        self._vendor = vendor

    @classmethod
    def find(cls, data: bytes, vendor: str) -> VendorBlock | None:
        """The vendor's block in pci.ids `data`; None when the vendor has no device in it."""
        start = data.find(f"\n{vendor}  ".encode())
        if start < 0:
            return None
        end = re.compile(cls._END).search(data, start + 1)
        block = data[start:end.start() if end else len(data)]
        return cls(block, vendor) if re.search(cls._DEVICE, block) else None

    def __getitem__(self, device: str) -> str:
        key = f"\n\t{device.lower()}  ".encode("utf-8", "replace")
        start = self._block.find(key)
        if start < 0:
            raise KeyError(device)
        end = self._block.find(b"\n", start + 1)
        line = self._block[start + len(key):end if end >= 0 else len(self._block)]
        return line.decode("utf-8", errors="replace").strip()

    def __iter__(self) -> Iterator[str]:
        return iter(self._parsed())

    def __len__(self) -> int:
        return len(self._parsed())

    def _parsed(self) -> dict[str, str]:
        return parse_vendor_block(self._block.decode("utf-8", errors="replace"), self._vendor)


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
