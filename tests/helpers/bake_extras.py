"""Inputs of the optional bake artifacts, shared by tests/unit/test_bake_extras.py and
tests/hostile/test_bake_optional.py: a stand-in toolkit sysext, prebuilt module set archives
(good and hostile), the fixture image's kernel, and the bake config sections naming them."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

from gpunode_testing import fixtures
from gpunode_testing.driver_files import ELF64_LIBRARY
from helpers.bake import Inputs, sha512

TOOLKIT_FILE = "nvidia-runtime-v1.17.5-x86-64.raw"
TOOLKIT_PATH = f"opt/extensions/nvidia-runtime/{TOOLKIT_FILE}"
KERNEL = fixtures.KERNEL  # the fixture node's running kernel: the image's, once listed
T4 = fixtures.MACHINES["nc4as-t4-v3"]
PREBUILT_DIR = f"opt/nvidia/modules/{KERNEL}"  # driver.prebuilt_dirs' default, the kernel


def image_kernel(root: Path, kernel: str = KERNEL) -> None:
    """The image's one kernel tree, as image bake reads it (/usr/lib/modules/<release>)."""
    (root / f"usr/lib/modules/{kernel}").mkdir(parents=True, exist_ok=True)
    (root / f"usr/lib/modules/{kernel}/modules.dep").write_text("")


def module_set(version: str = T4.driver_version) -> dict[str, bytes]:
    """A prebuilt set's files (its archive's members): modules, user-space of `version`."""
    return {"nvidia.ko": b"\x7fELF nvidia\n", "nvidia-uvm.ko": b"\x7fELF nvidia-uvm\n",
            "nvidia-modeset.ko": b"\x7fELF nvidia-modeset\n",
            f"lib/libcuda.so.{version}": ELF64_LIBRARY + b"cuda",
            f"lib/libnvidia-ml.so.{version}": ELF64_LIBRARY + b"nvml",
            "bin/nvidia-smi": b"#!/bin/sh\necho stand-in\n"}


def tar_bytes(files: dict[str, bytes], extra: list[tarfile.TarInfo] | None = None,
              mode: str = "w:gz") -> bytes:
    """A tar archive of `files` (bin/ executable), then the `extra` members as given. The same
    arguments give the same bytes: gzip's header carries no time (tarfile's "w:gz" would write
    the current second, so two calls could differ and a bake see a changed input)."""
    if mode == "w:gz":
        return gzip.compress(tar_bytes(files, extra, "w"), mtime=0)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.startswith("bin/") else 0o644
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info, io.BytesIO(b"\0" * info.size) if info.isreg() else None)
    return out.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0,
           linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, linkname
    return info


def toolkit_section(inputs: Inputs, data: bytes = b"hsqs nvidia-runtime stand-in\n" * 300,
                    file: str = TOOLKIT_FILE, sha: str | None = None) -> str:
    inputs.add(file, data)
    return f'\n[toolkit]\nsource = "{file}"\nsha512 = "{sha or sha512(data)}"\n'


def prebuilt_section(inputs: Inputs, data: bytes | None = None, file: str = "set.tar.gz",
                     kernel: str | None = None, sha: str | None = None) -> str:
    data = tar_bytes(module_set()) if data is None else data
    inputs.add(file, data)
    named = f'kernel = "{kernel}"\n' if kernel else ""
    return (f'\n[[prebuilt]]\n{named}source = "{file}"\n'
            f'sha512 = "{sha or sha512(data)}"\n')
