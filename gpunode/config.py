"""The agent config (/etc/gpunode/config.toml): typed, validated once, refused with a reason.

A missing file means defaults. Every refusal names the file, the key, the line where it can be
found, and what would be valid; nothing else in gpunode re-checks these values.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpunode.confighints import expected_type, hints_of, item_type, tri_state
from gpunode.driver.flavour import FLAVOURS
from gpunode.driver.strategy import STRATEGIES
from gpunode.errors import ConfigError, HostError, UsageError
from gpunode.platform import safeio
from gpunode.platform.host import Host
from gpunode.platform.nodepaths import DEFAULT_CONFIG_PATH
from gpunode.platform.tomlread import key_line, loads_toml

LOG_LEVELS = ("debug", "info", "warning", "error")
DETECT_SOURCES = ("auto", "udev", "sysfs")
CONTAINERD_MODES = ("in-place", "drop-in")
# How containers get the GPU: "runtime", the NVIDIA runtime handler (pods: runtimeClassName);
# "cdi", containerd injects the CDI spec's devices itself and no NVIDIA runtime is needed.
GPU_ACCESS = ("runtime", "cdi")
# The NVIDIA Container Toolkit's own modes ([nvidia-container-runtime] mode in its config.toml;
# nvidia-container-toolkit internal/modifier/factory.go).
TOOLKIT_MODES = ("auto", "legacy", "cdi", "csv", "jit-cdi")
REGISTER_WITH = ("chart", "kubelet")
# Who owns the cluster side of a GPU node (docs/stacks.md): "gpunode" sets GFD's nvidia.com/
# labels itself and the cluster runs deploy/'s RuntimeClass and device plugin; with
# "gpu-operator" NVIDIA's GPU Operator owns those, and gpunode only its gpunode.io/ labels,
# GPUReady and an nvidia-smi its validator finds.
STACKS = ("gpunode", "gpu-operator")
# The NVIDIA_DRIVER_CAPABILITIES names whose driver files gpunode's CDI spec can mount (the
# toolkit's internal/config/image/capabilities.go, less compat32: docs/gpu-requests.md).
CDI_CAPABILITIES = ("compute", "utility", "video", "graphics", "display", "ngx")


@dataclass(frozen=True)
class LogConfig:
    """The `[log]` table: how much gpunode logs."""

    level: str = "info"


@dataclass(frozen=True)
class DetectConfig:
    """The `[detect]` table: where detection reads the PCI devices from."""

    # "auto": udev on a live host, sysfs files under --root; "sysfs" where udev's view is not
    # wanted (no udev in the environment, or a sysfs tree mounted over the real one)
    source: str = "auto"

    @property
    def use_udev(self) -> bool | None:
        return {"auto": None, "udev": True, "sysfs": False}[self.source]


@dataclass(frozen=True)
class ContainerdConfig:
    """The `[containerd]` table: how gpunode gives containerd's containers the GPUs."""

    runtime_name: str = "nvidia"
    config_path: str | None = None  # None: ask containerd.service which file it uses
    runtime_path: str = "/usr/bin/nvidia-container-runtime"
    set_as_default: bool = False
    # true/false as written; "auto": only where containerd needs it, 1.7 (2.x always has CDI
    # on, 1.6 has none); decided by containerd/wiring.py
    enable_cdi: bool | str = "auto"
    cdi_spec_dirs: tuple[str, ...] = ()
    mode: str = "in-place"  # or "drop-in": the runtime in an imported file (containerd >= 2.1)
    restart_timeout: int = 60  # seconds to wait for containerd to come back after a restart
    gpu_access: str = "runtime"  # GPU_ACCESS: the nvidia runtime handler, or CDI alone
    mode_runtimes: bool = False  # also the toolkit's nvidia-cdi and nvidia-legacy handlers
    toolkit_mode: str | None = None  # the toolkit's own mode; None: its config.toml untouched
    limit_memlock: bool = True  # a containerd.service drop-in with LimitMEMLOCK=infinity

    @property
    def runtime_wanted(self) -> bool:
        """Whether gpunode writes an NVIDIA runtime handler at all (not in CDI mode)."""
        return self.gpu_access == "runtime"


@dataclass(frozen=True)
class KubeletConfig:
    """The `[kubelet]` table: where the NVIDIA device plugin registers with the kubelet."""

    device_plugin_socket: str = "/var/lib/kubelet/device-plugins/nvidia-gpu.sock"


