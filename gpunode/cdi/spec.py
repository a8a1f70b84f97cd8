"""gpunode's own CDI spec for the node's GPUs (pure): facts in, the spec document and its bytes out.

The Container Device Interface (github.com/cncf-tags/container-device-interface, SPEC.md,
spec 1.1.0) lets containerd (always on from 2.0), CRI-O and podman inject devices by name:
`nvidia.com/gpu=0`, `nvidia.com/gpu=GPU-<uuid>`, `nvidia.com/gpu=all`. Each GPU is one device,
named by its index and again by its UUID, with its /dev/nvidiaN; the edits common to every
device carry the control nodes and the driver's user-space as read-only bind mounts.

Libraries must be findable by the container's loader. Where the toolkit's `nvidia-cdi-hook` is
on the node, the spec calls it as the toolkit's own specs do (NVIDIA/nvidia-container-toolkit,
internal/discover/hooks.go, symlinks.go, ldconfig.go): `create-symlinks --link
libcuda.so.1::<dir>/libcuda.so` and `update-ldcache --folder <dir>` at createContainer, the
libraries at their host paths. Without it the spec needs no program at all: the libraries are
mounted in /usr/local/nvidia/lib64 (the versioned file, and the same file again under each name
the loader and applications ask for: the SONAME, libcuda.so), the binaries in
/usr/local/nvidia/bin — the directories NVIDIA's CUDA images put on LD_LIBRARY_PATH and PATH.
The spec sets no environment: an image that does not name those directories itself finds the
libraries only through the hook layout (docs/cli.md, "gpunode cdi generate").

The output is byte-stable: every list is sorted, there is no timestamp, and `cdiVersion` is
the lowest version that expresses what the spec uses (SPEC.md "Released versions";
specs-go/version.go's requiredVersion: a device name starting with a digit needs 0.5.0).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

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

# The SONAME of each library (what `readelf -d` shows, and the name programs link against);
# a library not listed has SONAME <name>.so.1.
SONAMES = {"libnvidia-nvvm": "libnvidia-nvvm.so.4"}
# Names applications dlopen without a version (the toolkit links libcuda.so too).
DEV_NAMES = {"libcuda": "libcuda.so"}

# The versions whose features the spec may use, newest first, with what each added that this
# spec can contain (SPEC.md, "Released versions"); 0.3.0 is the earliest a runtime accepts.
_VERSIONS = ("0.5.0", "0.4.0", "0.3.0")


def spec(nodes: Sequence[Node], gpus: Iterable[tuple[int, str | None, int]], root: DriverRoot,
         hooks: str | None) -> dict[str, Any]:
    """The spec: one device per GPU by index and by UUID (gpus: index, UUID or None while the
    driver does not know it yet, device minor), `all`, and the common edits; `hooks` is the
    nvidia-cdi-hook's path, or None."""
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
    common: dict[str, Any] = {"deviceNodes": [{"path": p} for p in control],
                              "mounts": _mounts(root, hooks)}
    if hooks is not None:
        common["hooks"] = _hooks(root, hooks)
    document = {"cdiVersion": "", "kind": KIND, "devices": devices, "containerEdits": common}
    document["cdiVersion"] = minimum_version(document)
    return document


def _mount(host_path: str, container_path: str) -> dict[str, Any]:
    return {"hostPath": host_path, "containerPath": container_path,
            "options": list(MOUNT_OPTIONS)}


def _mounts(root: DriverRoot, hooks: str | None) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = []
    for library in root.libraries:
        if hooks is not None:
            mounts.append(_mount(library, library))
            continue
        file = library.rpartition("/")[2]
        stem = file.split(".so", 1)[0]
        names = {file, SONAMES.get(stem, f"{stem}.so.1"), *([DEV_NAMES[stem]]
                                                           if stem in DEV_NAMES else [])}
        mounts += [_mount(library, f"{LIB_DIR}/{name}") for name in sorted(names)]
    for binary in root.binaries:
        inside = binary if hooks is not None else f"{BIN_DIR}/{binary.rpartition('/')[2]}"
        mounts.append(_mount(binary, inside))
    mounts += [_mount(f, f) for f in root.firmware]
    if root.persistenced_socket:
        mounts.append(_mount(root.persistenced_socket, root.persistenced_socket))
    return sorted(mounts, key=lambda m: (m["containerPath"], m["hostPath"]))


def _hooks(root: DriverRoot, hook: str) -> list[dict[str, Any]]:
    """The toolkit's createContainer hooks: the libcuda.so link, then the loader's cache."""
    name = hook.rpartition("/")[2]
    links = sorted(f"{DEV_NAMES[stem]}.1::{lib.rpartition('/')[0]}/{DEV_NAMES[stem]}"
                   for lib in root.libraries
                   if (stem := lib.rpartition("/")[2].split(".so", 1)[0]) in DEV_NAMES)
    folders = sorted({lib.rpartition("/")[0] for lib in root.libraries})
    env = ["NVIDIA_CTK_DEBUG=false"]
    hooks = []
    if links:
        hooks.append({"hookName": "createContainer", "path": hook, "args": [
            name, "create-symlinks", *(a for link in links for a in ("--link", link))],
            "env": env})
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
