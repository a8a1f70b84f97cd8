"""The driver build's test doubles and inputs, shared by tests/unit/test_driver_build.py and
tests/integration/test_driver_build_real.py: a fixture node with a download mirror inside its
root, the build inputs that point at that mirror, and a fake compiler that writes fake .ko
files, counts its calls, and can crash half-way or hold the build."""

from __future__ import annotations

import bz2
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from conftest import HostFactory
from gpunode.driver import build as b
from gpunode.platform.host import Host
from gpunode_testing.driver_files import write_build_userspace

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
    """Writes fake modules and the user-space build.sh extracts (for the version its
    userspace.list names; `userspace=False`: none); `crash` raises after the first module,
    `sleep` holds the build, `extra(out_dir)` changes what it left (a hostile build)."""

    modules: tuple[str, ...] = MODULES
    userspace: bool = True
    extra: Callable[[Path], None] | None = None
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
            if self.userspace:
                write_build_userspace(out_dir, wanted_version(workdir))
            if self.extra is not None:
                self.extra(out_dir)
        finally:
            self.running -= 1


BUILD_SH = Path(b.__file__).with_name("build.sh")


def wanted_version(workdir: Path) -> str:
    """The driver version in the userspace.list build.py wrote for build.sh."""
    first = (workdir / b.WANTED_LIST).read_text().splitlines()[0]
    assert first.startswith("version "), first
    return first.removeprefix("version ")


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


# -- a node whose driver comes from a build ------------------------------------------------------


def strip_system_userspace(root: Path) -> None:
    """Remove the sysext-layout user-space the fixture's loaded driver has (driver_files): a
    built node has only what its cache entry holds."""
    import shutil

    from gpunode_testing import driver_files

    for path in (root / "usr/lib64").glob("lib*"):
        if path.name.startswith(tuple(driver_files.LIBRARIES)):
            path.unlink()
    for name in driver_files.BINARIES:
        (root / "usr/bin" / name).unlink(missing_ok=True)
    shutil.rmtree(root / "lib/firmware/nvidia", ignore_errors=True)


@dataclass
class BuiltKernel:
    """Records kmod calls; loading nvidia makes the fixture's /proc show the loaded driver, as
    a built node has it: no user-space outside the cache entry."""

    root: Path
    machine: object
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def modinfo(self, paths: list[str]) -> dict[str, Any]:
        from helpers.fake_kernel import stand_in_modinfo

        deps = {"nvidia_uvm": ["nvidia"], "nvidia_modeset": ["nvidia"]}
        return {p: stand_in_modinfo(self.root, self.machine, p, deps)  # type: ignore[arg-type]
                for p in paths}

    def run(self, argv: tuple[str, ...]) -> None:
        from gpunode_testing import fixtures

        self.calls.append(argv)
        if Path(argv[1]).name == "nvidia.ko":
            fixtures.load_driver(self.root, self.machine)  # type: ignore[arg-type]
            strip_system_userspace(self.root)


def build_config(host: Host, version: str) -> object:
    """driver.build enabled, downloading from a mirror inside the node's root."""
    from gpunode.config import BuildConfig, DriverConfig

    mirror = host.root / "srv/mirror"
    mirror.mkdir(parents=True, exist_ok=True)
    (mirror / "dev.bin.bz2").write_bytes(bz2.compress(IMAGE))
    (mirror / "driver.run").write_bytes(INSTALLER)
    return DriverConfig(version=version, build=BuildConfig(
        enabled=True, dev_container_url="file:///srv/mirror/dev.bin.bz2",
        dev_container_sha512=sha(bz2.compress(IMAGE), "sha512"),
        driver_url="/srv/mirror/driver.run", driver_sha256=sha(INSTALLER, "sha256")))


