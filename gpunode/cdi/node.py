"""The node's CDI spec: its facts read through Host, the file written only when its bytes change.

gpunode/cdi/spec.py makes the spec from facts; this module reads them (the loaded driver's version
and GPUs from /proc/driver/nvidia, the device nodes it calls for from driver/devices.py, its
user-space from driver/userspace.py, whether nvidia-cdi-hook is there and which commands it
has) and writes the file
for `gpunode cdi generate --output` and boot's `cdi` step.
"""

from __future__ import annotations

import stat
from collections.abc import Collection
from typing import Any

from gpunode import log
from gpunode.cdi import spec as cdi
from gpunode.config import CDI_CAPABILITIES, DriverConfig
from gpunode.driver import devices, userspace
from gpunode.errors import DeviceMinorCollision, DriverError, GpunodeError, UsageError
from gpunode.gpu import driverinfo
from gpunode.platform.host import Host


def driver_version(host: Host) -> str:
    text = host.read_optional(f"{driverinfo.PROC_NVIDIA}/version")
    version = driverinfo.parse_version(text or "")
    if version is None:
        raise DriverError(f"no CDI spec without the driver: {driverinfo.PROC_NVIDIA}/version is "
                          f"{'missing' if text is None else 'not the driver version file'}",
                          "load the driver first: 'gpunode driver load' (gpunode boot does "
                          "both)")
    return version.version


def gpus(host: Host) -> list[tuple[int, str | None, int]]:
    """(index, UUID or None, device minor) of every GPU the spec gives containers, indexed in
    PCI address order as nvidia-smi numbers them (spec_gpus says which, and why not)."""
    infos = driverinfo.read_gpu_infos(host)
    from gpunode.gpu import init

    found, notes = spec_gpus(infos, init.read_failures(host, infos))
    for note in notes:
        log.get().warning("cdi.device_left_out", note=note)
    return found


def spec_gpus(infos: dict[str, driverinfo.GpuInfo], failed: dict[str, str],
              ) -> tuple[list[tuple[int, str | None, int]], list[str]]:
    """(index, UUID or None, minor) per GPU, and a note for each device left out. Pure.

    - A GPU gets its index device while its UUID is not known yet (the driver shows
      GPU-????… until it initialized the GPU): the spec never fails as a whole for it, and the
      UUID device appears once the UUID is there (boot's cdi step and the watch regenerate).
    - A GPU whose initialization the kernel log says failed gets no device at all (its index
      stays taken): no pod lands on a GPU that never came up.
    - A UUID two GPUs report gives no UUID device (driverinfo takes only a UUID of NVML's
      form, which is a CDI device name: never an index, never `all`).
    - Two GPUs with one device minor: DeviceMinorCollision naming them. Which /dev/nvidiaN is
      which GPU cannot be told then, and a spec that guessed could hand a pod another GPU than
      the one it asked for (or one GPU to two pods): no spec at all, whatever the other GPUs."""
    by_minor: dict[int, list[str]] = {}
    for address, info in sorted(infos.items()):
        if info.minor is None:
            shown = f"{driverinfo.PROC_NVIDIA}/gpus/{address}/information"
            raise DriverError(f"no CDI spec: {info.minor_problem or shown}",
                              "look for NVRM errors in 'dmesg'; reload the modules or reboot")
        by_minor.setdefault(info.minor, []).append(address)
    shared = {minor: addresses for minor, addresses in by_minor.items() if len(addresses) > 1}
    if shared:
        said = "; ".join(f"{' and '.join(addresses)} all say Device Minor {minor} "
                         f"(/dev/nvidia{minor})" for minor, addresses in sorted(shared.items()))
        raise DeviceMinorCollision(f"no CDI spec: {said}: which GPU a device node reaches "
                                   "cannot be told, and a pod must never get another GPU than "
                                   "it asked for")
    uuids = [i.uuid for i in infos.values() if i.uuid is not None]
    found: list[tuple[int, str | None, int]] = []
    notes: list[str] = []
    for index, (address, info) in enumerate(sorted(infos.items())):
        assert info.minor is not None  # checked above
        if address in failed:
            notes.append(f"GPU {index} ({address}) has no device: its initialization failed "
                         f"({failed[address]})")
            continue
        uuid = info.uuid
        if uuid is not None and uuids.count(uuid) > 1:
            notes.append(f"GPU {index} ({address}) has no UUID device: {uuid} is reported by "
                         "several GPUs")
            uuid = None
        elif uuid is None:
            notes.append(f"GPU {index} ({address}) has its index device only: "
                         f"{info.uuid_problem}")
        found.append((index, uuid, info.minor))
    return found, notes


