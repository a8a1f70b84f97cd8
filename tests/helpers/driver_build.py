"""The driver build's test doubles and inputs, shared by tests/unit/test_driver_build.py and
tests/integration/test_driver_build_real.py: a fixture node with a download mirror inside its
root, the build inputs that point at that mirror, and a fake compiler that writes fake .ko
files, counts its calls, and can crash half-way or hold the build."""

from __future__ import annotations

import bz2
import hashlib
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from conftest import HostFactory
from gpunode.driver import build as b
from gpunode.host import Host

KERNEL = "6.6.95-flatcar"
DRIVER = "570.195.03"
IMAGE = b"fake developer container image\n" * 100
INSTALLER = b"#!/bin/sh\n# fake NVIDIA installer\n"
MODULES = ("nvidia.ko", "nvidia-uvm.ko", "nvidia-modeset.ko")
FACTS = b.FlatcarFacts(version="4459.2.1", board="amd64-usr", group="stable")
MIRROR = "/srv/mirror"


def sha(data: bytes, algorithm: str) -> str:
    return hashlib.new(algorithm, data).hexdigest()


@dataclass
class FakeBuilder:
    """Writes fake modules; `crash` raises after the first one, `sleep` holds the build."""

    modules: tuple[str, ...] = MODULES
    crash: bool = False
    sleep: float = 0.0
    calls: int = 0
    running: int = 0
    most_running: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    seen_image: bytes = b""

    def build(self, workdir: Path, dev_container: Path, driver_installer: Path, kernel: str,
              flavour: str, out_dir: Path) -> None:
        self.calls += 1
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self.started.set()
        try:
            self.seen_image = dev_container.read_bytes()
            time.sleep(self.sleep)
            for name in self.modules:
                (out_dir / name).write_bytes(b"\x7fELF " + f"{name} {kernel} {flavour}".encode())
                if self.crash:
                    raise RuntimeError("builder died half-way")
        finally:
            self.running -= 1


BUILD_SH = Path(b.__file__).with_name("build.sh")


def mirror_host(make_host: HostFactory) -> Host:
    """A Flatcar node (os-release from the fixture) with a download mirror under /srv/mirror."""
    host = make_host("nc4as-t4-v3", "bare", extra={
        "/proc/sys/kernel/osrelease": KERNEL + "\n",
        f"/lib/modules/{KERNEL}/modules.dep": "",
    })
    mirror = host.root / MIRROR.lstrip("/")
    (mirror / "amd64-usr/4459.2.1").mkdir(parents=True)
    (mirror / "amd64-usr/4459.2.1/flatcar_developer_container.bin.bz2").write_bytes(
        bz2.compress(IMAGE))
    (mirror / f"NVIDIA-Linux-x86_64-{DRIVER}.run").write_bytes(INSTALLER)
    return host


def inputs(**changes: object) -> b.BuildInputs:
    base = b.BuildInputs(
        kernel=KERNEL, driver=DRIVER, flavour="open",
        dev_container_url=f"file://{MIRROR}/{{board}}/{{version}}/"
                          "flatcar_developer_container.bin.bz2",
        dev_container_sha512=sha(bz2.compress(IMAGE), "sha512"),
        driver_url=f"{MIRROR}/NVIDIA-Linux-x86_64-{{driver}}.run",  # a plain path: a mirror
        driver_sha256=sha(INSTALLER, "sha256"))
    return replace(base, **changes)  # type: ignore[arg-type]
