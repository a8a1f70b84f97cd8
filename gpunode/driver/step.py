"""The driver step: observe, plan (strategy, flavour, load steps), apply, create nodes, verify.

Whatever the strategy, the modules about to load are checked first (driver/loadable.py: their
.modinfo against the kernel, the GPUs and the user-space; the firmware they name), and the
flavour the step reports is theirs.

`plan()` reads the host and decides; `apply()` acts on the decision through a Kmod adapter
(real modprobe/insmod on a node; tests use a recording fake, since no module can be loaded
here) and the build adapters.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpunode import log
from gpunode.config import BuildConfig, DriverConfig
from gpunode.driver import (
    branches,
    devices,
    firmware,
    flavour,
    loadable,
    modinfo,
    modules,
    nouveau,
    strategy,
    userspace,
)
from gpunode.errors import CommandFailed, DriverError, GpunodeError
from gpunode.gpu import driverinfo
from gpunode.gpu.detect import Detection, PciFunction, loaded_modules
from gpunode.platform import flatcar, kernelinfo
from gpunode.platform.host import Host

if TYPE_CHECKING:
    from gpunode.driver.build import BuildInputs, BuildResult

# A baked driver sysext merged at boot: linked where systemd-sysext looks and gone at the next
# boot, which chooses again (the GPUs of a resized VM may be another generation).
RUN_EXTENSIONS = "/run/extensions"
SYSEXT_REFRESH = ("systemd-sysext", "refresh")


@dataclass(frozen=True)
class LazyBuildAdapters:
    """The driver build's (fetcher, builder), made when a build unpacks them: the builders'
    modules (urllib, the nspawn tooling) are not imported by a boot that builds nothing."""

    config: BuildConfig
    host: Host

    def __iter__(self) -> Iterator[Any]:
        from gpunode.driver import builders

        return iter(builders.default_adapters(self.config, self.host))


@dataclass(frozen=True)
class Plan:
    """What the driver step would do on this boot, decided from the host as it is."""

    kernel: str
    flavour: flavour.FlavourChoice
    choice: strategy.Choice
    modules: tuple[str, ...]
    load: modules.LoadPlan = field(default_factory=modules.LoadPlan)
    sysext_line: str | None = None  # to add to /etc/flatcar/enabled-sysext.conf
    gpu_addresses: tuple[str, ...] = ()  # GPUs the driver must see (not those on vfio-pci)
    needs: tuple[flavour.Need, ...] = ()  # what they need of the modules (driver/modinfo.py)
    node_fixes: tuple[str, ...] = ()  # device nodes a loaded driver lacks: "<path>: <why>"
    # the firmware search path the modules about to load need (firmware they name that the
    # kernel would not find elsewhere); a build's is decided once its modules exist
    firmware: firmware.FirmwarePath | None = None
    baked: str | None = None  # the baked driver sysext file to merge before loading
    # A "verify" plan's user-space of the loaded driver: apply merges, builds and loads
    # nothing that could change it, and takes it for its own when the version is the same.
    driver_root: userspace.DriverRoot | None = None

    @property
    def changed(self) -> bool:
        return (bool(self.load.steps) or self.choice.action in ("build", "activate")
                or self.sysext_line is not None or bool(self.node_fixes)
                or self.firmware is not None)

    def describe(self) -> list[str]:
        lines = [f"{self.choice.strategy}: {self.choice.reason} ({self.flavour.flavour} modules: "
                 f"{self.flavour.reason})"]
        if self.sysext_line:
            lines.append(f"add '{self.sysext_line}' to {flatcar.ENABLED_SYSEXT} (takes effect "
                         "at the next boot)")
        if self.baked is not None:
            name = str(self.choice.source).removeprefix("flatcar-")
            lines.append(f"link {sysext_link(name)} to {self.baked}, then run "
                         f"{' '.join(SYSEXT_REFRESH)}")
        if self.choice.action == "build":
            lines.append(f"build {', '.join(self.modules)} for {self.kernel}, then check and "
                         "load them")
        if self.choice.action == "activate":
            lines.append("check the merged sysext's modules (kernel, flavour, version, "
                         "firmware) before loading them")
        if self.firmware is not None:
            lines.append(self.firmware.describe())
        lines += [f"run {step}" for step in self.load.describe()]
        lines += [f"make {fix}" for fix in self.node_fixes]
        return lines


@dataclass(frozen=True)
class Outcome:
    """The driver the step left loaded and verified, and where it came from (its record fields)."""

    strategy: str
    flavour: str
    version: str | None
    loaded: tuple[str, ...]
    nodes: tuple[str, ...]
    source: str | None
    driver_root: userspace.DriverRoot | None = None  # where the loaded driver's user-space is

    def fields(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "flavour": self.flavour, "driver_version": self.version,
                "modules_loaded": list(self.loaded), "device_nodes": list(self.nodes),
                "source": self.source, "driver_root": (
                    userspace.record_fields(self.driver_root) if self.driver_root else None)}


# -- observation ---------------------------------------------------------------------------------


def merged_sysexts(host: Host) -> tuple[str, ...]:
    return tuple(entry.removeprefix("extension-release.")
                 for entry in host.list_dir(flatcar.EXTENSION_RELEASE_DIR)
                 if entry.startswith(flatcar.SYSEXT_PREFIX))


def prebuilt_dir(host: Host, dirs: tuple[str, ...], kernel: str) -> str | None:
    for base in dirs:
        directory = f"{base}/{kernel}"
        if "nvidia" in modules.module_files(host, directory):
            return directory
    return None


def on_azure(host: Host) -> bool:
    vendor = host.read_optional("/sys/class/dmi/id/sys_vendor") or ""
    return vendor.strip() == flavour.AZURE_VENDOR


def sysext_name(config: DriverConfig, chosen: str) -> str:
    if config.sysext:
        return config.sysext
    branch = config.version.split(".")[0]
    return f"nvidia-drivers-{branch}{'-open' if chosen == 'open' else ''}"


def sysext_link(name: str) -> str:
    return f"{RUN_EXTENSIONS}/flatcar-{name}.raw"


# -- plan ----------------------------------------------------------------------------------------


def plan(host: Host, config: DriverConfig, detection: Detection, kmod: modules.Kmod) -> Plan:
    if detection.nouveau_loaded:
        raise DriverError("the nouveau module is loaded and holds the GPUs; gpunode loads "
                          "nothing while it is", nouveau.BLACKLIST_HINT)
    from gpunode.driver import cache as driver_cache

    kernel = kernelinfo.release(host)
    chosen = flavour.choose(detection.gpus, config.flavour, on_azure(host))
    version = driverinfo.parse_version(host.read_optional(f"{driverinfo.PROC_NVIDIA}/version")
                                       or "")
    wanted = tuple(modules.wanted(config.extra_modules))
    loaded = loaded_modules(host)
    merged = merged_sysexts(host)
    shipped = prebuilt_dir(host, config.prebuilt_dirs, kernel)
    # Checking the cache hashes every module (tens of MB): only when it can matter.
    cache_matters = (config.strategy == "build" or (version is None and not merged and not shipped)
                     or (version is not None and not set(wanted) <= loaded))
    cache = (driver_cache.find_usable(host, kernel, config.version, chosen.flavour)
             if cache_matters else None)
    facts = strategy.DriverFacts(
        kernel=kernel,
        loaded_version=version.version if version else None,
        merged_sysexts=merged,
        prebuilt_dir=shipped,
        cache_entry=cache.path if cache else None,
        build_enabled=config.build.enabled,
    )
    if version is None and not merged and config.strategy in ("auto", "flatcar-sysext"):
        facts = dataclasses.replace(facts, **_baked_sysext(host, config, detection, chosen))
    choice = _baked(host, strategy.choose(config.strategy, facts))
    baked_path = facts.baked.baked.path if facts.baked and choice.action == "activate" else None
    sysext_line = (None if baked_path else _missing_sysext_line(host, config, chosen.flavour))
    if choice.action == "fail" and sysext_line is None:
        raise DriverError(choice.reason, choice.hint)
    needs = gpu_needs(host, detection)
    load = modules.LoadPlan()
    fit: modinfo.Fit | None = None
    fw = None
    if choice.action in ("load", "activate") and choice.strategy == "flatcar-sysext":
        load = modules.modprobe_plan(list(wanted), config.module_params, loaded)
        if choice.action == "load":
            fit, fw = loadable.check_tree(host, config, kernel, needs, load, kmod,
                                          str(choice.source))
    elif choice.action == "load" and choice.source:
        load, fit, fw = loadable.directory_load(host, choice.source, wanted, config, kmod,
                                                needs=needs,
                                                **_source_claims(choice, chosen, config))
    elif choice.action == "verify" and not set(wanted) <= loaded:
        # udev autoloads nvidia for the GPU, never nvidia_uvm: load what is missing from
        # where the loaded ones came from.
        directory = facts.prebuilt_dir or facts.cache_entry
        if directory and not facts.merged_sysexts:
            load, fit, fw = loadable.directory_load(host, directory, wanted, config, kmod,
                                                    needs=needs)
        else:
            load = modules.modprobe_plan(list(wanted), config.module_params, loaded)
            if facts.merged_sysexts:
                fit, fw = loadable.check_tree(host, config, kernel, needs, load, kmod,
                                              facts.merged_sysexts[0])
    found = None
    if version is not None:
        # The loaded driver's user-space: apply ends by finding it, so a plan that cannot is a
        # refusal now, not a surprise after the modules and nodes (a driver not loaded yet is
        # judged once it is).
        found = userspace.find(host, version.version, prebuilt_dirs=config.prebuilt_dirs)
    if choice.action == "build" and not loadable.gsp_off(config, chosen.flavour):
        # Refused now, not after the build, when the kernel's firmware search path is
        # someone else's; the built modules' own firmware is planned once they exist.
        fw = firmware.plan_build(host, driver_cache.entry_path(kernel, config.version,
                                                               chosen.flavour),
                                 config.version, kernel)
    if fit is not None:
        chosen = _reported(chosen, fit)
    elif version is not None and _family(version.flavour) != _family(chosen.flavour):
        chosen = flavour.FlavourChoice(version.flavour, f"the loaded driver's "
                                       f"({driverinfo.PROC_NVIDIA}/version)")
    node_fixes: tuple[str, ...] = ()
    if choice.action == "verify" and not load.steps:  # all loaded: its nodes can be checked
        node_fixes = tuple(f"{n.path} ({n.major}:{n.minor}): {why}" for n in wanted_nodes(host)
                           if (why := devices.problem(host, n) or devices.link_problem(host, n)))
    return Plan(kernel=kernel, flavour=chosen, choice=choice, modules=wanted, load=load,
                sysext_line=sysext_line, node_fixes=node_fixes, firmware=fw, baked=baked_path,
                gpu_addresses=tuple(g.address for g in detection.gpus if g.driver != "vfio-pci"),
                needs=tuple(needs),
                driver_root=found if choice.action == "verify" else None)


def _baked(host: Host, choice: strategy.Choice) -> strategy.Choice:
    """A merged driver sysext that `gpunode image bake` put into the image says so: the
    initramfs found it in place and downloaded nothing (gpunode/bake/image.py)."""
    if choice.strategy != "flatcar-sysext" or choice.action != "load":
        return choice
    from gpunode.bake import manifest

    try:
        baked = manifest.baked_driver(manifest.load(host), (str(choice.source),))
    except GpunodeError:
        return choice  # a damaged manifest is status's bake check to report
    if baked is None:
        return choice
    return dataclasses.replace(choice, reason=f"{choice.reason}, baked into the image for "
                               f"Flatcar {baked.version}: no download")


def _baked_sysext(host: Host, config: DriverConfig, detection: Detection,
                  chosen: flavour.FlavourChoice) -> dict[str, Any]:
    """The DriverFacts of the driver sysexts baked for this OS version and not merged: the one
    to merge, or why none fits (gpunode/driver/branches.py)."""
    from gpunode.bake import manifest

    try:
        usable = manifest.usable_drivers(manifest.load(host), host)
    except GpunodeError:
        return {}  # a damaged manifest is status's bake check to report
    # Only what a bake places: a Flatcar driver sysext's name, in Flatcar's own place for it.
    odd = [a for a in usable if not re.fullmatch(branches.NAME, a.name)
           or a.path != branches.driver_path(a.name, str(a.version))]
    if odd:
        log.get().warning("driver.baked_ignored", artifacts=[f"{a.name}: {a.path}" for a in odd],
                          reason="not a Flatcar driver sysext where a bake places it")
    usable = tuple(a for a in usable if a not in odd)
    if not usable:
        return {}
    azure = on_azure(host)
    needs = [flavour.need(g, azure) for g in detection.gpus if g.driver != "vfio-pci"]
    try:
        return {"baked": branches.choose(needs, [branches.Baked(a.name, a.path) for a in usable],
                                         chosen.flavour, config.flavour, config.sysext)}
    except DriverError as exc:
        log.get().warning("driver.baked_unfit", error=str(exc))
        return {"baked_refusal": str(exc)}


def load_preview(host: Host, config: DriverConfig, detection: Detection | None,
                 undecided: str | None, kmod: modules.Kmod) -> tuple[list[str], str | None]:
    """What `driver load` would do, for `driver status`: the plan's lines, or why it could not
    plan — the refusal driver load itself would give (an undecided detection among them)."""
    if undecided is not None or detection is None:
        return [], undecided or "no detection"
    try:
        return plan(host, config, detection, kmod).describe(), None
    except GpunodeError as exc:
        return [], str(exc)


def gpu_needs(host: Host, detection: Detection) -> list[flavour.Need]:
    """What each GPU the driver is to drive (not those on vfio-pci) needs of the modules."""
    azure = on_azure(host)
    return [flavour.need(g, azure) for g in detection.gpus if g.driver != "vfio-pci"]


def _source_claims(choice: strategy.Choice, chosen: flavour.FlavourChoice,
                   config: DriverConfig) -> dict[str, Any]:
    """What a module directory's source says its modules are: a cache entry is of the
    configured driver version and the flavour it was built as."""
    if choice.strategy == "build":
        return {"claimed": chosen.flavour, "version": config.version}
    return {}


def _reported(chosen: flavour.FlavourChoice, fit: modinfo.Fit | None) -> flavour.FlavourChoice:
    """The flavour gpunode reports: the modules' own, once read."""
    return chosen if fit is None else flavour.FlavourChoice(fit.flavour, fit.reason)


