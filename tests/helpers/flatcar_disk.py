"""A small disk image in the layout of flatcar_production_image.bin, for the mounted-image
pipeline's test (tests/integration/test_image_pipeline.py).

Flatcar's layout (flatcar/scripts build_library/disk_layout.json, "base"): GPT partition 3 is
USR-A (the read-only /usr; btrfs in current releases), 9 is ROOT (ext4, mounted on /), the
others (EFI-SYSTEM, BIOS-BOOT, USR-B, OEM, ...) are not needed to bake. Here 3 and 9 are ext4
file systems made by `mke2fs -d` from directories, and the GPT is written by `gpt` below (the
format of UEFI 2.x, section 5.3: protective MBR, header and entry array with their CRC32s at
the start, a backup at the end), so the test needs no partitioning tool. The partition type
is Linux's generic data type for both (Flatcar uses its own type GUIDs; the kernel and blkid
do not care).
"""

from __future__ import annotations

import struct
import subprocess
import uuid
import zlib
from pathlib import Path

SECTOR = 512
ENTRIES = 128
ENTRY_SIZE = 128
LINUX_DATA = uuid.UUID("0fc63daf-8483-4772-8e79-3d69d8477de4")
USR_A, ROOT = 3, 9  # disk_layout.json's partition numbers
LABELS = {USR_A: "USR-A", ROOT: "ROOT"}


def filesystem(tree: Path, image: Path, label: str, mib: int) -> Path:
    """An ext4 image of `mib` MiB holding `tree` (mke2fs -d: no mount needed)."""
    subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-L", label, "-d", str(tree),
                    str(image), f"{mib}M"], check=True, capture_output=True, timeout=60)
    return image


Layout = dict[int, tuple[int, int]]  # partition number → (first LBA, sectors)


def gpt(partitions: dict[int, tuple[str, bytes]], disk_guid: uuid.UUID
        ) -> tuple[bytes, bytes, int, Layout]:
    """(head, tail, sectors, layout): the bytes before the first partition (MBR, header,
    entries), the backup entries and header at the end, the disk's size in sectors, and where
    each partition lies, for `partitions`: number → (name, file system bytes), laid out in
    number order from LBA 2048 (1 MiB aligned, as Flatcar aligns them)."""
    entry_sectors = ENTRIES * ENTRY_SIZE // SECTOR
    lba = 2048
    entries = bytearray(ENTRIES * ENTRY_SIZE)
    layout: Layout = {}
    for number in sorted(partitions):
        name, data = partitions[number]
        sectors = -(-len(data) // SECTOR)
        layout[number] = (lba, sectors)
        entry = struct.pack("<16s16sQQQ72s", LINUX_DATA.bytes_le,
                            uuid.uuid5(disk_guid, name).bytes_le, lba, lba + sectors - 1, 0,
                            name.encode("utf-16-le"))
        entries[(number - 1) * ENTRY_SIZE:number * ENTRY_SIZE] = entry
        lba += -(-sectors // 2048) * 2048
    total = lba + entry_sectors + 1
    entries_crc = zlib.crc32(entries)

    def header(current: int, backup: int, entries_at: int) -> bytes:
        fields = [b"EFI PART", 0x00010000, 92, 0, 0, current, backup, 2048,
                  total - entry_sectors - 2, disk_guid.bytes_le, entries_at, ENTRIES,
                  ENTRY_SIZE, entries_crc]
        packed = struct.pack("<8sIIIIQQQQ16sQIII", *fields)
        fields[3] = zlib.crc32(packed)
        return struct.pack("<8sIIIIQQQQ16sQIII", *fields).ljust(SECTOR, b"\0")

    mbr = bytearray(SECTOR)  # protective MBR: one partition of type 0xEE over the disk
    mbr[446:462] = struct.pack("<B3sB3sII", 0, b"\x00\x02\x00", 0xEE, b"\xff\xff\xff", 1,
                               min(total - 1, 0xFFFFFFFF))
    mbr[510:512] = b"\x55\xaa"
    head = bytes(mbr) + header(1, total - 1, 2) + bytes(entries)
    tail = bytes(entries) + header(total - 1, 1, total - 1 - entry_sectors)
    return head, tail, total, layout


def disk(path: Path, partitions: dict[int, tuple[str, Path]]) -> Layout:
    """Write the disk image `path` from file system images (number → (name, image))."""
    data = {n: (name, fs.read_bytes()) for n, (name, fs) in partitions.items()}
    head, tail, total, layout = gpt(data, uuid.UUID("00000000-0000-0000-0000-000000000001"))
    with path.open("wb") as out:
        out.truncate(total * SECTOR)
        out.write(head)
        for number, (first, _) in layout.items():
            out.seek(first * SECTOR)
            out.write(data[number][1])
        out.seek((total - len(tail) // SECTOR) * SECTOR)
        out.write(tail)
    return layout


def partition_bytes(path: Path, layout: Layout, number: int) -> bytes:
    first, sectors = layout[number]
    with path.open("rb") as f:
        f.seek(first * SECTOR)
        return f.read(sectors * SECTOR)