def hook(host: Host) -> str | None:
    return cdi.HOOK if host.is_executable_file(cdi.HOOK) else None


HOOK_LIMIT = 256 << 20  # the toolkit's hook is a Go program of some 5 MB


def has_command(host: Host, program: str, command: str) -> bool:
    """Whether the hook program knows `command`: its name is in the program's bytes (a Go
    program keeps its command names as strings). The hook is read, not run: an older hook
    (the toolkit before 1.17.5 has no enable-cuda-compat) exits non-zero on a command it
    does not know, which would fail every container the spec is used for, and a node under
    --root cannot run its programs here."""
    needle, tail, read = command.encode(), b"", 0
    try:
        for chunk in host.read_chunks(program):
            if needle in tail + chunk:
                return True
            tail, read = chunk[-len(needle):], read + len(chunk)
            if read > HOOK_LIMIT:
                return False
    except GpunodeError:
        return False
    return False


def generate(host: Host, prebuilt_dirs: tuple[str, ...] = DriverConfig.prebuilt_dirs,
             found: userspace.DriverRoot | None = None,
             capabilities: Collection[str] = CDI_CAPABILITIES) -> dict[str, Any]:
    """The spec for the node as it is now (the user-space searched as the driver step searches
    it, driver.prebuilt_dirs included, or `found`, the driver step's, when it is of the loaded
    version), mounting the driver's files of `capabilities` (the agent config's
    cdi.capabilities); DriverError when the driver or its user-space is missing."""
    version = driver_version(host)
    the_gpus = gpus(host)
    if not the_gpus:
        seen = driverinfo.read_gpu_infos(host)
        raise DriverError("no CDI spec: " + (
            f"none of the driver's {len(seen)} GPUs came up (each failed to initialize)"
            if seen else "the driver sees no GPU"), "look for NVRM errors in 'dmesg'")
    root = found if found is not None and found.version == version else \
        userspace.find(host, version, prebuilt_dirs=prebuilt_dirs)
    # Not the MIG capability nodes: they grant MIG config and monitor rights (and, for MIG
    # devices this spec does not have yet, per-instance access). The toolkit's own spec gives
    # them only in its "management" mode; its control nodes are nvidiactl, nvidia-uvm,
    # nvidia-uvm-tools and nvidia-modeset (nvidia-container-toolkit pkg/nvcdi/common-nvml.go).
    nodes = [n for n in devices.for_host(host)
             if not n.path.startswith(devices.CAPS_NODE_DIR + "/")]
    the_hook = hook(host)
    compat = the_hook is not None and has_command(host, the_hook, cdi.COMPAT_HOOK)
    return cdi.spec(nodes, the_gpus, root, the_hook, capabilities, compat)


def inputs() -> list[str]:
    """What the spec depends on beyond the driver step's inputs (its /proc files, device nodes
    and the directories of the user-space it found, userspace.watched): the IPC endpoints,
    the config files, the hook and the file itself."""
    return sorted({userspace.PERSISTENCED_SOCKET, userspace.FABRICMANAGER_SOCKET,
                   userspace.MPS_PIPE_DIR, cdi.HOOK, cdi.SPEC_PATH,
                   *(f"{d}/{rel}" for rel, _, _ in userspace.CONFIGS
                     for d in userspace.CONFIG_DIRS)})


