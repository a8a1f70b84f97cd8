"""Loading the NVIDIA modules: the order, the parameters, and the kmod tools that do it.

Modules from the running kernel's tree (the Flatcar sysext merges them into /usr/lib/modules)
are loaded with `modprobe`, which resolves dependencies itself. Modules from a directory
(prebuilt or a cached build) are loaded with `insmod` by path, nvidia first, after `modprobe`
of the kernel modules each one depends on (their .modinfo `depends`, driver/modinfo.py). No
shell anywhere; a failure keeps the tool's stderr and the kernel's last NVRM lines.
"""

from __future__ import annotations

import shlex
import stat
from dataclasses import dataclass, field
from typing import Protocol

from gpunode.config import DRIVER_MODULES, EXTRA_MODULES
from gpunode.driver import modinfo
from gpunode.driver.modinfo import ModuleInfo
from gpunode.errors import CommandFailed, HostError, LoadError
from gpunode.platform import command
from gpunode.platform.host import Host

ORDER = DRIVER_MODULES
BASE_MODULES = tuple(m for m in ORDER if m not in EXTRA_MODULES)


@dataclass(frozen=True)
class LoadStep:
    """One tool call: argv without the program, for the plan, the log and the tests."""

    module: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class LoadPlan:
    """The tool calls that load the NVIDIA modules not loaded yet, in order (none when all are)."""

    steps: tuple[LoadStep, ...] = field(default=())

    def describe(self) -> list[str]:
        return [" ".join(s.argv) for s in self.steps]


def wanted(extra: tuple[str, ...]) -> list[str]:
    return [m for m in ORDER if m in BASE_MODULES or m in extra]


def params(module_params: dict[str, str], module: str) -> list[str]:
    return shlex.split(module_params.get(module, ""))


def modprobe_plan(modules: list[str], module_params: dict[str, str],
                  loaded: set[str]) -> LoadPlan:
    """Modules from the kernel's own tree: modprobe each one that is not loaded yet."""
    return LoadPlan(tuple(LoadStep(m, ("modprobe", m, *params(module_params, m)))
                          for m in modules if m not in loaded))


def directory_plan(modules: list[str], files: dict[str, str], depends: dict[str, list[str]],
                   module_params: dict[str, str], loaded: set[str]) -> LoadPlan:
    """Modules from a directory: kernel dependencies by modprobe, then insmod by path."""
    steps: list[LoadStep] = []
    done = set(loaded)
    for module in modules:
        if module in done:
            continue
        for dep in depends.get(module, []):
            if dep not in done and dep not in files:
                steps.append(LoadStep(dep, ("modprobe", dep)))
                done.add(dep)
        steps.append(LoadStep(module, ("insmod", files[module], *params(module_params, module))))
        done.add(module)
    return LoadPlan(tuple(steps))


# Where a kernel's tree keeps modules that are not its own: Flatcar's driver sysext and its
# nvidia.service (`video`, as the ebuild's linux-mod-r1 installs them), kbuild's default for
# external modules (`extra`), DKMS (`updates/dkms`) and `updates`.
TREE_SUBDIRS = ("video", "extra", "updates")
MODULE_DIRS = ("/usr/lib/modules", "/lib/modules")


def tree_files(host: Host, kernel: str) -> dict[str, str]:
    """module name → host path of the NVIDIA .ko files in the running kernel's own tree (a
    merged driver sysext puts them there); empty when none is a file gpunode can read."""
    found: dict[str, str] = {}
    for base in MODULE_DIRS:
        for sub in TREE_SUBDIRS:
            for name, path in module_files(host, f"{base}/{kernel}/{sub}").items():
                if name.startswith("nvidia"):
                    found.setdefault(name, path)
    return found


def module_files(host: Host, directory: str) -> dict[str, str]:
    """module name → host path of its .ko under `directory` (nvidia-uvm.ko is nvidia_uvm)."""
    found: dict[str, str] = {}
    for entry in host.list_dir(directory):
        path = f"{directory}/{entry}"
        if entry.endswith((".ko", ".ko.xz", ".ko.zst")):
            found.setdefault(entry.split(".ko")[0].replace("-", "_"), path)
            continue
        st = host.stat(path)
        if st is not None and stat.S_ISDIR(st.st_mode):
            for name, sub in module_files(host, path).items():
                found.setdefault(name, sub)
    return found


class Kmod(Protocol):
    def modinfo(self, paths: list[str]) -> dict[str, ModuleInfo]:
        """Each module file's .modinfo, by the (real) path asked for."""
        ...

    def run(self, argv: tuple[str, ...]) -> None: ...


@dataclass(frozen=True)
class KmodTools:
    """The real kmod tools (`modinfo`, `modprobe`, `insmod`); paths are real file paths.

    `may_load` is false under --root: the tree's modules are not for the kernel this machine
    runs, so reading them is fine and loading them is refused."""

    may_load: bool = True
    timeout: float = 120.0

    def modinfo(self, paths: list[str]) -> dict[str, ModuleInfo]:
        """One `modinfo -0` for all files; each answer must be for the file asked (modinfo
        takes a path it cannot read for a module name of the running kernel)."""
        if not paths:
            return {}
        blocks = modinfo.parse(command.run(["modinfo", "-0", *paths], 30))
        named = [b.get("filename", [""])[0] for b in blocks]
        if named != list(paths):
            raise CommandFailed(["modinfo", "-0", *paths], 0,
                                f"answered for {named}, not for the files asked")
        return {path: modinfo.from_fields(path, block) for path, block in zip(paths, blocks,
                                                                                strict=True)}

    def run(self, argv: tuple[str, ...]) -> None:
        if not self.may_load:
            what = ("extensions are not merged" if argv[0] == "systemd-sysext" else
                    "modules are not loaded")
            raise CommandFailed(argv, None, f"{what} under --root: the tree's kernel is not "
                                "the one this machine runs")
        command.run(list(argv), self.timeout)


def execute(host: Host, plan: LoadPlan, kmod: Kmod) -> list[str]:
    """Run each step; the modules actually loaded, in order. Stops at the first failure."""
    done: list[str] = []
    for step in plan.steps:
        argv = step.argv
        if argv[0] == "insmod":  # a host path: the tool needs the real one
            argv = (argv[0], host.real(argv[1]), *argv[2:])
        try:
            kmod.run(argv)
        except CommandFailed as exc:
            raise LoadError(step.module, exc.stderr.strip() or str(exc),
                            nvrm_lines(host)) from exc
        done.append(step.module)
    return done


def nvrm_lines(host: Host, limit: int = 8) -> list[str]:
    """The kernel's last NVRM messages: /dev/kmsg records (or a plain file under --root).
    Best effort: they only add to a load failure's message, so an unreadable log gives none."""
    try:
        records = host.read_records("/dev/kmsg")
    except HostError:
        return []
    messages = [r.split(";", 1)[-1].strip() for r in records]
    return [m for m in messages if "NVRM" in m][-limit:]
