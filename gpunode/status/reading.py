"""`status.observe`: the host read once into `StatusFacts`. Nothing here judges; whatever cannot
be read is kept as the reason, for the check that needs it to say so."""

from __future__ import annotations

import os
import stat

from gpunode.config import AgentConfig
from gpunode.driver import devices
from gpunode.errors import GpunodeError
from gpunode.gpu import driverinfo
from gpunode.gpu import init as gpu_init
from gpunode.gpu.detect import Detection, detect, module_loaded
from gpunode.kube import nodename
from gpunode.pipeline.state import BootRecord, read_record
from gpunode.platform import systemd
from gpunode.platform.host import Host
from gpunode.platform.processes import observe as observe_processes
from gpunode.status import baked, containerd, toolkit
from gpunode.status.facts import CdiSpec, DeviceNodes, DevNode, Failure, NodeFacts, StatusFacts


def observe(host: Host, config: AgentConfig, contact_api: bool = True) -> StatusFacts:
    try:
        detection: Detection | None = detect(host, use_udev=config.detect.use_udev)
        detection_error = None
    except GpunodeError as exc:
        detection, detection_error = None, Failure.of(exc)
    version_text, version_error = _read(host, f"{driverinfo.PROC_NVIDIA}/version")
    gpu_infos: dict[str, driverinfo.GpuInfo] = {}
    if version_text is not None:
        try:
            gpu_infos = driverinfo.read_gpu_infos(host)
        except GpunodeError as exc:
            version_error = Failure.of(exc)
    devices_text, devices_error = _read(host, "/proc/devices")
    try:
        modeset = module_loaded(host, "nvidia_modeset")
    except GpunodeError as exc:
        modeset, version_error = False, version_error or Failure.of(exc)
    last_boot, last_boot_error = _last_boot(host)
    manager = systemd.for_host(host.is_live)  # one service manager connection for the reading
    name = nodename.observe(host, config.kubernetes.node_name)
    from gpunode.watch import state as watch_state

    watch, watch_problem = watch_state.read(host)
    return StatusFacts(
        root=str(host.root),
        detection=detection,
        detection_error=detection_error,
        driver_version_text=version_text,
        gpu_infos=gpu_infos,
        device_nodes=_device_nodes_now(host, gpu_infos, devices_text or "", modeset),
        containerd=containerd.config_facts(host, config, manager),
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
        containerd_start=containerd.daemon_start(host, manager),
        containerd_interrupted=containerd.pending_change(host),
        driver_flavour=config.driver.flavour,
        node_name=name,
        cdi_spec=_cdi_spec(host) if detection and detection.gpus else None,
        toolkit=toolkit.observe(host, config) if detection and detection.gpus else None,
        gpu_access=config.containerd.gpu_access,
        stack=config.kubernetes.stack,
        vgpu=_vgpu(host, detection) if detection and detection.gpus else None,
        watch=watch,
        watch_problem=watch_problem,
        bake=baked.observe(host),
        gpu_failures=gpu_init.read_failures(host, gpu_infos),
        persistenced=gpu_init.persistenced_running(
            host, manager.active_state(gpu_init.PERSISTENCED_UNIT)),
    )


def _vgpu(host: Host, detection: Detection) -> bool | None:
    """GFD's vGPU test over every NVIDIA function's configuration space (kube/gfd.py)."""
    from gpunode.gpu.detect import SYSFS_PCI_DEVICES
    from gpunode.kube import gfd

    configs: list[bytes | None] = []
    for function in detection.functions:
        try:
            configs.append(host.read_optional_bytes(
                f"{SYSFS_PCI_DEVICES}/{function.address}/config", limit=4096))
        except GpunodeError:  # not a file we may read: unknown, the label is left out
            configs.append(None)
    return gfd.vgpu_present(configs)


def _read(host: Host, path: str) -> tuple[str | None, Failure | None]:
    """(text or None when absent, None) — or (None, why) when it is there but unreadable (a
    directory, a FIFO): the check that needs it says so instead of status stopping."""
    try:
        return host.read_optional(path), None
    except GpunodeError as exc:
        return None, Failure.of(exc)


def _observe_node(host: Host, config: AgentConfig, node_name: nodename.NodeName) -> NodeFacts:
    from gpunode.errors import ApiError

    if node_name.error is not None:
        exc = node_name.error
        return NodeFacts("?", None, error=Failure.of(exc), hint=exc.hint or None)
    name = node_name.require()
    path = config.kubernetes.kubeconfig
    if not host.exists(path):
        return NodeFacts(name, None)
    # Only a node that has joined needs the client (http.client, ssl).
    from gpunode.kube.client import NodeApi, read_kubeconfig

    try:
        api = NodeApi(read_kubeconfig(host, path), timeout=3)
        return NodeFacts(name, path, obj=api.get_node(name))
    except GpunodeError as exc:
        # Only an API server that did not answer (yet) is worth waiting for; a broken
        # kubeconfig, a refusal or a reply that is not a Node says what to fix instead.
        waits = isinstance(exc, ApiError) and exc.retryable
        return NodeFacts(name, path, error=Failure.of(exc),
                         hint=None if waits else exc.hint or None)


def _device_nodes_now(host: Host, gpu_infos: dict[str, driverinfo.GpuInfo], proc_devices: str,
                      modeset: bool) -> DeviceNodes:
    """The nodes `driver load` would make (devices.wanted), each judged as it judges them: the
    node itself (devices.problem), then its /dev/char link (devices.link_problem)."""
    unknown = tuple(i.minor_problem for i in gpu_infos.values() if i.minor_problem)
    problems: list[str] = []
    majors = driverinfo.parse_char_majors(proc_devices, problems)
    minors = [i.minor for i in gpu_infos.values() if i.minor is not None]
    try:
        wanted = devices.wanted(majors, minors, modeset, devices.capabilities(host), problems)
    except GpunodeError as exc:  # no major registered, or a caps file unreadable
        return DeviceNodes({}, unknown, Failure.of(exc))
    judged: dict[str, str | None] = {}
    for node in wanted:
        try:
            judged[node.path] = devices.problem(host, node) or devices.link_problem(host, node)
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


def _last_boot(host: Host) -> tuple[BootRecord | None, Failure | None]:
    try:
        return read_record(host), None
    except GpunodeError as exc:  # RecordError among them
        return None, Failure.of(exc)


def _cdi_spec(host: Host) -> CdiSpec:
    """The spec file read and parsed, and which of the host paths it names are missing."""
    from gpunode.cdi import spec as cdi

    path = cdi.SPEC_PATH
    try:
        data = host.read_optional_bytes(path)
    except GpunodeError as exc:
        return CdiSpec(path, True, str(exc))
    if data is None:
        return CdiSpec(path)
    try:
        document = cdi.parse(data)
        paths = cdi.host_paths(document)
        missing = tuple(p for p in paths if not p.startswith("/") or host.lstat(p) is None)
    except (ValueError, GpunodeError) as exc:
        return CdiSpec(path, True, str(exc))
    devices: dict[str, tuple[str, ...]] = {}
    for device in document.get("devices") or []:
        edits = device.get("containerEdits")
        nodes = edits.get("deviceNodes") if isinstance(edits, dict) else None
        devices[str(device.get("name"))] = tuple(
            str(n.get("path")) for n in (nodes if isinstance(nodes, list) else [])
            if isinstance(n, dict))
    every = devices.pop("all", ())
    return CdiSpec(path, True, None, tuple(cdi.gpu_devices(document)), missing, devices, every)