def check_output(host: Host, output: str | None) -> str | None:
    """`cdi generate --output` names a file under --root: absolute, and not something other
    than a file (a usage error, exit 2, otherwise)."""
    if output is None:
        return None
    if not output.startswith("/") or output.endswith("/") or "\0" in output:
        raise UsageError(f"--output {output!r}: name an absolute file path on the node "
                         "(under --root), e.g. /var/run/cdi/nvidia.yaml",
                         hint="gpunode cdi generate --output /var/run/cdi/nvidia.yaml")
    try:
        st = host.stat(output)
    except GpunodeError as exc:
        raise UsageError(f"--output {output}: {exc}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"--output {output}: not a regular file; name the spec file to write")
    return output


def write(host: Host, path: str, data: bytes) -> bool:
    """Write the spec atomically when its bytes differ from the file's; True when written."""
    if host.read_optional_bytes(path) == data:
        return False
    host.write_atomic(path, data, mode=0o644, make_parents=True)
    return True


def written_by_gpunode(host: Host, path: str = cdi.SPEC_PATH) -> bool:
    data = host.read_optional_bytes(path)
    return data is not None and data.startswith(cdi.HEADER.encode())


# -- boot's cdi step (pipeline/boot.py): plan and apply decide with the same code ----------

NO_DRIVER = ("no CDI spec: the driver step failed, and the spec names the driver's device nodes "
             "and files", "fix what the driver step reports; the next boot writes the spec")


def _layout(document: dict[str, Any]) -> str:
    return "nvidia-cdi-hook" if document["containerEdits"].get("hooks") else "hook-free"


def preview(host: Host, has_gpus: bool,
            prebuilt_dirs: tuple[str, ...] = DriverConfig.prebuilt_dirs,
            found: userspace.DriverRoot | None = None,
            capabilities: Collection[str] = CDI_CAPABILITIES,
            ) -> tuple[str | None, dict[str, Any]]:
    """(what boot would do to the spec file, or None; the record's fields). With GPUs the spec
    is made from the node as it is now (DriverError when it cannot be); without, a spec
    gpunode wrote is removed."""
    path = cdi.SPEC_PATH
    if not has_gpus:
        ours = written_by_gpunode(host, path)
        return (f"remove {path}: the node has no GPU" if ours else None), {
            "path": path, "removed": ours, "data": None}
    document = generate(host, prebuilt_dirs, found, capabilities)
    data = cdi.render(document, "yaml")
    fields = {"path": path, "devices": len(document["devices"]), "layout": _layout(document),
              "cdi_version": document["cdiVersion"], "data": data}
    if host.read_optional_bytes(path) == data:
        return None, fields
    gpu_count = len(cdi.gpu_devices(document))
    by_uuid = sum(1 for d in document["devices"] if str(d["name"]).startswith("GPU-"))
    names = "index and UUID" if by_uuid == gpu_count else \
        f"index ({by_uuid} by UUID too: the others' UUIDs are not known yet)"
    return (f"write {path}: {gpu_count} GPU{'s' if gpu_count != 1 else ''} by {names}, "
            f"and all ({fields['layout']} layout)"), fields


def apply(host: Host, has_gpus: bool, record: dict[str, Any],
          prebuilt_dirs: tuple[str, ...] = DriverConfig.prebuilt_dirs,
          found: userspace.DriverRoot | None = None,
          capabilities: Collection[str] = CDI_CAPABILITIES) -> bool:
    """Write (or remove) the spec file as preview says; True when the node changed."""
    line, fields = preview(host, has_gpus, prebuilt_dirs, found, capabilities)
    data = fields.pop("data")
    record.update(fields)
    if line is None:
        return False
    if data is None:
        host.remove(cdi.SPEC_PATH)
        return True
    return write(host, cdi.SPEC_PATH, data)