@dataclass(frozen=True)
class KubernetesConfig:
    """The `[kubernetes]` table: the Node to label, how it registers, who owns the cluster side."""

    kubeconfig: str = "/etc/kubernetes/kubelet.conf"
    node_name: str | None = None  # None: as the kubelet decides (--hostname-override, hostname)
    labels: dict[str, str] = field(default_factory=dict)  # extra labels for the Node
    taints: tuple[str, ...] = ("nvidia.com/gpu=present:NoSchedule",)  # set at registration
    # Who sets them: "chart" (cluster-azure values; gpunode writes nothing) or "kubelet" (a
    # kubelet.service drop-in with --register-with-taints/--node-labels, before it registers)
    register_with: str = "chart"
    stack: str = "gpunode"  # STACKS
    wait_seconds: int = 300  # how long `label` waits for the API server and the Node
    request_timeout: int = 10


@dataclass(frozen=True)
class BuildConfig:
    """The `[driver.build]` table: whether the node may build the driver, and from what."""

    enabled: bool = False  # building needs network and minutes: an explicit choice
    dev_container_url: str = ("https://{group}.release.flatcar-linux.net/{board}/{version}/"
                              "flatcar_developer_container.bin.bz2")
    dev_container_sha512: str | None = None
    driver_url: str = ("https://us.download.nvidia.com/tesla/{driver}/"
                       "NVIDIA-Linux-x86_64-{driver}.run")
    driver_sha256: str | None = None
    allow_unverified: bool = False
    command: tuple[str, ...] = ()  # builder argv template; empty: systemd-nspawn (docs/cli.md)


@dataclass(frozen=True)
class DriverConfig:
    """The `[driver]` table: which NVIDIA driver the node loads, and from where."""

    strategy: str = "auto"
    flavour: str = "auto"
    version: str = "570.195.03"
    sysext: str | None = None  # e.g. "nvidia-drivers-570-open"; None: from version and flavour
    prebuilt_dirs: tuple[str, ...] = ("/opt/nvidia/modules",)
    extra_modules: tuple[str, ...] = ()
    module_params: dict[str, str] = field(default_factory=dict)
    build: BuildConfig = field(default_factory=BuildConfig)


@dataclass(frozen=True)
class CdiConfig:
    """The `[cdi]` table: what gpunode's CDI spec gives every GPU container."""

    # CDI_CAPABILITIES names whose driver files the spec mounts; "all": every one, as
    # `nvidia-ctk cdi generate` mounts every library of the driver (docs/gpu-requests.md)
    capabilities: tuple[str, ...] = ("all",)

    @property
    def wanted(self) -> frozenset[str]:
        """The capabilities named, "all" spelled out."""
        return frozenset(CDI_CAPABILITIES if "all" in self.capabilities else self.capabilities)


@dataclass(frozen=True)
class GpuConfig:
    """The `[gpu]` table: how boot brings the GPUs up after the driver loads (gpu/init.py)."""

    # start nvidia-persistenced (persistence mode) when the driver ships it; false: only open
    # each GPU not initialized yet once
    persistenced: bool = True
    # seconds boot waits for every GPU to show its UUID (0: look once, do not wait)
    init_timeout: int = 60


# The Xids watch.fatal_xids and watch.ignored_xids default to (gpunode/watch/xid.py says where
# they come from): the config's defaults, beside the keys they are the defaults of
DEFAULT_FATAL = (48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 119, 120)
DEFAULT_IGNORED = (13, 31, 43, 45, 68, 109)


@dataclass(frozen=True)
class WatchConfig:
    """The `[watch]` table: how the watch treats each Xid, and when it may restart containerd."""

    # Xid codes (gpunode/watch/xid.py): fatal ones make GPUReady False; ignored ones are the
    # application's own errors; every other one is a Node Event. A code in both is fatal.
    fatal_xids: tuple[int, ...] = DEFAULT_FATAL
    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED
    # When the watch may restart containerd after repairing its config (gpunode/watch/checks.py):
    # "when-idle" (no container runs), "never" or "always"; otherwise the restart is pending.
    containerd_restart: str = "when-idle"


# Where the watch writes the metrics for node-exporter's textfile collector (docs/metrics.md:
# the directory most node-exporter setups that read textfiles use; "" writes none)
DEFAULT_METRICS_TEXTFILE = "/var/lib/node_exporter/textfile_collector/gpunode.prom"


@dataclass(frozen=True)
class MetricsConfig:
    """The `[metrics]` table: where `gpunode watch` keeps the node's metrics."""

    textfile: str = DEFAULT_METRICS_TEXTFILE