def write_build_setup(root: Path, version: str, installer: bytes, image: bytes,
                      command: list[str] | None = None) -> None:
    """A node's mirror (the installer, the developer container) inside `root` and the agent
    config of `gpunode driver build` from it, as a file: driver.build enabled, both pinned."""
    import json

    mirror = root / "srv/mirror"
    mirror.mkdir(parents=True, exist_ok=True)
    (mirror / "driver.run").write_bytes(installer)
    (mirror / "dev.bin").write_bytes(image)
    lines = ["[driver]", f'version = "{version}"', "", "[driver.build]", "enabled = true",
             'dev_container_url = "/srv/mirror/dev.bin"',
             f'dev_container_sha512 = "{sha(image, "sha512")}"',
             'driver_url = "/srv/mirror/driver.run"',
             f'driver_sha256 = "{sha(installer, "sha256")}"']
    if command is not None:
        lines.append(f"command = {json.dumps(command)}")
    (root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (root / "etc/gpunode/config.toml").write_text("\n".join(lines) + "\n")


# -- an installer for the real build.sh ----------------------------------------------------------

KERNEL_MAKEFILE = """\
# stand-in for the driver's kbuild: `make modules` compiles objects that look like the modules
modules:
\tsh ./stand-in-modules.sh "$(SYSSRC)" "$(SYSOUT)"
"""

# Compiles each module as a relocatable ELF object with debug info (-g: strip has something to
# remove) and a .modinfo of NUL-separated key=value strings, as modpost writes it: vermagic
# from the output tree as kbuild takes it (UTS_RELEASE, else kernel.release), the flavour's
# license, the version, nvidia's GSP firmware, and the trees it was given (syssrc, sysout).
STAND_IN_MODULES = r"""#!/bin/sh
set -e
utsrelease="$2/include/generated/utsrelease.h"
release=""
if [ -f "$utsrelease" ]; then
  release=$(sed -n 's/^#define UTS_RELEASE "\(.*\)"$/\1/p' "$utsrelease")
fi
[ -n "$release" ] || release=$(cat "$2/include/config/kernel.release")
for m in nvidia nvidia-uvm nvidia-modeset; do
  name=$(echo "$m" | tr - _)
  firmware=""
  if [ "$m" = nvidia ]; then
    firmware='firmware=nvidia/@VERSION@/gsp_ga10x.bin\0firmware=nvidia/@VERSION@/gsp_tu10x.bin\0'
  fi
  cat >"$m.c" <<EOF
static const char modinfo[] __attribute__((section(".modinfo"), used)) =
  "vermagic=$release SMP mod_unload \0license=@LICENSE@\0version=@VERSION@\0name=$name\0"
  "${firmware}syssrc=$1\0sysout=$2";
int stand_in_$name;
EOF
  gcc -g -c -o "$m.ko" "$m.c"
done
"""


def fake_installer(tmp: Path, version: str,
                   mutate: Callable[[Path], None] | None = None) -> bytes:
    """An NVIDIA installer stand-in for build.sh: a shell script that, given --extract-only,
    unpacks NVIDIA-Linux-x86_64-<version>/ into the current directory, laid out as the real
    one (gpunode/driver/extracted.py cites the layout): the 64-bit libraries at the top (real
    shared objects with their SONAMEs, made by gcc, so `ldconfig -n` links them), 32-bit
    copies in 32/, a library gpunode does not take, the binaries, firmware/gsp_*.bin, and
    kernel/ and kernel-open/ whose Makefile compiles stand-in modules (STAND_IN_MODULES).
    `mutate(tree)` changes the tree before it is packed (a hostile installer). gcc must be
    installed."""
    import base64
    import shutil
    import subprocess
    import tarfile

    from gpunode_testing import driver_files

    tree = tmp / "installer-tree" / f"NVIDIA-Linux-x86_64-{version}"
    (tree / "32").mkdir(parents=True)
    (tree / "firmware").mkdir()
    empty = tmp / "installer-tree" / "empty.c"
    empty.write_text("int nvidia_stand_in;\n")
    sonames = {**driver_files.LIBRARIES, "libnvidia-glcore": None}
    for name, suffix in sonames.items():
        file = f"{name}.so.{version}"
        soname = f"{name}.so.{suffix}" if suffix else file
        subprocess.run([shutil.which("gcc") or "gcc", "-shared", "-nostdlib",
                        f"-Wl,-soname,{soname}", "-o", str(tree / file), str(empty)],
                       check=True, timeout=60)
        (tree / "32" / file).write_bytes(b"\x7fELF\x01\x01\x01" + b"\0" * 9 + b"\x03\x00\x03\x00")
    for name in driver_files.BINARIES:
        (tree / name).write_text("#!/bin/sh\necho stand-in\n")
        (tree / name).chmod(0o755)
    for name in driver_files.OPEN_FIRMWARE:
        (tree / "firmware" / name).write_bytes(b"GSP firmware stand-in\n")
    for directory, license_ in (("kernel", "NVIDIA"), ("kernel-open", "Dual MIT/GPL")):
        (tree / directory).mkdir()
        (tree / directory / "Makefile").write_text(KERNEL_MAKEFILE)
        (tree / directory / "stand-in-modules.sh").write_text(
            STAND_IN_MODULES.replace("@VERSION@", version).replace("@LICENSE@", license_))
    if mutate is not None:
        mutate(tree)
    archive = tmp / "installer-tree" / "tree.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return (b"#!/bin/sh\n# stand-in NVIDIA installer: --extract-only unpacks the tree here\n"
            b"[ \"$1\" = --extract-only ] || exit 2\n"
            b"sed '1,/^__ARCHIVE__$/d' \"$0\" | base64 -d | tar -xzf -\nexit 0\n__ARCHIVE__\n"
            + base64.encodebytes(archive.read_bytes()))


