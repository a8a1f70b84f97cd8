"""gpunode's own CDI spec for the node's GPUs (pure): facts in, the spec document and its bytes out.

The Container Device Interface (github.com/cncf-tags/container-device-interface, SPEC.md,
spec 1.1.0) lets containerd (always on from 2.0), CRI-O and podman inject devices by name:
`nvidia.com/gpu=0`, `nvidia.com/gpu=GPU-<uuid>`, `nvidia.com/gpu=all`. Each GPU is one device,
named by its index and again by its UUID, with its /dev/nvidiaN; the edits common to every
device carry the control nodes and the driver's user-space as read-only bind mounts.

What the common edits carry follows the NVIDIA_DRIVER_CAPABILITIES names the agent config's
`cdi.capabilities` picks (all by default, as `nvidia-ctk cdi generate` mounts every library of
the driver): each capability's libraries and binaries (driver/userspace.py says which), its
config files where the toolkit mounts them (the EGL and Vulkan ICD files, the OpenCL ICD, the
X.Org snippets), and whatever the capability, the GSP firmware and the IPC endpoints that are
there: the persistenced socket read-only, the fabric-manager socket and the MPS pipe
directory with the toolkit's own IPC mount options (internal/discover/ipc.go).

Libraries must be findable by the container's loader. Where the toolkit's `nvidia-cdi-hook` is
on the node, the spec calls it as the toolkit's own specs do (NVIDIA/nvidia-container-toolkit,
internal/discover/hooks.go, symlinks.go, ldconfig.go, compat_libs.go): `create-symlinks --link
libcuda.so.1::<dir>/libcuda.so` (and libnvidia-opticalflow.so), `enable-cuda-compat
--host-driver-version=<version>` where the hook has that command (toolkit 1.17.5 and later: it
puts an image's forward-compatible /usr/local/cuda/compat libcuda first, and is a no-op in any
other image), and `update-ldcache --folder <dir>` at createContainer, the libraries at their
host paths. Without it the spec needs no program at all: the libraries are mounted in
/usr/local/nvidia/lib64 under the names the loader and applications ask for — the file's own
name, the DT_SONAME the file names (driver/elf.py), and the unversioned name the toolkit
always links (libcuda.so, libnvidia-opticalflow.so) — the binaries in /usr/local/nvidia/bin:
the directories NVIDIA's CUDA images put on LD_LIBRARY_PATH and PATH. The spec sets no
environment: an image that does not name those directories itself finds the libraries only
through the hook layout (docs/cli.md, "gpunode cdi generate").

The output is byte-stable: every list is sorted, there is no timestamp, and `cdiVersion` is
the lowest version that expresses what the spec uses (SPEC.md "Released versions";
specs-go/version.go's requiredVersion: a device name starting with a digit needs 0.5.0).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gpunode.config import CDI_CAPABILITIES
from gpunode.platform import nodepaths

if TYPE_CHECKING:
    from gpunode.driver.devices import Node
    from gpunode.driver.userspace import DriverRoot

KIND = "nvidia.com/gpu"
SPEC_PATH = nodepaths.CDI_SPEC_PATH
HOOK = "/usr/bin/nvidia-cdi-hook"
LIB_DIR = "/usr/local/nvidia/lib64"
BIN_DIR = "/usr/local/nvidia/bin"
FORMATS = ("yaml", "json")
MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "bind"]
HEADER = "# Written by gpunode (gpunode cdi generate); gpunode boot keeps it current.\n"

IPC_MOUNT_OPTIONS = ["nosuid", "nodev", "rbind", "rprivate", "noexec"]  # the toolkit's
COMPAT_HOOK = "enable-cuda-compat"
# Names applications dlopen without a version, which the toolkit's create-symlinks always
# makes (internal/discover/symlinks.go): CUDA's runtime and the Optical Flow SDK ask for them.
DEV_NAMES = {"libcuda": "libcuda.so", "libnvidia-opticalflow": "libnvidia-opticalflow.so"}

# The versions whose features the spec may use, newest first, with what each added that this
# spec can contain (SPEC.md, "Released versions"); 0.3.0 is the earliest a runtime accepts.
_VERSIONS = ("0.5.0", "0.4.0", "0.3.0")


def spec(nodes: Sequence[Node], gpus: Iterable[tuple[int, str | None, int]], root: DriverRoot,
         hooks: str | None, capabilities: Collection[str] = CDI_CAPABILITIES,
         cuda_compat: bool = False) -> dict[str, Any]:
    """The spec: one device per GPU by index and by UUID (gpus: index, UUID or None while the
    driver does not know it yet, device minor), `all`, and the common edits with the driver's
    files of `capabilities`; `hooks` is the nvidia-cdi-hook's path, or None; `cuda_compat`: that
    hook has enable-cuda-compat."""
    gpu_nodes = {n.minor: n.path for n in nodes if re.fullmatch(r"/dev/nvidia\d+", n.path)}
    devices: list[dict[str, Any]] = []
    every: list[str] = []
    for index, uuid, minor in sorted(gpus):
        path = gpu_nodes.get(minor, f"/dev/nvidia{minor}")
        every.append(path)
        devices += [{"name": name, "containerEdits": {"deviceNodes": [{"path": path}]}}
                    for name in (str(index), uuid) if name]  # each its own (no YAML anchors)
    devices.sort(key=lambda d: d["name"])
    devices.append({"name": "all",
                    "containerEdits": {"deviceNodes": [{"path": p} for p in sorted(every)]}})
    control = sorted(n.path for n in nodes if n.path not in gpu_nodes.values())
    from gpunode.driver.userspace import capability  # the driver's files: only a spec needs it

    libraries = [lib for lib in root.libraries if capability(lib) in capabilities]
    common: dict[str, Any] = {"deviceNodes": [{"path": p} for p in control],
                              "mounts": _mounts(root, libraries, hooks, capabilities)}
    if hooks is not None:
        common["hooks"] = _hooks(root, libraries, hooks, cuda_compat)
    document = {"cdiVersion": "", "kind": KIND, "devices": devices, "containerEdits": common}
    document["cdiVersion"] = minimum_version(document)
    return document


def _mount(host_path: str, container_path: str,
           options: list[str] = MOUNT_OPTIONS) -> dict[str, Any]:
    return {"hostPath": host_path, "containerPath": container_path, "options": list(options)}


def _stem(library: str) -> str:
    """'/usr/lib64/libcuda.so.550.163.01' → 'libcuda'."""
    return library.rpartition("/")[2].split(".so", 1)[0]


def library_names(library: str, soname: str | None) -> list[str]:
    """The names a library is mounted under without the hook: its file name, its SONAME,
    and the unversioned name the toolkit always links (DEV_NAMES)."""
    file = library.rpartition("/")[2]
    return sorted({file, *([soname] if soname else []),
                   *([DEV_NAMES[_stem(library)]] if _stem(library) in DEV_NAMES else [])})


def _mounts(root: DriverRoot, libraries: list[str], hooks: str | None,
            capabilities: Collection[str]) -> list[dict[str, Any]]:
    from gpunode.driver.userspace import capability

    mounts: list[dict[str, Any]] = []
    for library in libraries:
        if hooks is not None:
            mounts.append(_mount(library, library))
        else:
            mounts += [_mount(library, f"{LIB_DIR}/{name}")
                       for name in library_names(library, root.sonames.get(library))]
    for binary in root.binaries:
        if capability(binary) in capabilities:
            inside = binary if hooks is not None else f"{BIN_DIR}/{binary.rpartition('/')[2]}"
            mounts.append(_mount(binary, inside))
    mounts += [_mount(f.path, f.container_path) for f in root.configs
               if f.capability in capabilities]
    mounts += [_mount(f, f) for f in root.firmware]
    if root.persistenced_socket:
        mounts.append(_mount(root.persistenced_socket, root.persistenced_socket))
    mounts += [_mount(p, p, IPC_MOUNT_OPTIONS) for p in (root.fabricmanager_socket,
                                                         root.mps_pipe_dir) if p]
    return sorted(mounts, key=lambda m: (m["containerPath"], m["hostPath"]))


def _hooks(root: DriverRoot, libraries: list[str], hook: str,
           cuda_compat: bool) -> list[dict[str, Any]]:
    """The toolkit's createContainer hooks: the unversioned links, the CUDA compat libraries'
    place in the loader's path (where the hook has that command), then the loader's cache."""
    name = hook.rpartition("/")[2]
    links = sorted(f"{root.sonames.get(lib, DEV_NAMES[stem] + '.1')}::"
                   f"{lib.rpartition('/')[0]}/{DEV_NAMES[stem]}"
                   for lib in libraries if (stem := _stem(lib)) in DEV_NAMES)
    folders = sorted({lib.rpartition("/")[0] for lib in libraries})
    env = ["NVIDIA_CTK_DEBUG=false"]
    hooks = []
    if links:
        hooks.append({"hookName": "createContainer", "path": hook, "args": [
            name, "create-symlinks", *(a for link in links for a in ("--link", link))],
            "env": env})
    if cuda_compat:
        hooks.append({"hookName": "createContainer", "path": hook, "args": [
            name, COMPAT_HOOK, f"--host-driver-version={root.version}"], "env": env})
    hooks.append({"hookName": "createContainer", "path": hook, "args": [
        name, "update-ldcache", *(a for f in folders for a in ("--folder", f))], "env": env})
    return hooks


def minimum_version(document: dict[str, Any]) -> str:
    """The lowest cdiVersion that has every feature the document uses."""
    devices = document.get("devices") or []
    edits = [document.get("containerEdits") or {}, *(d.get("containerEdits") or {}
                                                      for d in devices)]
    needs = {
        # device names starting with a digit; deviceNodes' hostPath
        "0.5.0": any(str(d.get("name", ""))[:1].isdigit() for d in devices)
        or any("hostPath" in n for e in edits for n in e.get("deviceNodes") or []),
        "0.4.0": any("type" in m for e in edits for m in e.get("mounts") or []),
    }
    return next((v for v in _VERSIONS if needs.get(v)), _VERSIONS[-1])


def render(document: dict[str, Any], fmt: str = "yaml") -> bytes:
    """The spec's bytes: JSON, or for "yaml" the same JSON text under a one-line comment saying
    who wrote it. JSON is YAML (YAML 1.2 is a superset; the CDI library's sigs.k8s.io/yaml and
    PyYAML read it), so the .yaml file every CDI consumer reads is written and read back by
    the boot and status with the json module alone."""
    text = json.dumps(document, indent=2) + "\n"
    return (text if fmt == "json" else HEADER + text).encode()


def parse(data: bytes) -> dict[str, Any]:
    """A spec file's document (YAML, which JSON is a subset of); ValueError when it is none.
    gpunode's own spec is read as JSON; only a spec in another YAML form loads PyYAML."""
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not YAML: {exc}") from None
    try:
        document = json.loads(text.removeprefix(HEADER))
    except (ValueError, RecursionError):
        document = _yaml(text)
    if not isinstance(document, dict):
        raise ValueError("not a CDI spec: the document is not a mapping")
    if document.get("kind") != KIND:
        raise ValueError(f"kind is {document.get('kind')!r}, not {KIND!r}")
    devices = document.get("devices")
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise ValueError("devices is not a list of devices")
    return document


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise ValueError(f"not YAML: {str(exc).splitlines()[0] if str(exc) else exc}") from None


def gpu_devices(document: dict[str, Any]) -> list[str]:
    """The names of the devices by index ("0", "1", …)."""
    return sorted(str(d.get("name")) for d in document.get("devices") or []
                  if str(d.get("name", "")).isdigit())


def host_paths(document: dict[str, Any]) -> list[str]:
    """Every host path the spec names: device nodes, mounts' sources, hook programs."""
    edits = [document.get("containerEdits") or {},
             *((d.get("containerEdits") or {}) for d in document.get("devices") or [])]
    paths: set[str] = set()
    for e in edits:
        if not isinstance(e, dict):
            continue
        paths |= {str(n.get("hostPath") or n.get("path")) for n in e.get("deviceNodes") or []
                  if isinstance(n, dict)}
        paths |= {str(m.get("hostPath")) for m in e.get("mounts") or [] if isinstance(m, dict)}
        paths |= {str(h.get("path")) for h in e.get("hooks") or [] if isinstance(h, dict)}
    return sorted(paths)