@dataclass(frozen=True)
class AgentConfig:
    """The whole agent config as read and validated, with defaults where the file says nothing."""

    log: LogConfig = field(default_factory=LogConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    containerd: ContainerdConfig = field(default_factory=ContainerdConfig)
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    driver: DriverConfig = field(default_factory=DriverConfig)
    cdi: CdiConfig = field(default_factory=CdiConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    source: str = "defaults"  # the file it was read from, for `status` and logs


def _one_of(*allowed: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(allowed)}"

    return check


# The NVIDIA modules in the order they load (driver/modules.py loads them so); the last two
# only when driver.extra_modules names them.
DRIVER_MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem")
EXTRA_MODULES = ("nvidia_drm", "nvidia_peermem")


def _node_labels(value: dict[str, str]) -> str | None:
    from gpunode.kube.labels import kubelet_may_set, label_problem

    for key, label in value.items():
        problem = label_problem(key, label) or kubelet_may_set(key)
        if problem:
            return f"cannot hold {key}={label}: {problem}"
    return None


def _node_name(value: str) -> str | None:
    from gpunode.kube.nodename import node_name_problem

    return node_name_problem(value)


_TAINT = r"[^=:\s]+(=[^:\s]*)?:(NoSchedule|PreferNoSchedule|NoExecute)"  # compiled when used


def _taint(value: str) -> str | None:
    if re.fullmatch(_TAINT, value):
        return None
    return f"{value!r} is not a taint like key=value:NoSchedule (PreferNoSchedule, NoExecute)"


def _hex_digest(value: Any, length: int) -> str | None:
    if re.fullmatch(f"[0-9a-f]{{{length}}}", str(value)):
        return None
    return f"must be {length} lowercase hex digits"


def _absolute_path(value: Any) -> str | None:
    text = str(value)
    if not text.startswith("/"):
        return "must be an absolute path (starting with /)"
    if not text.isprintable():  # a newline or NUL names no file; it would only corrupt a config
        return "must not contain control characters (a newline, a tab, a NUL byte)"
    return None


_RUNTIME_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"


def _runtime_name(value: Any) -> str | None:
    if re.fullmatch(_RUNTIME_NAME, str(value)):
        return None
    return "must be letters, digits, '.', '_' or '-', starting with a letter or digit"


def _capabilities(value: tuple[str, ...]) -> str | None:
    if not value:
        return f"must name at least one of all, {', '.join(CDI_CAPABILITIES)}"
    if "compat32" in value:
        return ("names compat32: gpunode mounts no 32-bit libraries (docs/gpu-requests.md); "
                f"valid are all, {', '.join(CDI_CAPABILITIES)}")
    if not set(value) <= {"all", *CDI_CAPABILITIES}:
        return f"may only name all, {', '.join(CDI_CAPABILITIES)}"
    return None


def _xids(value: Any) -> str | None:
    if all(isinstance(v, int) and 1 <= v <= 65535 for v in value):
        return None
    return "must be Xid codes from 1 to 65535"


def _textfile(value: Any) -> str | None:
    """A file node-exporter's textfile collector reads (only names ending in .prom), or ""."""
    problem = None if value == "" else _absolute_path(value)
    if problem is None and value and not str(value).endswith(".prom"):
        return ('must end in ".prom" (node-exporter\'s textfile collector reads only such '
                'files), or be "" to write none')
    return problem


# (section, key) → check returning the problem, or None when the value is fine.
_VALUE_CHECKS: dict[tuple[str, str], Callable[[Any], str | None]] = {
    ("log", "level"): _one_of(*LOG_LEVELS),
    ("detect", "source"): _one_of(*DETECT_SOURCES),
    ("containerd", "runtime_name"): _runtime_name,
    ("containerd", "config_path"): _absolute_path,
    ("containerd", "runtime_path"): _absolute_path,
    ("containerd", "cdi_spec_dirs"): lambda v: next(filter(None, map(_absolute_path, v)), None),
    ("containerd", "mode"): _one_of(*CONTAINERD_MODES),
    ("containerd", "enable_cdi"): lambda v: None if isinstance(v, bool) or v == "auto"
    else 'must be true, false or "auto"',
    ("containerd", "gpu_access"): _one_of(*GPU_ACCESS),
    ("containerd", "toolkit_mode"): _one_of(*TOOLKIT_MODES),
    ("containerd", "restart_timeout"): lambda v: None if 1 <= v <= 600 else "must be 1 to 600",
    ("kubelet", "device_plugin_socket"): _absolute_path,
    ("driver", "strategy"): _one_of(*STRATEGIES),
    ("driver", "flavour"): _one_of("auto", *FLAVOURS),
    ("driver", "version"): lambda v: None if re.fullmatch(r"\d+\.\d+(\.\d+)?", v)
    else "must be an NVIDIA driver version like 570.195.03",
    ("driver", "sysext"): lambda v: None if re.fullmatch(r"nvidia-drivers-\d+(-open)?", v)
    else "must name a Flatcar driver sysext like nvidia-drivers-570 or nvidia-drivers-570-open",
    ("driver", "prebuilt_dirs"): lambda v: next(filter(None, map(_absolute_path, v)), None),
    ("driver", "extra_modules"): lambda v: None if set(v) <= set(EXTRA_MODULES)
    else f"may only name {' and '.join(EXTRA_MODULES)}",
    ("driver", "module_params"): lambda v: None if set(v) <= set(DRIVER_MODULES)
    else f"may only name the modules {', '.join(DRIVER_MODULES)}",
    ("driver.build", "dev_container_sha512"): lambda v: _hex_digest(v, 128),
    ("cdi", "capabilities"): _capabilities,
    ("gpu", "init_timeout"): lambda v: None if 0 <= v <= 600 else "must be 0 to 600",
    ("kubernetes", "kubeconfig"): _absolute_path,
    ("kubernetes", "node_name"): lambda v: _node_name(v),
    ("kubernetes", "labels"): _node_labels,
    ("kubernetes", "taints"): lambda v: next(filter(None, map(_taint, v)), None),
    ("kubernetes", "register_with"): _one_of(*REGISTER_WITH),
    ("kubernetes", "stack"): _one_of(*STACKS),
    ("kubernetes", "wait_seconds"): lambda v: None if 0 <= v <= 3600 else "must be 0 to 3600",
    ("kubernetes", "request_timeout"): lambda v: None if 1 <= v <= 120 else "must be 1 to 120",
    ("driver.build", "driver_sha256"): lambda v: _hex_digest(v, 64),
    ("watch", "fatal_xids"): lambda v: _xids(v),
    ("watch", "ignored_xids"): lambda v: _xids(v),
    ("watch", "containerd_restart"): _one_of("when-idle", "never", "always"),
    ("metrics", "textfile"): _textfile,
}


def check_flag(flag: str, section: str, key: str, value: Any) -> None:
    """A command-line value for `[section] key`, checked by that key's own rule: a value the
    agent config would refuse is refused (UsageError, exit 2) naming the flag; None was not
    given."""
    check = _VALUE_CHECKS.get((section, key))
    problem = check(value) if check is not None and value is not None else None
    if problem is not None:
        raise UsageError(f"{flag} {value!r}: {problem}")


def with_flags(config: AgentConfig, section: str,
               flags: dict[str, tuple[str, Any]]) -> AgentConfig:
    """`config` with command-line overrides for keys of one section (key → (flag, value); a
    value None was not given), each checked first (check_flag)."""
    given = {key: value for key, (_, value) in flags.items() if value is not None}
    for key, (flag, value) in flags.items():
        check_flag(flag, section, key, value)
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section),
                                                                       **given)})


