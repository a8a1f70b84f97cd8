"""Whether the modules about to load can be loaded here, decided before anything is loaded.

The driver step (driver/step.py) hands over the module files a strategy would load: a
directory's (prebuilt, a build's cache entry: insmod by path) or the kernel tree's (a merged
driver sysext: modprobe by name, where its files are there to read). Each is refused by name
when its .modinfo does not fit (driver/modinfo.py: the running kernel, the GPUs' flavour, the
driver version of its source), when no user-space of its version is on the node
(driver/userspace.py), or when the kernel would not find the firmware it names
(driver/firmware.py, which also says what firmware search path they need). The .modinfo is
read by the Kmod adapter (driver/modules.py: the real `modinfo`).
"""

from __future__ import annotations

import dataclasses

from gpunode import log
from gpunode.config import DriverConfig
from gpunode.driver import firmware, flavour, modinfo, modules, userspace
from gpunode.errors import CommandFailed, DriverError, ModuleRefused
from gpunode.gpu.detect import loaded_modules
from gpunode.platform import kernelinfo
from gpunode.platform.host import Host


def directory_load(host: Host, directory: str, wanted: tuple[str, ...], config: DriverConfig,
                   kmod: modules.Kmod, *, needs: list[flavour.Need], claimed: str | None = None,
                   version: str | None = None, firmware_dir: str | None = None
                   ) -> tuple[modules.LoadPlan, modinfo.Fit | None, firmware.FirmwarePath | None]:
    """insmod steps for a directory of modules, after modprobe of their kernel dependencies,
    once the modules about to load are found fit (check_modules)."""
    files = modules.module_files(host, directory)
    _require(files, wanted, directory)
    infos = read_modinfo(host, {m: files[m] for m in wanted}, kmod, directory)
    loaded = loaded_modules(host)
    load = modules.directory_plan(list(wanted), files, {m: list(i.depends) for m, i in
                                                       infos.items()},
                                  config.module_params, loaded)
    fit, fw = check_modules(host, config, infos, load, needs, claimed=claimed, version=version,
                            firmware_dir=firmware_dir or f"{directory}/firmware")
    return load, fit, fw


def check_tree(host: Host, config: DriverConfig, kernel: str, needs: list[flavour.Need],
               load: modules.LoadPlan, kmod: modules.Kmod,
               sysext: str) -> tuple[modinfo.Fit | None, firmware.FirmwarePath | None]:
    """The checks of check_modules for the modules a driver sysext merged into the kernel's
    tree, where they are files gpunode can read (modprobe finds them by name)."""
    files = modules.tree_files(host, kernel)
    wanted = {s.module: files[s.module] for s in load.steps if s.module in files}
    if not wanted:
        if load.steps:
            log.get().info("driver.modules_unchecked", sysext=sysext, reason="no module file "
                           f"in {', '.join(modules.MODULE_DIRS)}/{kernel}/"
                           f"{{{','.join(modules.TREE_SUBDIRS)}}}")
        return None, None
    infos = read_modinfo(host, wanted, kmod, f"the sysext {sysext}")
    claimed = "open" if sysext.endswith("-open") else "proprietary"
    return check_modules(host, config, infos, load, needs, claimed=claimed)


def read_modinfo(host: Host, files: dict[str, str], kmod: modules.Kmod,
                 where: str) -> dict[str, modinfo.ModuleInfo]:
    """module name → its .modinfo (paths as host paths), read by the Kmod adapter."""
    real = {m: host.real(p) for m, p in files.items()}
    try:
        found = kmod.modinfo(list(real.values()))
    except CommandFailed as exc:
        raise DriverError(f"cannot read the module information in {where}: {exc}",
                          "are these kernel modules?") from exc
    return {m: dataclasses.replace(found[real[m]], path=files[m]) for m in files}


def check_modules(host: Host, config: DriverConfig, infos: dict[str, modinfo.ModuleInfo],
                  load: modules.LoadPlan, needs: list[flavour.Need], *,
                  claimed: str | None = None, version: str | None = None,
                  firmware_dir: str | None = None
                  ) -> tuple[modinfo.Fit | None, firmware.FirmwarePath | None]:
    """Refuse, before anything loads, modules that do not fit (driver/modinfo.py: kernel,
    flavour, version), whose version has no user-space here, or whose firmware the kernel
    would not find; the Fit, and the firmware search path they need."""
    kernel = kernelinfo.release(host)
    to_load = {s.module for s in load.steps}
    checked = {m: i for m, i in infos.items() if m in to_load}
    if not checked:
        return None, None
    fit = modinfo.check(checked, kernel, needs, config.flavour, claimed, version)
    if fit is not None:
        try:
            userspace.find(host, fit.version, prebuilt_dirs=config.prebuilt_dirs)
        except DriverError as exc:
            said = str(exc).removeprefix(f"NVIDIA {fit.version} is loaded, but ")
            raise ModuleRefused(checked["nvidia"].path, "version", fit.version, f"and {said}",
                                "ship the modules with the user-space of the same driver "
                                "version") from exc
    family = fit.flavour if fit else None
    fw = firmware.plan(host, checked.values(), firmware_dir, kernel,
                       optional=family is not None and gsp_off(config, family))
    return fit, fw


def gsp_off(config: DriverConfig, chosen: str) -> bool:
    """The proprietary modules told to run without GSP firmware (the open ones cannot)."""
    return chosen != "open" and firmware.GSP_OFF in modules.params(config.module_params,
                                                                    "nvidia")


def _require(files: dict[str, str], wanted: tuple[str, ...], directory: str) -> None:
    missing = [m for m in wanted if m not in files]
    if missing:
        raise DriverError(f"{directory} has no module file for {', '.join(missing)}",
                          "ship all of nvidia, nvidia_uvm and nvidia_modeset (plus the "
                          "configured extra modules) together")
