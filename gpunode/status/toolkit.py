"""The NVIDIA Container Toolkit as `gpunode status` sees it, and its `toolkit` check: the
runtime binaries containerd runs, what the toolkit's legacy mode runs in turn, and its own
mode; each missing piece named with where it comes from. On Flatcar that is sysext-bakery's
`nvidia-runtime` sysext (flatcar/sysext-bakery nvidia-runtime.sysext/create.sh: the toolkit's
packages unpacked into /usr/bin, its config.toml put into /etc by a tmpfiles `C` line). CDI
mode (`containerd.gpu_access = "cdi"`) needs none of it."""

from __future__ import annotations

import posixpath

from gpunode.config import AgentConfig
from gpunode.containerd import wiring
from gpunode.containerd.ledger import TOOLKIT_CONFIG
from gpunode.errors import GpunodeError
from gpunode.platform.host import Host
from gpunode.platform.tomlread import loads_toml
from gpunode.status.facts import FAIL, OK, SKIP, WARN, Check, StatusFacts, ToolkitFacts

# What nvidia-container-runtime's legacy mode runs: its prestart hook, which runs the CLI.
LEGACY_HELPERS = ("nvidia-container-runtime-hook", "nvidia-container-cli")
SOURCE = ("on Flatcar, add flatcar/sysext-bakery's nvidia-runtime sysext (the NVIDIA Container "
          "Toolkit)")
CDI_INSTEAD = 'or set containerd.gpu_access = "cdi" (no NVIDIA runtime: containerd injects ' \
              "gpunode's CDI spec itself)"


def observe(host: Host, config: AgentConfig) -> ToolkitFacts:
    c = config.containerd
    runtimes = [c.runtime_path]
    if c.mode_runtimes:
        runtimes += [binary for _, binary in wiring.mode_runtime_binaries(c.runtime_path)]
    directory = posixpath.dirname(c.runtime_path)
    helpers = [posixpath.join(directory, name) for name in LEGACY_HELPERS]
    mode, present, error = None, False, None
    try:
        text = host.read_optional(TOOLKIT_CONFIG, errors="strict")
        if text is not None:
            present = True
            table = loads_toml(text, host.display(TOOLKIT_CONFIG)).get("nvidia-container-runtime")
            value = table.get("mode") if isinstance(table, dict) else None
            mode = value if isinstance(value, str) else None
    except GpunodeError as exc:
        error = str(exc)
    return ToolkitFacts(
        gpu_access=c.gpu_access,
        runtimes={path: _executable(host, path) for path in runtimes},
        helpers={path: _executable(host, path) for path in helpers},
        mode=mode, config_present=present, config_error=error, wanted_mode=c.toolkit_mode)


def _executable(host: Host, path: str) -> bool:
    try:
        return host.is_executable_file(path)
    except GpunodeError:
        return False


def check(facts: StatusFacts) -> Check:
    t = facts.toolkit
    if t is None:
        return Check("toolkit", SKIP, "not observed")
    if t.gpu_access == "cdi":
        return Check("toolkit", SKIP, 'containerd.gpu_access = "cdi": containerd injects the '
                     "CDI spec's devices itself, no NVIDIA runtime is needed")
    missing = [path for path, ok in t.runtimes.items() if not ok]
    if missing:
        return Check("toolkit", FAIL, f"the NVIDIA runtime containerd runs is missing: "
                     f"{', '.join(missing)} (not an executable file)",
                     f"install the NVIDIA Container Toolkit: {SOURCE}; {CDI_INSTEAD}")
    if t.config_error is not None:
        return Check("toolkit", FAIL, f"the toolkit's config cannot be used: {t.config_error}",
                     f"fix {TOOLKIT_CONFIG} (the runtime reads it for every container)")
    mode = t.mode or "auto"
    if t.wanted_mode is not None and not t.config_present:
        return Check("toolkit", WARN, f"{TOOLKIT_CONFIG} is absent, so the toolkit runs in its "
                     f"default mode 'auto', not {t.wanted_mode!r} (containerd.toolkit_mode)",
                     f"install the toolkit's config ({SOURCE}), then run 'gpunode boot'")
    if t.wanted_mode is not None and mode != t.wanted_mode:
        return Check("toolkit", WARN, f"{TOOLKIT_CONFIG} has mode {mode!r}, "
                     f"containerd.toolkit_mode says {t.wanted_mode!r}",
                     "run 'gpunode containerd configure' (gpunode boot does this at boot)")
    helpers = [path for path, ok in t.helpers.items() if not ok]
    if helpers and mode in ("legacy", "auto"):
        why = (f"the toolkit's {mode} mode runs {' and '.join(LEGACY_HELPERS)} for a container "
               f"that asks for GPUs without CDI; missing: {', '.join(helpers)}")
        hint = (f"install them (libnvidia-container-tools: {SOURCE}), or set "
                'containerd.toolkit_mode = "cdi" so that the runtime uses the CDI spec')
        return Check("toolkit", FAIL if mode == "legacy" else WARN, why, hint)
    where = f"mode {mode!r} from {TOOLKIT_CONFIG}" if t.config_present else \
        f"mode 'auto' ({TOOLKIT_CONFIG} absent: the toolkit's defaults)"
    return Check("toolkit", OK, f"NVIDIA Container Toolkit: {', '.join(t.runtimes)}; {where}")