# The most an agent config may hold: `ignition` refuses exactly what the node would.
MAX_CONFIG_BYTES = safeio.DEFAULT_LIMIT


def load_config(host: Host, path: str | None = None) -> AgentConfig:
    """Read and validate the agent config. `path` None: the default under the root, where a
    missing file means defaults; a path given (--config) must exist, even when it names the
    default file (docs/config.md)."""
    explicit = path is not None
    path = path or DEFAULT_CONFIG_PATH
    shown = host.display(path)
    try:
        # Strict UTF-8 (a config is never kernel text) and a FIFO is refused, never waited on.
        text = host.read_optional(path, limit=MAX_CONFIG_BYTES, errors="strict")
    except HostError as exc:
        raise ConfigError(shown, None, f"cannot be read: {exc.reason}") from exc
    if text is None:
        if explicit:
            raise ConfigError(shown, None, "does not exist (omit --config to use defaults)")
        return AgentConfig()
    return parse_text(text, shown)


def parse_text(text: str, shown: str) -> AgentConfig:
    """An agent config's text, validated as the node validates its file (`shown` names it)."""
    doc = loads_toml(text, shown, lambda file, reason, line: ConfigError(file, None, reason,
                                                                             line))
    return parse_config(doc, text, shown)


def parse_config(doc: dict[str, Any], text: str, shown: str) -> AgentConfig:
    sections: dict[str, Any] = {}
    section_types = hints_of(AgentConfig)
    known_sections = [f.name for f in dataclasses.fields(AgentConfig) if f.name != "source"]
    for name, value in doc.items():
        if name not in known_sections:
            raise ConfigError(shown, name, f"unknown section; valid sections are "
                              f"{', '.join(known_sections)}", key_line(text, "", name)
                              or _header_line(text, name))
        if not isinstance(value, dict):
            raise ConfigError(shown, name, f"must be a table ([{name}]), not "
                              f"{_a(_type_name(value))}", key_line(text, "", name))
        sections[name] = _parse_section(section_types[name], name, value, text, shown)
    config = AgentConfig(**sections, source=shown)
    if config.kubernetes.stack == "gpu-operator" and config.containerd.gpu_access == "cdi":
        # The Operator's validator runs its toolkit check in a pod of RuntimeClass `nvidia`
        # (gpu-operator cmd/nvidia-validator), which CDI mode does not give containerd.
        raise ConfigError(shown, "kubernetes.stack", '"gpu-operator" needs the nvidia runtime '
                          "handler its validator's pods run with, but containerd.gpu_access = "
                          '"cdi" writes none; use gpu_access = "runtime" beside the Operator',
                          key_line(text, "kubernetes", "stack"))
    return config


