"""The kmod tools and systemd-sysext as the driver step's Kmod adapter sees them, for fixture
hosts: loading nvidia makes the fixture's /proc show a loaded driver (fixtures.load_driver), a
module named in `fail` fails as the kernel refuses it, and `systemd-sysext refresh` does what
it would — each sysext linked from /run/extensions gets its release file under /usr — unless
`merge` is False or `refresh_error` says how it fails. No module can be loaded and no
extension merged here; tests/integration has the real tools (test_kmod_tree.py) and a real
systemd-sysext merge (test_sysext.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpunode.driver import step
from gpunode.errors import CommandFailed
from gpunode_testing import fixtures


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

    def depends(self, path: str) -> list[str]:
        name = Path(path).name.split(".ko")[0].replace("-", "_")
        return self.deps[name]

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
