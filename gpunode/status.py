"""`gpunode status`: live checks of everything a GPU node needs, each with a verdict and a hint.

`observe()` reads the host into `StatusFacts`; `evaluate()` is pure and turns facts into checks,
so every verdict can be tested from data alone.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

from gpunode import driverinfo, systemd
from gpunode.config import AgentConfig
from gpunode.containerd import discover
from gpunode.detect import (
    COSMETIC_ATTRIBUTES,
    Detection,
    PciFunction,
    UndecidedError,
    detect,
    module_loaded,
    undecided_reason,
)
from gpunode.driver import devices, nouveau
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.kube import labels, nodename
from gpunode.processes import ProcessFacts
from gpunode.processes import observe as observe_processes
from gpunode.state import BootRecord, RecordError, read_record

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"

BLACKLIST_HINT = nouveau.BLACKLIST_HINT


@dataclass(frozen=True)
class Check:
    name: str
    state: str  # ok | warn | fail | skip
    detail: str
    hint: str | None = None


@dataclass(frozen=True)
class DevNode:
    path: str
    kind: str  # "char", "socket", "missing" or "other"
    major: int | None = None
    minor: int | None = None


@dataclass(frozen=True)
class DeviceNodes:
    """The /dev nodes the loaded driver calls for (driver/devices.py: numbers, MIG capability
    nodes, mode), each judged as `gpunode driver load` judges it before fixing it."""

    problems: dict[str, str | None]  # each wanted node's path → what is wrong, None when right
    unknown_minors: tuple[str, ...] = ()  # GPUs whose /dev/nvidiaN the driver does not name
    error: str | None = None  # why no list of wanted nodes could be made (a missing major)


@dataclass(frozen=True)
class ContainerdFacts:
    config_path: str | None
    config_reason: str
    runtime_file: str | None = None  # the file that defines the runtime (main or an import)
    binary_name: str | None = None
    binary_ok: bool = False
    error: str | None = None
    runtime_names: tuple[str, ...] = ()
    config_mtime: float | None = None  # of the file that defines the runtime, or the main file
    judge: str = ""  # whose view this is: containerd's own dump, or gpunode's model of it
    problem: str | None = None  # containerd would not use the CRI settings as written
    uncertain: str | None = None  # the answer depends on a containerd version not known here
    default_missing: str | None = None  # the default runtime containerd would not find
    binary_key: str = "BinaryName"  # the option the runtime's shim runs


@dataclass(frozen=True)
class DaemonStart:
    """When containerd.service's main process started, as systemd recorded it (microseconds,
    the wall clock file mtimes use), or why that cannot be known. /proc's start time is not
    used: it is whole-second btime plus clock ticks, and at boot gpunode writes the config less
    than a second before containerd starts, so it would call every first boot a pending restart.
    """

    pid: int | None = None
    started: float | None = None  # seconds since the epoch
    unknown: str | None = None  # why `started` is None


_NAME_NOT_OBSERVED = nodename.NodeName(None, "not observed")


@dataclass(frozen=True)
class StatusFacts:
    root: str
    detection: Detection | None
    detection_error: str | None
    driver_version_text: str | None
    gpu_infos: dict[str, driverinfo.GpuInfo]
    device_nodes: DeviceNodes
    containerd: ContainerdFacts
    device_plugin_socket: DevNode
    processes: ProcessFacts
    last_boot: BootRecord | None
    last_boot_error: str | None
    config_source: str
    runtime_name: str = "nvidia"
    node: NodeFacts | None = None  # None: the API was not asked (e.g. `label --dry-run`)
    machine: str | None = None  # DMI product name
    user_labels: dict[str, str] = field(default_factory=dict)
    # the driver's /proc files are there but cannot be read (a directory, a FIFO): why
    driver_error: str | None = None
    containerd_start: DaemonStart = DaemonStart(unknown="not observed")
    # a containerd configure/revert was killed mid-way; the next one (or boot) rolls it back;
    # text: it is not interrupted but running now, held by this gpunode command ("pid 12, ...")
    containerd_interrupted: bool | str = False
    driver_flavour: str = "auto"  # driver.flavour: "auto" needs every GPU's device id
    # the Node's name as the kubelet decides it (or why it cannot be told): status's node
    # check and `gpunode label` name the same Node
    node_name: nodename.NodeName = _NAME_NOT_OBSERVED


@dataclass(frozen=True)
class NodeFacts:
    """The own Node object as the API server has it (one GET, no retries)."""

    name: str
    kubeconfig: str | None  # None: not there, the kubelet has not joined
    obj: dict[str, Any] | None = None
    error: str | None = None
    # what to do about `error`: None when waiting helps (the API server did not answer yet)
    hint: str | None = None


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]
    verdict: str  # "ready", "not-ready" or "no-gpu"

    @property
    def ready(self) -> bool:
        return self.verdict != "not-ready"


# -- observation ---------------------------------------------------------------------------------


def observe(host: Host, config: AgentConfig, contact_api: bool = True) -> StatusFacts:
    try:
        detection: Detection | None = detect(host, use_udev=config.detect.use_udev)
        detection_error = None
    except GpunodeError as exc:
        detection, detection_error = None, str(exc)
    version_text, version_error = _read(host, f"{driverinfo.PROC_NVIDIA}/version")
    gpu_infos: dict[str, driverinfo.GpuInfo] = {}
    if version_text is not None:
        try:
            gpu_infos = driverinfo.read_gpu_infos(host)
        except GpunodeError as exc:
            version_error = str(exc)
    devices_text, devices_error = _read(host, "/proc/devices")
    try:
        modeset = module_loaded(host, "nvidia_modeset")
    except GpunodeError as exc:
        modeset, version_error = False, version_error or str(exc)
    last_boot, last_boot_error = _last_boot(host)
    name = nodename.observe(host, config.kubernetes.node_name)
    return StatusFacts(
        root=str(host.root),
        detection=detection,
        detection_error=detection_error,
        driver_version_text=version_text,
        gpu_infos=gpu_infos,
        device_nodes=_device_nodes_now(host, gpu_infos, devices_text or "", modeset),
        containerd=_containerd(host, config),
        device_plugin_socket=_dev_node(host, config.kubelet.device_plugin_socket),
        processes=observe_processes(host, ("containerd", "kubelet")),
        last_boot=last_boot,
        last_boot_error=last_boot_error,
        config_source=config.source,
        runtime_name=config.containerd.runtime_name,
        node=_observe_node(host, config, name) if contact_api and detection and detection.gpus
        else None,
        machine=(_read(host, "/sys/class/dmi/id/product_name")[0] or "").strip() or None,
        user_labels=dict(config.kubernetes.labels),
        driver_error=version_error or devices_error,
        containerd_start=_containerd_start(host),
        containerd_interrupted=_containerd_interrupted(host),
        driver_flavour=config.driver.flavour,
        node_name=name,
    )


def _read(host: Host, path: str) -> tuple[str | None, str | None]:
    """(text or None when absent, None) — or (None, why) when it is there but unreadable (a
    directory, a FIFO): the check that needs it says so instead of status stopping."""
    try:
        return host.read_optional(path), None
    except GpunodeError as exc:
        return None, str(exc)


def _observe_node(host: Host, config: AgentConfig, node_name: nodename.NodeName) -> NodeFacts:
    from gpunode.kube.client import ApiError, NodeApi, read_kubeconfig

    if node_name.error is not None:
        exc = node_name.error
        return NodeFacts("?", None, error=str(exc), hint=exc.hint or None)
    name = node_name.require()
    path = config.kubernetes.kubeconfig
    if not host.exists(path):
        return NodeFacts(name, None)
    try:
        api = NodeApi(read_kubeconfig(host, path), timeout=3)
        return NodeFacts(name, path, obj=api.get_node(name))
    except GpunodeError as exc:
        # Only an API server that did not answer (yet) is worth waiting for; a broken
        # kubeconfig, a refusal or a reply that is not a Node says what to fix instead.
        waits = isinstance(exc, ApiError) and exc.retryable
        return NodeFacts(name, path, error=str(exc), hint=None if waits else exc.hint or None)


def _device_nodes_now(host: Host, gpu_infos: dict[str, driverinfo.GpuInfo], proc_devices: str,
                      modeset: bool) -> DeviceNodes:
    """The nodes `driver load` would make (devices.wanted), each judged by devices.judge."""
    unknown = tuple(i.minor_problem for i in gpu_infos.values() if i.minor_problem)
    problems: list[str] = []
    majors = driverinfo.parse_char_majors(proc_devices, problems)
    minors = [i.minor for i in gpu_infos.values() if i.minor is not None]
    try:
        wanted = devices.wanted(majors, minors, modeset, devices.cap_minors(host), problems)
    except (devices.MissingMajor, GpunodeError) as exc:  # GpunodeError: a caps file unreadable
        return DeviceNodes({}, unknown, str(exc))
    judged: dict[str, str | None] = {}
    for node in wanted:
        try:
            judged[node.path] = devices.problem(host, node)
        except GpunodeError as exc:  # e.g. a directory on its path it may not search
            judged[node.path] = f"cannot be checked ({exc})"
    return DeviceNodes(judged, unknown)


def _dev_node(host: Host, path: str) -> DevNode:
    try:
        st = host.stat(path)
    except GpunodeError:  # e.g. a symlink loop: there, but not a device anyone can open
        return DevNode(path, "other")
    if st is None:
        return DevNode(path, "missing")
    if stat.S_ISCHR(st.st_mode):
        return DevNode(path, "char", os.major(st.st_rdev), os.minor(st.st_rdev))
    return DevNode(path, "socket" if stat.S_ISSOCK(st.st_mode) else "other")


def _containerd(host: Host, config: AgentConfig) -> ContainerdFacts:
    """The runtime as containerd sees it: its own `config dump` on a live host where the binary
    runs; else gpunode's model of its merge of the file and its imports, for each containerd
    behaviour that reads this config version (1.x replaces imported plugin tables, 2.1+ merges
    them), saying so when the answer depends on the version."""
    name = config.containerd.runtime_name
    try:
        if config.containerd.config_path:
            active = discover.ActiveConfig(config.containerd.config_path,
                                           f"containerd.config_path in {config.source}")
        else:
            active = discover.active_config(host, systemd.for_host(host.is_live))
        doc = discover.load_config(host, active.path)
        version = discover.schema.config_version(doc)
        views, judge = _containerd_views(host, active, doc, version)
    except (GpunodeError, discover.schema.SchemaError) as exc:
        return ContainerdFacts(config_path=None, config_reason="", error=str(exc))
    main_stat = host.stat(active.path)
    answers = {view.daemon: _runtime_answer(view, name) for view in views}
    first = next(iter(answers.values()))
    uncertain = None
    if len(set(answers.values())) > 1:
        groups: dict[_Answer, list[str]] = {}
        for daemon, answer in answers.items():
            groups.setdefault(answer, []).append(
                discover.schema.behaviour(daemon).removeprefix("containerd "))
        uncertain = "; ".join(f"containerd {' and '.join(who)}: {_say(answer, name)}"
                              for answer, who in groups.items())
    file, binary, key, default_missing, problem = first
    view = views[0]
    mtimes = [st.st_mtime for st in (main_stat, host.stat(file) if file else None)
              if st is not None]
    return ContainerdFacts(
        config_path=active.path,
        config_reason=active.reason,
        runtime_file=file,
        binary_name=binary,
        binary_ok=binary is not None and host.is_executable_file(binary),
        runtime_names=tuple(sorted(view.runtimes)),
        config_mtime=max(mtimes) if mtimes else None,
        judge=judge,
        problem=problem if uncertain is None else None,
        uncertain=uncertain,
        default_missing=default_missing if uncertain is None else None,
        binary_key=key,
    )


CONTAINERD_UNIT = "containerd.service"


def _containerd_start(host: Host) -> DaemonStart:
    if not host.is_live:
        return DaemonStart(unknown=f"under --root {host.root} no service manager says when "
                           "containerd started")
    manager = systemd.for_host(True)
    try:
        main = manager.main_process(CONTAINERD_UNIT)
    except GpunodeError as exc:
        return DaemonStart(unknown=str(exc))
    if main is None:
        return DaemonStart(unknown=manager.unavailable_reason or f"{CONTAINERD_UNIT} has no "
                           "running main process (something else runs containerd)")
    return DaemonStart(pid=main.pid, started=main.started)


def _containerd_views(host: Host, active: discover.ActiveConfig, doc: dict[str, Any],
                      version: int) -> tuple[list[discover.schema.View], str]:
    from gpunode.containerd.edit import readers

    schema = discover.schema
    bom = discover.starts_with_bom(host, active.path)

    def effective(daemon: discover.schema.Daemon) -> discover.schema.View:
        layers = discover.load_layers(host, active.path, doc, daemon=daemon, bom=bom)
        return schema.effective(layers, daemon)

    if host.is_live:
        from gpunode.containerd.step import CommandProbe

        binary = active.binary
        probe = CommandProbe()
        daemon = probe.version(binary)
        dumped = probe.dump(binary, active.path) if daemon is not None else None
        if daemon is not None and dumped is not None:
            model = effective(daemon)
            view = schema.effective([schema.Layer(active.path, dumped)], daemon)
            origin = {n: model.origin.get(n, active.path) for n in view.runtimes}
            view = dataclasses.replace(view, origin=origin, problem=model.problem)
            return [view], f"containerd {daemon[0]}.{daemon[1]}'s own config dump"
        if daemon is not None:
            view = effective(daemon)
            failed = (f"'{binary} --config {active.path} config dump' failed (logged as "
                      f"containerd.dump_unavailable): {schema.show(daemon)} cannot read it")
            return [dataclasses.replace(view, problem=view.problem or failed)], schema.show(daemon)
    # A version 1 file is read by 1.x only as written; 2.x ignores its CRI settings, which
    # status says (configure edits it for 1.x: its settings mean nothing to 2.x either way).
    daemons = schema.KNOWN_BEHAVIOURS if version == 1 else readers(version, None)
    views = [effective(d) for d in daemons]
    behaviours = ", ".join(schema.behaviour(v.daemon).removeprefix("containerd ")
                           for v in views)
    return views, f"gpunode's reading of containerd {behaviours}'s merge rules"


_Answer = tuple[str | None, str | None, str, str | None, str | None]


def _runtime_answer(view: discover.schema.View, name: str) -> _Answer:
    """(file, binary, binary option, missing default runtime, problem) of one containerd view."""
    schema = discover.schema
    runtime = view.runtimes.get(name)
    default = view.default_name
    missing = None if default in view.runtimes or view.problem else default
    if runtime is None:
        return None, None, "BinaryName", missing, view.problem
    file = view.origin.get(name) or None
    return (file, schema.runtime_binary(runtime), schema.binary_key(runtime) or "BinaryName",
            missing, view.problem)


def _say(answer: _Answer, name: str) -> str:
    file, binary, key, missing, problem = answer
    if problem:
        return problem
    text = f"runtime '{name}' runs {binary} ({file})" if binary else (
        f"runtime '{name}' has no options.{key}" if file else f"no runtime '{name}'")
    return text + (f", and the default runtime '{missing}' is gone" if missing else "")


def _last_boot(host: Host) -> tuple[BootRecord | None, str | None]:
    try:
        return read_record(host), None
    except (RecordError, GpunodeError) as exc:
        return None, str(exc)


# -- evaluation (pure) ---------------------------------------------------------------------------


def evaluate(facts: StatusFacts) -> Report:
    detection = facts.detection
    if detection is None:
        checks = [Check("gpus", FAIL, f"PCI detection failed: {facts.detection_error}",
                        "check that sysfs is mounted and readable")]
        return Report(tuple(checks), "not-ready")
    if not detection.gpus:
        checks = [_gpus(detection, facts), _pci_scan(detection, facts.driver_flavour)]
        skipped = ("GPU detection undecided (see gpus)" if detection.undecided
                   else "no NVIDIA GPU on this host")
        checks += [Check(name, SKIP, skipped) for name in _GPU_CHECKS]
        checks.append(_last_boot_check(facts))
        verdict = "not-ready" if any(c.state == FAIL for c in checks) else "no-gpu"
        return Report(tuple(checks), verdict)
    driver = driverinfo.parse_version(facts.driver_version_text or "")
    checks = [
        _gpus(detection, facts),
        _pci_scan(detection, facts.driver_flavour),
        _nouveau(detection),
        _binding(detection),
        _driver(facts, driver),
        _driver_gpus(facts, detection, driver),
        _device_nodes(facts, driver),
        _containerd_runtime(facts),
        _process(facts, "containerd"),
        _process(facts, "kubelet"),
        _device_plugin(facts),
        _last_boot_check(facts),
    ]
    verdict = "not-ready" if any(c.state == FAIL for c in checks) else "ready"
    checks.insert(-1, _node(facts, detection, verdict == "ready"))
    return Report(tuple(checks), verdict)


_GPU_CHECKS = ("nouveau", "gpu_binding", "driver", "driver_gpus", "device_nodes",
               "containerd_runtime", "containerd_running", "kubelet_running", "device_plugin",
               "node")


def _describe(functions: tuple[PciFunction, ...], models: dict[str, str]) -> str:
    products: dict[str, int] = {}
    for f in functions:
        name = f.product_name or models.get(f.address) or f"10de:{f.device_id or 'unknown'}"
        products[name] = products.get(name, 0) + 1
    return ", ".join(f"{n}x {p}" for p, n in products.items())


def _gpus(d: Detection, facts: StatusFacts) -> Check:
    undecided = undecided_reason(d)
    if undecided is not None:
        # Neither "no GPU" nor a GPU count to trust: the same refusal boot, plan and driver
        # load give (detect.require_decided).
        found = f"{_count(len(d.gpus), 'GPU')} identified, but " if d.gpus else ""
        return Check("gpus", FAIL, f"GPU detection undecided: {found}{undecided}",
                     UndecidedError.hint)
    if not d.gpus:
        return Check("gpus", SKIP, "no NVIDIA GPU on this host; gpunode has nothing to do")
    models = {a: i.model for a, i in facts.gpu_infos.items() if i.model}
    detail = f"{_count(len(d.gpus), 'GPU')}: {_describe(d.gpus, models)}"
    if d.nvswitches:
        detail += f"; {len(d.nvswitches)} NVSwitch"
    return Check("gpus", OK, detail)


def _pci_scan(d: Detection, flavour: str = "auto") -> Check:
    if not d.problems:
        return Check("pci_scan", OK, f"{_count(len(d.functions), 'NVIDIA PCI function')} read via "
                     f"{d.source}; names from {d.names_source}")
    # Serious: a problem with the PCI tree as a whole or a function that may be an unreadable
    # GPU (both undecided), or an NVIDIA function attribute gpunode decides by (detect.
    # COSMETIC_ATTRIBUTES are the others). A GPU's device id decides the driver flavour,
    # unless driver.flavour is pinned: the driver step refuses exactly then (flavour.choose).
    def decides(f: PciFunction, name: str) -> bool:
        if name == "device":
            return f.kind == "gpu" and flavour == "auto"
        if name == "driver":  # whether the GPU is usable (vfio-pci) or not
            return f.kind == "gpu"
        return name not in COSMETIC_ATTRIBUTES

    serious = {f.address for f in d.functions if any(decides(f, a) for a in f.unreadable)}
    serious |= set(d.undecided)
    where = [p.split(": ", 1)[0] for p in d.problems]
    serious |= {w for w in where if not _PCI_ADDRESS.fullmatch(w)}
    check = "check the device with 'lspci -nn -vvv -s ADDRESS' and the kernel log"
    hint = f"a PCI function's sysfs attributes could not be read or parsed: {check}"
    if any("device" in f.unreadable and f.address in serious for f in d.gpus):
        hint = ("the driver flavour (open or proprietary modules) follows the GPU's device id, "
                f"which cannot be read: set driver.flavour in the agent config, or {check}")
    elif not serious:
        hint += "; gpunode does not need these attributes to make the node ready"
    return Check("pci_scan", FAIL if serious else WARN, "; ".join(d.problems), hint)


_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _nouveau(d: Detection) -> Check:
    if d.nouveau_loaded:
        return Check("nouveau", FAIL, "the nouveau module is loaded and blocks the NVIDIA driver",
                     BLACKLIST_HINT)
    return Check("nouveau", OK, "nouveau not loaded")


def _binding(d: Detection) -> Check:
    by_driver: dict[str, list[str]] = {}
    for gpu in d.gpus:
        by_driver.setdefault(gpu.driver or "none", []).append(gpu.address)
    if set(by_driver) <= {"nvidia", "none"}:
        return Check("gpu_binding", OK, _bindings(by_driver))
    if "nouveau" in by_driver:
        return Check("gpu_binding", FAIL, _bindings(by_driver), BLACKLIST_HINT)
    if set(by_driver) == {"vfio-pci"}:
        return Check("gpu_binding", FAIL, _bindings(by_driver) + "; no GPU is left for containers",
                     "these GPUs are reserved for VM passthrough; unbind them from vfio-pci "
                     "(driver_override) if this node should run GPU pods")
    return Check("gpu_binding", WARN, _bindings(by_driver),
                 "GPUs bound to another driver are not usable by containers; bind them to nvidia "
                 "if that is not intended")


def _bindings(by_driver: dict[str, list[str]]) -> str:
    return "; ".join(f"{drv}: {', '.join(addrs)}" for drv, addrs in sorted(by_driver.items()))


def _driver(facts: StatusFacts, driver: driverinfo.DriverVersion | None) -> Check:
    if facts.driver_error is not None:
        return Check("driver", FAIL, f"cannot read what the driver reports: {facts.driver_error}",
                     "/proc/driver/nvidia and /proc/devices are the kernel's; under --root, "
                     "check the tree (is /proc the node's?)")
    if facts.driver_version_text is None:
        return Check("driver", FAIL, f"{driverinfo.PROC_NVIDIA}/version is missing: the NVIDIA "
                     "driver is not loaded",
                     "run 'gpunode driver load' (gpunode boot does this at boot); 'gpunode "
                     "driver status' says which way it would load them")
    if driver is None:
        first = facts.driver_version_text.strip().splitlines()[:1] or ["(empty)"]
        return Check("driver", FAIL, f"cannot parse {driverinfo.PROC_NVIDIA}/version: {first[0]!r}",
                     "the loaded module is not an NVIDIA driver gpunode knows; check 'modinfo "
                     "nvidia'")
    return Check("driver", OK, f"NVIDIA {driver.version} ({driver.flavour} kernel modules)"
                 + _how_loaded(facts.last_boot))


def _how_loaded(record: BootRecord | None) -> str:
    """How the last boot got the driver, from its record: strategy, source, modules, time."""
    step = next((s for s in record.steps if s.get("name") == "driver"), None) if record else None
    if step is None or step.get("outcome") != "ok" or not step.get("strategy"):
        return ""
    how = f"; last boot: {step['strategy']}"
    if step.get("source"):
        how += f" from {step['source']}"
    if step.get("modules_loaded"):
        how += f", loaded {', '.join(step['modules_loaded'])}"
    return how + f" in {step.get('duration_ms', 0):.0f} ms"


def _driver_gpus(facts: StatusFacts, d: Detection,
                 driver: driverinfo.DriverVersion | None) -> Check:
    if driver is None:
        return Check("driver_gpus", SKIP, "driver not loaded")
    missing = [g.address for g in d.usable_gpus if g.address not in facts.gpu_infos]
    if missing:
        return Check("driver_gpus", FAIL, f"the driver does not see {', '.join(missing)}",
                     "look for NVRM errors about these addresses in 'dmesg'; the GPU may need a "
                     "different driver flavour (open/proprietary) or be in a bad state")
    return Check("driver_gpus", OK, f"driver sees {_count(len(d.usable_gpus), 'GPU')}, all "
                 "it should")


def _device_nodes(facts: StatusFacts, driver: driverinfo.DriverVersion | None) -> Check:
    if driver is None:
        return Check("device_nodes", SKIP, "driver not loaded")
    nodes = facts.device_nodes
    problems = [*nodes.unknown_minors, *([nodes.error] if nodes.error else [])]
    problems += [f"{path} {'is ' if why == devices.NOT_CHAR else ''}{why}"
                 for path, why in nodes.problems.items() if why is not None]
    if nodes.unknown_minors:  # 'driver load' refuses it the same way (devices.for_host)
        return Check("device_nodes", FAIL, "; ".join(problems),
                     "the driver does not say which /dev/nvidiaN is the GPU's: look for NVRM "
                     "errors in 'dmesg'; reload the NVIDIA modules or reboot the node")
    if problems:
        return Check("device_nodes", FAIL, "; ".join(problems),
                     "run 'gpunode driver load', which makes them (majors from /proc/devices; "
                     "gpunode boot does this at boot)")
    return Check("device_nodes", OK, f"{_count(len(nodes.problems), 'device node')} present")


def _containerd_interrupted(host: Host) -> bool | str:
    """A change to containerd's config is pending: True; the lock holder ("pid 12, gpunode
    boot") when a gpunode command is making it right now (the node lock, probed without
    waiting); False when none is."""
    from gpunode import nodelock
    from gpunode.containerd import journal

    try:
        pending = journal.pending(host)
    except GpunodeError:
        pending = True  # something is at the journal's path: not gpunode's to judge, not clean
    return (nodelock.probe(host) or True) if pending else False


def _containerd_runtime(facts: StatusFacts) -> Check:
    check = _containerd_runtime_as_written(facts)
    if not facts.containerd_interrupted:
        return check
    from gpunode.containerd.journal import JOURNAL

    if isinstance(facts.containerd_interrupted, str):
        return Check(check.name, FAIL if check.state == FAIL else WARN,
                     f"{check.detail}; a gpunode command ({facts.containerd_interrupted}) is "
                     "changing containerd's config right now",
                     "wait for it to finish, then run 'gpunode status' again")
    return Check(check.name, FAIL if check.state == FAIL else WARN,
                 f"{check.detail}; an interrupted gpunode change to containerd's config is "
                 f"pending ({JOURNAL})",
                 "run 'gpunode containerd configure' (or 'gpunode boot'): it rolls the "
                 "interrupted change back first, then configures")


def _containerd_runtime_as_written(facts: StatusFacts) -> Check:
    c = facts.containerd
    name = facts.runtime_name
    if c.error is not None:
        return Check("containerd_runtime", FAIL, c.error,
                     "fix or restore containerd's config file; containerd will not start with it "
                     "either")
    where = f"{c.config_path} ({c.config_reason})"
    if c.problem is not None:
        return Check("containerd_runtime", FAIL, f"{c.problem} (judged by {c.judge})",
                     "fix containerd's config: gpunode edits only a config containerd reads as "
                     "written")
    if c.uncertain is not None:
        return Check("containerd_runtime", WARN, "what containerd makes of "
                     f"{c.config_path} and its imports depends on its version, which gpunode "
                     f"cannot ask here: {c.uncertain}",
                     "run 'gpunode status' on the live host (it asks containerd's own "
                     "'config dump'), or give the files settings every version reads alike")
    if c.runtime_file is None:
        have = ", ".join(c.runtime_names) or "none"
        hint = ("run 'gpunode containerd configure' (gpunode boot does this at boot); "
                "'--dry-run' shows the change first")
        if (c.config_path or "").startswith("/usr/"):
            hint = (f"{c.config_path} is on read-only /usr: 'gpunode containerd configure' copies "
                    "it to /etc/containerd/config.toml, adds the runtime there and points "
                    "containerd at the copy with a containerd.service.d drop-in")
        return Check("containerd_runtime", FAIL,
                     f"no '{name}' runtime in {where}; runtimes: {have}", hint)
    if c.binary_name is None:
        return Check("containerd_runtime", FAIL, f"runtime '{name}' in {c.runtime_file} has no "
                     f"options.{c.binary_key}, so it would run plain runc",
                     f"set options.{c.binary_key} to the NVIDIA container runtime")
    if not c.binary_ok:
        return Check("containerd_runtime", FAIL, f"runtime '{name}' runs {c.binary_name}, which "
                     "is not an executable file on this host",
                     "install the NVIDIA container toolkit, or point BinaryName at its "
                     "nvidia-container-runtime")
    if c.default_missing is not None:
        have = ", ".join(c.runtime_names) or "none"
        return Check("containerd_runtime", FAIL, f"containerd's default runtime "
                     f"'{c.default_missing}' is not among its runtimes ({have}) in {where}: "
                     "containerd 1.x then refuses to start its CRI plugin",
                     f"define runtime '{c.default_missing}' (containerd 1.x drops its built-in "
                     "runc once a file sets any runtime), or set default_runtime_name")
    judged = f"; as {c.judge} has it" if c.judge else ""
    return Check("containerd_runtime", OK,
                 f"runtime '{name}' → {c.binary_name} in {c.runtime_file}{judged}; {where}")


def _process(facts: StatusFacts, name: str) -> Check:
    pids = facts.processes.running.get(name, [])
    if not pids:
        return Check(f"{name}_running", WARN, f"{name} is not running",
                     f"'systemctl status {name}' says why; during boot it starts after gpunode")
    running = f"{name} running (pid {', '.join(map(str, pids))})"
    if name == "containerd" and facts.containerd.config_mtime is not None:
        return _restart_pending(facts, pids, running)
    return Check(f"{name}_running", OK, running)


def _restart_pending(facts: StatusFacts, pids: list[int], running: str) -> Check:
    """Whether containerd runs with an older config than the file: only systemd's own record of
    when it started its main process can tell, to the microsecond."""
    start = facts.containerd_start
    changed = facts.containerd.config_mtime
    if start.started is None or start.pid not in pids:
        why = start.unknown if start.started is None else (
            f"{CONTAINERD_UNIT}'s main process is pid {start.pid}, not a running containerd")
        return Check("containerd_running", OK, f"{running}; cannot tell whether a restart is "
                     f"pending: {why}")
    if changed is not None and changed > start.started:
        return Check("containerd_running", WARN, f"{running}, but "
                     f"{facts.containerd.config_path} changed after it started: a restart is "
                     "pending",
                     "run 'systemctl restart containerd' when pods on this node can take it")
    return Check("containerd_running", OK, running)


def _device_plugin(facts: StatusFacts) -> Check:
    node = facts.device_plugin_socket
    if node.kind == "socket":
        return Check("device_plugin", OK, f"{node.path} present: the device plugin registered")
    if node.kind == "missing":
        return Check("device_plugin", WARN, f"{node.path} missing: no NVIDIA device plugin "
                     "registered with the kubelet",
                     "deploy the NVIDIA device plugin DaemonSet selecting "
                     "nvidia.com/gpu.present=true")
    return Check("device_plugin", WARN, f"{node.path} exists but is not a socket",
                 "restart the device plugin pod on this node")


def _node(facts: StatusFacts, detection: Detection, ready: bool) -> Check:
    """The Node as the scheduler sees it: gpunode's labels, GPUReady, nvidia.com/gpu."""
    node = facts.node
    if node is None:
        return Check("node", SKIP, "the API server was not asked")
    if node.kubeconfig is None and node.error is None:
        return Check("node", SKIP, f"node {node.name}: the kubelet has not joined yet (no "
                     "kubeconfig)")
    if node.error is not None or node.obj is None:
        return Check("node", WARN, f"node {node.name}: {node.error}",
                     node.hint or "gpunode-label.service retries until the API server answers")
    wanted = wanted_labels(facts, ready)
    current = node.obj.get("metadata", {}).get("labels") or {}
    stale = sorted(k for k, v in wanted.items() if current.get(k) != v)
    conditions = (node.obj.get("status") or {}).get("conditions") or []
    gpu_ready = next((c.get("status") for c in conditions if c.get("type") == "GPUReady"), None)
    allocatable = ((node.obj.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu")
    detail = (f"node {node.name}: labels {'current' if not stale else 'not current: '}"
              f"{', '.join(stale)}; GPUReady={gpu_ready or 'unset'}; nvidia.com/gpu "
              f"allocatable={allocatable or 0}")
    if stale or gpu_ready is None:
        return Check("node", WARN, detail, "run 'gpunode label' (gpunode-label.service does "
                     "this after the kubelet starts)")
    if not allocatable or allocatable == "0":
        return Check("node", WARN, detail, "the device plugin has not advertised nvidia.com/gpu;"
                     " is its DaemonSet scheduled here?")
    return Check("node", OK, detail)


def wanted_labels(facts: StatusFacts, ready: bool) -> dict[str, str]:
    """Every label the Node should carry, from what `observe` read: the one answer for the
    `node` check and `gpunode label`, so they cannot disagree. A node whose GPUs nobody can
    identify gets the user's labels and gpunode.io/ready=false, and no nvidia.com/gpu.*."""
    if facts.detection is None or undecided_reason(facts.detection,
                                                   facts.detection_error) is not None:
        return {f"{labels.PREFIX}ready": "false", **facts.user_labels}
    return labels.compute(label_facts(facts, facts.detection, ready), facts.user_labels)


def label_facts(facts: StatusFacts, detection: Detection, ready: bool) -> labels.LabelFacts:
    """The label inputs, from what `observe` read (safely) and nothing read again."""
    version = driverinfo.parse_version(facts.driver_version_text or "")
    step = next((s for s in facts.last_boot.steps if s.get("name") == "driver"), {}) \
        if facts.last_boot else {}
    return labels.LabelFacts(
        detection=detection, models={a: i.model for a, i in facts.gpu_infos.items() if i.model},
        driver_version=version.version if version else None,
        flavour=step.get("flavour") or (version.flavour if version else None),
        strategy=step.get("strategy"), ready=ready, machine=facts.machine)


def _last_boot_check(facts: StatusFacts) -> Check:
    if facts.last_boot_error is not None:
        return Check("last_boot", WARN, f"boot record unreadable: {facts.last_boot_error}",
                     "run 'gpunode boot' again to rewrite it")
    record = facts.last_boot
    if record is None:
        return Check("last_boot", SKIP, "no boot record: gpunode boot has not run since this "
                     "host booted")
    when = f" at {record.finished_at}" if record.finished_at else ""
    if record.outcome == "failed":
        failed = record.failed_steps
        detail = "; ".join(f"{s.get('name')}: {s.get('error')}" for s in failed) or "no step named"
        hints = [str(s["hint"]) for s in failed if s.get("hint")]
        return Check("last_boot", WARN, f"last boot failed{when}: {detail}",
                     hints[0] if hints else "see 'journalctl -u gpunode'")
    return Check("last_boot", OK, f"last boot {record.outcome}{when}, "
                 f"{_count(len(record.steps), 'step')}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# -- output --------------------------------------------------------------------------------------


def to_json(facts: StatusFacts, report: Report) -> dict[str, Any]:
    driver = driverinfo.parse_version(facts.driver_version_text or "")
    return {
        "schema_version": 1,
        "root": facts.root,
        "verdict": report.verdict,
        "ready": report.ready,
        "config": facts.config_source,
        "boot_time": facts.processes.boot_time,
        "driver": asdict(driver) if driver else None,
        "containerd_config": facts.containerd.config_path,
        "checks": [asdict(c) for c in report.checks],
        "last_boot": facts.last_boot.raw if facts.last_boot else None,
    }