def _family(name: str) -> str:
    return "open" if name == "open" else "proprietary"


def _missing_sysext_line(host: Host, config: DriverConfig, chosen: str) -> str | None:
    """The enabled-sysext.conf line to add, when the sysext is asked for and not listed."""
    if config.strategy != "flatcar-sysext" and not config.sysext:
        return None
    name = sysext_name(config, chosen)
    text = host.read_optional(flatcar.ENABLED_SYSEXT) or ""
    listed = {line.strip() for line in text.splitlines() if not line.startswith("#")}
    return None if name in listed else name


# -- apply ---------------------------------------------------------------------------------------


def apply(host: Host, the_plan: Plan, config: DriverConfig, kmod: modules.Kmod,
          build_adapters: Any = None) -> Outcome:
    if the_plan.sysext_line is not None:
        _add_sysext_line(host, the_plan.sysext_line)
        if the_plan.choice.action == "fail":
            raise DriverError(f"{the_plan.choice.reason}; '{the_plan.sysext_line}' was added "
                              f"to {flatcar.ENABLED_SYSEXT}", "reboot the node: the initramfs "
                              "fetches and merges the sysext at the next boot")
    load = the_plan.load
    source = the_plan.choice.source
    chosen, fw = the_plan.flavour, the_plan.firmware
    if the_plan.baked is not None:
        merge_baked(host, str(source).removeprefix("flatcar-"), the_plan.baked, kmod)
        # Its modules are files to read only now that the sysext is merged.
        fit, fw = loadable.check_tree(host, config, the_plan.kernel, list(the_plan.needs),
                             load, kmod, str(source))
        chosen = _reported(chosen, fit)
    if the_plan.choice.action == "build":
        source = _build(host, the_plan, config, build_adapters)
        load, fit, fw = loadable.directory_load(host, source, the_plan.modules, config, kmod,
                                       needs=list(the_plan.needs),
                                       claimed=the_plan.flavour.flavour, version=config.version)
        chosen = _reported(chosen, fit)
    if fw is not None and getattr(kmod, "may_load", True):
        # Not where the modules cannot be loaded anyway (under --root: KmodTools refuses).
        firmware.apply(host, fw)
    loaded = tuple(modules.execute(host, load, kmod))
    if the_plan.choice.strategy == "build" and source and getattr(kmod, "may_load", True):
        from gpunode.driver import cache

        cache.refresh(host, source, the_plan.kernel, config.version)
    nodes = make_nodes(host)
    problems = verify(host, the_plan.gpu_addresses)
    if problems:
        raise DriverError("; ".join(problems), "see 'dmesg | grep NVRM'")
    version = driverinfo.parse_version(host.read_optional(f"{driverinfo.PROC_NVIDIA}/version")
                                       or "")
    assert version is not None  # verify() said it parses
    # The loaded driver's user-space, found once: the CDI spec and status read this record.
    found = the_plan.driver_root
    if found is None or found.version != version.version:
        found = userspace.find(host, version.version, prebuilt_dirs=config.prebuilt_dirs)
    return Outcome(strategy=the_plan.choice.strategy, flavour=chosen.flavour,
                   version=version.version, loaded=loaded, nodes=tuple(nodes), source=source,
                   driver_root=found)


