"""What `gpunode status` knows: the facts `observe` reads, the checks `evaluate` makes of them,
the report, its JSON document, and the labels the Node should carry (one answer for status's
node check and `gpunode label`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpunode.errors import GpunodeError
from gpunode.gpu import driverinfo
from gpunode.gpu.detect import Detection, undecided_reason
from gpunode.kube import labels, nodename
from gpunode.pipeline.state import BootRecord
from gpunode.platform.processes import ProcessFacts

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass(frozen=True)
class Check:
    """One check of `gpunode status`: what it found, and what to do when something is wrong."""

    name: str
    state: str  # ok | warn | fail | skip
    detail: str
    hint: str | None = None
    code: str | None = None  # the error's stable code (docs/errors.md) when one decided it


@dataclass(frozen=True)
class Failure:
    """What could not be read, kept for the check that needs it: the error's message (str() of
    it, so a check's detail reads as before), its stable code and its hint."""

    message: str
    code: str
    hint: str | None = None

    @classmethod
    def of(cls, exc: GpunodeError) -> Failure:
        return cls(str(exc), exc.code, exc.hint or None)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class DevNode:
    """A path under /dev as status found it: a character device, a socket, missing or other."""

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
    error: Failure | None = None  # why no list of wanted nodes could be made (a missing major)


@dataclass(frozen=True)
class CdiSpec:
    """The CDI spec file as status read it (gpunode/cdi/spec.py makes it)."""

    path: str
    present: bool = False
    error: str | None = None  # why it is no CDI spec gpunode can read
    gpu_devices: tuple[str, ...] = ()  # its devices by index
    missing: tuple[str, ...] = ()  # host paths it names that are not on the node
    # every device it names but `all` → the device nodes it gives (deviceNodes' paths)
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    every: tuple[str, ...] = ()  # the device nodes of `all`


@dataclass(frozen=True)
class ContainerdFacts:
    """The containerd config as status read it, and whether its NVIDIA runtime and CDI work."""

    config_path: str | None
    config_reason: str
    runtime_file: str | None = None  # the file that defines the runtime (main or an import)
    binary_name: str | None = None
    binary_ok: bool = False
    error: Failure | None = None
    runtime_names: tuple[str, ...] = ()
    config_mtime: float | None = None  # of the file that defines the runtime, or the main file
    judge: str = ""  # whose view this is: containerd's own dump, or gpunode's model of it
    problem: str | None = None  # containerd would not use the CRI settings as written
    uncertain: str | None = None  # the answer depends on a containerd version not known here
    default_missing: str | None = None  # the default runtime containerd would not find
    binary_key: str = "BinaryName"  # the option the runtime's shim runs
    cdi_problem: str | None = None  # why containerd would not inject CDI devices (all agree)
    cdi_uncertain: str | None = None  # CDI's answer depends on a version not known here