def _parse_section(cls: type, section: str, values: dict[str, Any], text: str, shown: str) -> Any:
    hints = hints_of(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = dict(values)
    for key, value in list(values.items()):
        dotted = f"{section}.{key}"
        line = key_line(text, section, key)
        if key not in known:
            raise ConfigError(shown, dotted, f"unknown key; valid keys in [{section}] are "
                              f"{', '.join(known)}", line)
        expected = expected_type(hints[key])
        if dataclasses.is_dataclass(expected):  # a sub-table: [section.key]
            if not isinstance(value, dict):
                raise ConfigError(shown, dotted, f"must be a table ([{dotted}]), not "
                                  f"{_a(_type_name(value))}", line)
            values[key] = _parse_section(expected, dotted, value, text, shown)
            continue
        if tri_state(hints[key]) and isinstance(value, bool):
            pass  # true or false as written; a string is checked as one ("auto")
        elif isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
            wanted = ("true, false or a string" if tri_state(hints[key])
                      else _a(_TYPE_NAMES[expected]))
            raise ConfigError(shown, dotted, f"must be {wanted}, not "
                              f"{_a(_type_name(value))} ({value!r})", line)
        if expected is list:
            item = item_type(hints[key])
            if not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
                raise ConfigError(shown, dotted, f"must be an array of {_TYPE_NAMES[item]}s, "
                                  f"not {value!r}", line)
            values[key] = tuple(value)
        if expected is dict and not all(isinstance(item, str) for item in value.values()):
            raise ConfigError(shown, dotted, f"must be a table of strings, not {value!r}", line)
        check = _VALUE_CHECKS.get((section, key))
        problem = check(value) if check else None
        if problem:
            raise ConfigError(shown, dotted, f"{value!r} {problem}", line)
    parsed = cls(**values)
    if cls is ContainerdConfig:
        _cross_check(parsed, values, text, shown)
    return parsed


def _cross_check(c: ContainerdConfig, given: dict[str, Any], text: str, shown: str) -> None:
    """Keys that contradict each other: CDI mode writes no NVIDIA runtime, so nothing may ask
    for one (a default runtime, the toolkit's mode handlers) or for CDI to be off."""
    if c.gpu_access != "cdi":
        return
    contradictions = {
        "mode_runtimes": (c.mode_runtimes, "the toolkit's nvidia-cdi and nvidia-legacy runtimes"),
        "set_as_default": (c.set_as_default, "an NVIDIA default runtime"),
        "enable_cdi": (c.enable_cdi is False, "CDI switched off"),
        "toolkit_mode": (c.toolkit_mode is not None, "the NVIDIA Container Toolkit's mode"),
    }
    for key, (bad, what) in contradictions.items():
        if bad and key in given:
            raise ConfigError(shown, f"containerd.{key}", f"asks for {what}, but "
                              'containerd.gpu_access = "cdi" writes no NVIDIA runtime and '
                              "needs CDI", key_line(text, "containerd", key))


_TYPE_NAMES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
               dict: "table"}


def _a(noun: str) -> str:
    """The noun with its indefinite article: "an integer", "a string"."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _type_name(value: Any) -> str:
    return next((n for t, n in _TYPE_NAMES.items() if isinstance(value, t)), type(value).__name__)


def _header_line(text: str, section: str) -> int | None:
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip().replace(" ", "") in (f"[{section}]", f'["{section}"]'):
            return number
    return None