def merge_baked(host: Host, name: str, path: str, kmod: modules.Kmod) -> None:
    """Link the baked sysext into /run/extensions and have systemd-sysext merge it; refused
    when it did not (its extension-release not for this OS, a damaged image)."""
    link = sysext_link(name)
    if host.read_link(link) != path:
        host.symlink(link, path)
    try:
        kmod.run(SYSEXT_REFRESH)
    except CommandFailed as exc:
        host.remove(link)
        raise DriverError(f"{' '.join(SYSEXT_REFRESH)} failed to merge the baked {name}: "
                          f"{exc.stderr.strip() or exc}", "see 'systemd-sysext status' and "
                          "'journalctl -b -t systemd-sysext'") from exc
    if f"flatcar-{name}" not in merged_sysexts(host):
        host.remove(link)
        raise DriverError(f"{' '.join(SYSEXT_REFRESH)} did not merge the baked {name} "
                          f"({path})", "its extension-release must match this OS ('systemd-"
                          "sysext status', 'journalctl -b -t systemd-sysext'); bake the image "
                          "again for this OS version")
    log.get().info("driver.baked_merged", sysext=name, link=link, target=path)


def _add_sysext_line(host: Host, name: str) -> None:
    text = host.read_optional(flatcar.ENABLED_SYSEXT) or ""
    if text and not text.endswith("\n"):
        text += "\n"
    host.write_atomic(flatcar.ENABLED_SYSEXT, (text + name + "\n").encode(), mode=0o644,
                      make_parents=True)
    log.get().info("driver.sysext_enabled", sysext=name, file=flatcar.ENABLED_SYSEXT,
                   note="takes effect at the next boot")


