"""The kmod tools and systemd-sysext as the driver step's Kmod adapter sees them, for fixture
hosts: loading nvidia makes the fixture's /proc show a loaded driver (fixtures.load_driver), a
module named in `fail` fails as the kernel refuses it, and `systemd-sysext refresh` does what
it would — each sysext linked from /run/extensions gets its release file under /usr — unless
`merge` is False or `refresh_error` says how it fails; `modinfo` answers what the stand-in
module files say (stand_in_module). No module can be loaded and no extension merged here;
tests/integration has the real tools on the real modules (test_driver_modules_real.py) and a
real systemd-sysext merge (test_sysext.py).

FakeGpus stands in for nvidia-persistenced and a GPU's first open (gpu/init.py's Initializer):
no GPU can be initialized here either."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpunode.driver import modinfo, step
from gpunode.driver.modinfo import ModuleInfo
from gpunode.errors import CommandFailed
from gpunode_testing import driver_files, fixtures

LICENSES = {"open": "Dual MIT/GPL", "proprietary": "NVIDIA", "grid": "NVIDIA"}


def stand_in_module(name: str, *, version: str, flavour: str = "proprietary",
                    kernel: str = fixtures.KERNEL, firmware: tuple[str, ...] = (),
                    depends: tuple[str, ...] = ()) -> bytes:
    """A stand-in .ko whose bytes carry a .modinfo's `key=value` strings, NUL-separated as
    modpost writes them, for the fake Kmod adapters below to read. A stand-in because the
    real modules exist for Debian's 6.1.0-50-amd64 only, and these tests need modules of the
    fixture's kernel, of any version and flavour; tests/integration/test_driver_modules_real.py
    reads the real ones with the real modinfo."""
    fields = [f"name={name.replace('-', '_')}", f"license={LICENSES[flavour]}",
              f"version={version}", *(f"firmware={f}" for f in firmware),
              *([f"depends={','.join(depends)}"] if depends else []),
              f"vermagic={kernel} SMP preempt mod_unload modversions "]
    return b"\x7fELF stand-in module\0" + "\0".join(fields).encode() + b"\0"


def stand_in_modinfo(root: Path, machine: fixtures.Machine, path: str,
                     deps: dict[str, list[str]] | None = None) -> ModuleInfo:
    """What a stand-in module says (stand_in_module's fields); what its bytes do not say is
    the fixture's: its running kernel, the machine's driver version and flavour, the GSP
    firmware for nvidia.ko of the open modules (the fixture writes GSP firmware for those
    only), and `deps`."""
    name = Path(path).name.split(".ko")[0].replace("-", "_")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CommandFailed(("modinfo", path), 1, f"modinfo: ERROR: {exc}") from exc
    fields: dict[str, list[str]] = {}
    for item in data.split(b"\0")[1:]:
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep:
            fields.setdefault(key, []).append(value)
    release = root / "proc/sys/kernel/osrelease"
    kernel = release.read_text().strip() if release.is_file() else fixtures.KERNEL
    flavour = "open" if machine.open_modules else "proprietary"
    firmware = [f"nvidia/{machine.driver_version}/{f}" for f in driver_files.OPEN_FIRMWARE]
    defaults = {"vermagic": [f"{kernel} SMP preempt mod_unload modversions "],
                "license": [LICENSES[flavour]], "version": [machine.driver_version],
                "firmware": firmware if name == "nvidia" and machine.open_modules else [],
                "depends": [",".join((deps or {}).get(name, []))]}
    return modinfo.from_fields(path, {**defaults, **fields})


@dataclass
class FakeKernel:
    """Records kmod and systemd-sysext calls (see the module docstring)."""

    root: Path
    machine: fixtures.Machine
    fail: str | None = None  # a module whose load fails
    calls: list[tuple[str, ...]] = field(default_factory=list)
    deps: dict[str, list[str]] = field(default_factory=lambda: {
        "nvidia_drm": ["drm", "drm_kms_helper", "nvidia_modeset"],
        "nvidia_modeset": ["nvidia"], "nvidia_uvm": ["nvidia"], "nvidia": []})
    merge: bool = True  # systemd-sysext refresh merges what /run/extensions links
    refresh_error: str | None = None  # or fails, saying this
    refreshes: list[list[str]] = field(default_factory=list)  # /run/extensions at each refresh

    def modinfo(self, paths: list[str]) -> dict[str, ModuleInfo]:
        return {p: stand_in_modinfo(self.root, self.machine, p, self.deps) for p in paths}

    def run(self, argv: tuple[str, ...]) -> None:
        self.calls.append(argv)
        if argv == step.SYSEXT_REFRESH:
            self._refresh(argv)
            return
        module = Path(argv[1]).name.split(".ko")[0].replace("-", "_")
        if module == self.fail:
            (self.root / "dev").mkdir(exist_ok=True)
            (self.root / "dev/kmsg").write_text(
                "3,100,5,-;NVRM: API mismatch: the client has the version 570.1\n"
                "6,101,6,-;usb 1-1: something else\n")
            raise CommandFailed(argv, 1, f"{argv[0]}: ERROR: could not insert '{module}': "
                                "Invalid argument\n")
        if module == "nvidia":
            fixtures.load_driver(self.root, self.machine)

    def _refresh(self, argv: tuple[str, ...]) -> None:
        if self.refresh_error:
            raise CommandFailed(argv, 1, self.refresh_error)
        linked = sorted(p.name for p in (self.root / "run/extensions").iterdir())
        self.refreshes.append(linked)
        if self.merge:
            for name in linked:
                release = (self.root / "usr/lib/extension-release.d" /
                           f"extension-release.{name.removesuffix('.raw')}")
                release.parent.mkdir(parents=True, exist_ok=True)
                release.write_text("ID=flatcar\n")


@dataclass
class FakeGpus:
    """gpu/init.py's Initializer on a fixture host: a stand-in for nvidia-persistenced and for
    the kernel's side of a GPU's first open, which gpunode cannot reach in a fixture tree.
    Starting persistenced writes its pid file and /proc entry (as the daemon's start leaves
    them) and initializes every GPU the fixture's driver lists; opening /dev/nvidiaN
    initializes that GPU (fixtures.initialize_gpu). A GPU in `fail` logs `RmInitAdapter
    failed!` to the fixture's /dev/kmsg instead (and its open fails with EIO); one in `hang`
    never comes up and says nothing."""

    root: Path
    machine: fixtures.Machine
    fail: tuple[str, ...] = ()
    hang: tuple[str, ...] = ()
    start_error: str | None = None  # starting persistenced fails, saying this
    pid: int = 4242
    may_act: bool = True
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def unit_state(self) -> str | None:
        return None  # no service manager: persistenced is found by its pid file

    def start_persistenced(self, binary: str, timeout: float) -> str:
        self.calls.append(("start", binary))
        if self.start_error is not None:
            raise CommandFailed(("systemd-run", binary), 1, self.start_error)
        run = self.root / "run/nvidia-persistenced"
        run.mkdir(parents=True, exist_ok=True)
        (run / "nvidia-persistenced.pid").write_text(f"{self.pid}\n")
        proc = self.root / f"proc/{self.pid}"
        proc.mkdir(parents=True, exist_ok=True)
        (proc / "comm").write_text("nvidia-persiste\n")
        for address in self._addresses():
            self._bring_up(address)
        return "started nvidia-persistenced.service (fixture stand-in)"

    def open_devices(self, paths: Sequence[str], timeout: float) -> dict[str, str]:
        minors = {minor: address for address, minor in self._minors().items()}
        failed = {}
        for path in paths:
            self.calls.append(("open", path))
            address = minors[int(path.removeprefix("/dev/nvidia"))]
            if not self._bring_up(address):
                failed[path] = "Input/output error"
        return failed

    def _bring_up(self, address: str) -> bool:
        if address in self.hang:
            return True  # the open returned; the GPU just never shows a UUID
        if address in self.fail:
            kmsg = self.root / "dev/kmsg"
            kmsg.parent.mkdir(parents=True, exist_ok=True)
            with kmsg.open("a") as log:
                log.write(f"3,{900 + len(self.calls)},{5000 + len(self.calls)},-;NVRM: GPU "
                          f"{address}: RmInitAdapter failed! (0x22:0x56:667)\n")
            return False
        fixtures.initialize_gpu(self.root, self.machine, address)
        return True

    def _addresses(self) -> list[str]:
        return sorted(p.name for p in (self.root / "proc/driver/nvidia/gpus").iterdir())

    def _minors(self) -> dict[str, int]:
        found = {}
        for address in self._addresses():
            info = (self.root / f"proc/driver/nvidia/gpus/{address}/information").read_text()
            found[address] = int(info.split("Device Minor:")[1].split()[0])
        return found