@dataclass(frozen=True)
class ToolkitFacts:
    """The NVIDIA Container Toolkit as status read it (status/toolkit.py)."""

    gpu_access: str  # containerd.gpu_access: "runtime" or "cdi"
    runtimes: dict[str, bool]  # each runtime binary containerd would run → executable
    helpers: dict[str, bool]  # what the toolkit's legacy mode runs (hook, cli) → executable
    mode: str | None = None  # [nvidia-container-runtime] mode in its config.toml ("auto" unset)
    config_present: bool = False
    config_error: str | None = None  # why its config.toml cannot be read
    wanted_mode: str | None = None  # containerd.toolkit_mode


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
    """Everything `observe` read of the host, once, for status's checks and `gpunode label`."""

    root: str
    detection: Detection | None
    detection_error: Failure | None
    driver_version_text: str | None
    gpu_infos: dict[str, driverinfo.GpuInfo]
    device_nodes: DeviceNodes
    containerd: ContainerdFacts
    device_plugin_socket: DevNode
    processes: ProcessFacts
    last_boot: BootRecord | None
    last_boot_error: Failure | None
    config_source: str
    runtime_name: str = "nvidia"
    node: NodeFacts | None = None  # None: the API was not asked (e.g. `label --dry-run`)
    machine: str | None = None  # DMI product name
    user_labels: dict[str, str] = field(default_factory=dict)
    # the driver's /proc files are there but cannot be read (a directory, a FIFO): why
    driver_error: Failure | None = None
    containerd_start: DaemonStart = DaemonStart(unknown="not observed")
    # a containerd configure/revert was killed mid-way; the next one (or boot) rolls it back;
    # text: it is not interrupted but running now, held by this gpunode command ("pid 12, ...")
    containerd_interrupted: bool | str = False
    driver_flavour: str = "auto"  # driver.flavour: "auto" needs every GPU's device id
    # the Node's name as the kubelet decides it (or why it cannot be told): status's node
    # check and `gpunode label` name the same Node
    node_name: nodename.NodeName = _NAME_NOT_OBSERVED
    cdi_spec: CdiSpec | None = None  # None: not observed
    toolkit: ToolkitFacts | None = None  # None: not observed
    gpu_access: str = "runtime"  # containerd.gpu_access
    stack: str = "gpunode"  # kubernetes.stack: who sets the nvidia.com/ labels
    vgpu: bool | None = None  # a vGPU among the NVIDIA functions (kube/gfd.py); None: unread
    # what `gpunode watch` last found (watch/state.py), and why its file cannot be read
    watch: Any = None
    watch_problem: str | None = None
    bake: Any = None  # status/baked.py's BakeFacts; None: the image was not baked
    # the kernel log's initialization failures of GPUs not initialized (gpu/init.py)
    gpu_failures: dict[str, str] = field(default_factory=dict)
    persistenced: str | None = None  # how nvidia-persistenced runs, or None: it does not

    @property
    def undecided(self) -> str | None:
        """Why nobody can tell whether this host has NVIDIA GPUs, or None when that is decided
        (detect.undecided_reason of what observe read)."""
        error = self.detection_error.message if self.detection_error else None
        return undecided_reason(self.detection, error)


@dataclass(frozen=True)
class NodeFacts:
    """The own Node object as the API server has it (one GET, no retries)."""

    name: str
    kubeconfig: str | None  # None: not there, the kubelet has not joined
    obj: dict[str, Any] | None = None
    error: Failure | None = None
    # what to do about `error`: None when waiting helps (the API server did not answer yet)
    hint: str | None = None


@dataclass(frozen=True)
class Report:
    """The status report: every check made, and the verdict they give."""

    checks: tuple[Check, ...]
    verdict: str  # "ready", "not-ready" or "no-gpu"

    @property
    def ready(self) -> bool:
        return self.verdict != "not-ready"


def wanted_labels(facts: StatusFacts, ready: bool) -> dict[str, str]:
    """Every label the Node should carry, from what `observe` read: the one answer for the
    `node` check and `gpunode label`, so they cannot disagree. A node whose GPUs nobody can
    identify gets the user's labels and gpunode.io/ready=false, and no nvidia.com/gpu.*."""
    if facts.detection is None or facts.undecided is not None:
        return {**labels.own(False), **facts.user_labels}
    return labels.compute(label_facts(facts, facts.detection, ready), facts.user_labels)


def label_facts(facts: StatusFacts, detection: Detection, ready: bool) -> labels.LabelFacts:
    """The label inputs, from what `observe` read (safely) and nothing read again."""
    version = driverinfo.parse_version(facts.driver_version_text or "")
    step = (facts.last_boot.step("driver") if facts.last_boot else None) or {}
    return labels.LabelFacts(
        detection=detection, models={a: i.model for a, i in facts.gpu_infos.items() if i.model},
        driver_version=version.version if version else None,
        flavour=step.get("flavour") or (version.flavour if version else None),
        strategy=step.get("strategy"), ready=ready, machine=facts.machine, stack=facts.stack,
        vgpu=facts.vgpu)


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
        "baked": facts.bake.baked.document if facts.bake and facts.bake.baked else None,
    }