def _build(host: Host, the_plan: Plan, config: DriverConfig, adapters: Any) -> str:
    from gpunode.driver import build

    if adapters is None:
        raise DriverError("building needs the build adapters (fetcher, builder)")
    result, removed = build_cached(
        host, build.inputs_for(config, the_plan.kernel, the_plan.flavour.flavour), adapters)
    if removed:
        log.get().info("driver.cache.pruned", entries=removed)
    return result.entry.path


def build_inputs(host: Host, config: DriverConfig, kernel: str,
                 gpus: tuple[PciFunction, ...]) -> BuildInputs:
    """The build inputs for `kernel` and the flavour these GPUs get, as plan() chooses it:
    what `gpunode driver build` builds."""
    from gpunode.driver import build

    chosen = flavour.choose(gpus, config.flavour, on_azure(host))
    return build.inputs_for(config, kernel, chosen.flavour)


def build_cached(host: Host, inputs: BuildInputs,
                 adapters: Any) -> tuple[BuildResult, list[str]]:
    """Build (or find in the cache) the modules for `inputs` with the (fetcher, builder)
    adapters, then prune the entries of kernels no longer installed: (result, pruned)."""
    from gpunode.driver import build, cache

    fetcher, builder = adapters
    result = build.build(host, inputs, fetcher, builder, build.host_facts(host))
    return result, cache.prune(host, cache.installed_kernels(host))


def wanted_nodes(host: Host) -> list[devices.Node]:
    """The device nodes the loaded driver calls for (MissingMajor when it registered none)."""
    return devices.for_host(host)


def make_nodes(host: Host) -> list[str]:
    return devices.ensure(host, wanted_nodes(host))


def verify(host: Host, gpu_addresses: tuple[str, ...]) -> list[str]:
    """What is wrong after loading: missing version file, GPUs the driver does not see."""
    text = host.read_optional(f"{driverinfo.PROC_NVIDIA}/version")
    if text is None:
        return [f"{driverinfo.PROC_NVIDIA}/version is missing after loading"]
    if driverinfo.parse_version(text) is None:
        return [f"cannot parse {driverinfo.PROC_NVIDIA}/version"]
    seen = driverinfo.read_gpu_infos(host)
    missing = [a for a in gpu_addresses if a not in seen]
    return [f"the driver does not see {', '.join(missing)}"] if missing else []