def kernel_tree(root: Path, kernel: str) -> Path:
    """A prepared kernel build tree as build.sh looks for it, under `root`."""
    release = root / f"lib/modules/{kernel}/build/include/config/kernel.release"
    release.parent.mkdir(parents=True)
    release.write_text(kernel + "\n")
    return root


def split_kernel_tree(root: Path, kernel: str, upstream: str,
                      release: str | None = None) -> Path:
    """Kernel headers under `root` laid out as Debian's packages install them (and Ubuntu's,
    alike): /lib/modules/<kernel>/build and /source, absolute links to the configured output
    tree /usr/src/linux-headers-<kernel> and the source tree /usr/src/linux-headers-<abi>-common.
    Debian's output tree says the upstream version in include/config/kernel.release and the
    kernel's release (`release`, default `kernel`) in include/generated/utsrelease.h, which is
    what modules built against it carry (read in Debian's linux-headers-6.1.0-50-amd64)."""
    abi = kernel.rsplit("-", 1)[0]
    output = root / f"usr/src/linux-headers-{kernel}"
    source = root / f"usr/src/linux-headers-{abi}-common"
    (output / "include/config").mkdir(parents=True)
    (output / "include/generated").mkdir(parents=True)
    (output / "include/config/kernel.release").write_text(upstream + "\n")
    (output / "include/generated/utsrelease.h").write_text(
        f'#define UTS_RELEASE "{release or kernel}"\n')
    source.mkdir(parents=True)
    (source / "Makefile").write_text(f"VERSION = {upstream}\n")
    modlib = root / f"lib/modules/{kernel}"
    modlib.mkdir(parents=True)
    (modlib / "build").symlink_to(f"/usr/src/linux-headers-{kernel}")
    (modlib / "source").symlink_to(f"/usr/src/linux-headers-{abi}-common")
    return root


def build_sh_command(kernel_root: Path) -> list[str]:
    """driver.build.command running the real build.sh outside a container (build.sh's
    GPUNODE_BUILD_* variables), in the work dir NspawnBuilder writes it into."""
    return ["env", f"GPUNODE_BUILD_ROOT={kernel_root}", "GPUNODE_BUILD_WORK={workdir}",
            "GPUNODE_BUILD_OUT={out_dir}", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
            "bash", "{workdir}/build.sh", "{kernel}", "{flavour}"]
