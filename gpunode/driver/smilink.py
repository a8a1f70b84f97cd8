"""The boot step `nvidia_smi` (kubernetes.stack = "gpu-operator"): the loaded driver's
nvidia-smi where the GPU Operator's validator looks for it.

With a pre-installed driver the validator runs `chroot /host <path>` for the first of
/usr/bin, /usr/sbin, /bin, /sbin and /opt/bin `/nvidia-smi` that resolves inside the host root
to a non-empty executable regular file (NVIDIA/gpu-operator cmd/nvidia-validator/main.go:
hostNvidiaSMISearchPaths, resolveHostNvidiaSMI, validateHostDriver). A Flatcar driver sysext
has it in /usr/bin and Flatcar's own layout in /opt/bin: nothing to do. A driver gpunode loads
from a prebuilt directory or its build cache has it in that root's bin/ and its libraries in
the root's lib/ (driver/userspace.py DriverRoot), where neither the validator nor the dynamic
loader looks, and /usr is read-only on Flatcar. So gpunode writes /opt/bin/nvidia-smi: a
small script that runs the driver root's nvidia-smi with the root's library directory on
LD_LIBRARY_PATH (nvidia-smi loads libnvidia-ml at run time) — only where nothing is there or
the file is gpunode's own (MARKER on its second line). A validator path that would find another
nvidia-smi first is refused, naming it: the validator would run that one.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Any

from gpunode.errors import GpunodeError, NvidiaSmiError
from gpunode.platform.host import Host

WRAPPER = "/opt/bin/nvidia-smi"
VALIDATOR_PATHS = ("/usr/bin/nvidia-smi", "/usr/sbin/nvidia-smi", "/bin/nvidia-smi",
                   "/sbin/nvidia-smi", WRAPPER)  # the validator's order (its WSL path aside)
MARKER = "# gpunode: the loaded driver's nvidia-smi, for the GPU Operator's validator"
NO_DRIVER = ("the driver step failed: there is no loaded driver whose nvidia-smi the GPU "
             "Operator's validator could run", "fix the driver step first (see its error)")


@dataclass(frozen=True)
class Plan:
    """What makes the GPU Operator's validator run the loaded driver's nvidia-smi."""

    target: str  # the loaded driver's nvidia-smi
    found: str | None  # the path the validator runs now, None: none
    script: str | None  # what WRAPPER is (re)written with; None: nothing to write


def applies(ctx: Any) -> bool:
    """Only in the gpu-operator stack, on a node with GPUs (boot.STEPS)."""
    return (ctx.detection is not None and bool(ctx.detection.gpus)
            and ctx.config.kubernetes.stack == "gpu-operator")


def wrapper(target: str, library_dir: str) -> str:
    return (f"#!/bin/sh\n{MARKER}\nLD_LIBRARY_PATH={_quoted(library_dir)}\n"
            f"export LD_LIBRARY_PATH\nexec {_quoted(target)} \"$@\"\n")


def plan(host: Host, binaries: tuple[str, ...], libraries: tuple[str, ...], root: str) -> Plan:
    """What makes the validator run the loaded driver's nvidia-smi (of the driver root `root`
    with these `binaries` and `libraries`)."""
    target = next((b for b in binaries if b.rpartition("/")[2] == "nvidia-smi"), None)
    if target is None:
        raise NvidiaSmiError(f"the loaded driver's user-space ({root}) has no nvidia-smi: the "
                             "GPU Operator's validator cannot check the driver",
                             hint="use a driver build whose user-space includes nvidia-smi")
    found = reachable(host)
    if found is not None and _same(host, found, target):
        return Plan(target, found, None)
    if found is not None and found != WRAPPER:
        raise NvidiaSmiError(f"the GPU Operator's validator would run {host.display(found)}, "
                             f"which is not the loaded driver's nvidia-smi ({target})")
    nvml = next((lib for lib in libraries
                 if lib.rpartition("/")[2].startswith("libnvidia-ml.so.")), target)
    script = wrapper(target, nvml.rpartition("/")[0])
    current = _own_script(host)
    if current is None and host.lstat(WRAPPER) is not None:
        raise NvidiaSmiError(f"{host.display(WRAPPER)} is not gpunode's, so gpunode cannot make "
                             f"it run the loaded driver's {target}",
                             hint=f"remove {WRAPPER}; gpunode then writes it to run the loaded "
                             "driver's nvidia-smi")
    if current == script and found == WRAPPER:
        return Plan(target, found, None)
    return Plan(target, found, script)


def apply(host: Host, the_plan: Plan) -> bool:
    if the_plan.script is None:
        return False
    host.remove(WRAPPER)  # gpunode's own or nothing (plan): written anew, executable
    host.write_atomic(WRAPPER, the_plan.script.encode(), mode=0o755, make_parents=True)
    return True


def reachable(host: Host) -> str | None:
    """The first validator path that resolves to a non-empty executable regular file."""
    for path in VALIDATOR_PATHS:
        try:
            st = host.stat(path)
        except GpunodeError:  # a link loop or an unsearchable directory: the validator skips it
            continue
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size and st.st_mode & 0o111:
            return path
    return None


def _own_script(host: Host) -> str | None:
    """WRAPPER's text when it is a regular file gpunode wrote (MARKER on its second line)."""
    st = host.lstat(WRAPPER)
    if st is None or not stat.S_ISREG(st.st_mode):
        return None
    try:
        text = host.read_text(WRAPPER, limit=4096)
    except GpunodeError:  # larger, or not text: not gpunode's
        return None
    return text if text.split("\n")[1:2] == [MARKER] else None


def _same(host: Host, path: str, other: str) -> bool:
    a, b = host.stat(path), host.stat(other)
    return a is not None and b is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _quoted(path: str) -> str:
    return "'" + path.replace("'", "'\\''") + "'"


# -- the boot step (boot.STEPS) ------------------------------------------------------------------


def _plan_now(ctx: Any, planning: bool) -> Plan | None:
    """The plan for the driver loaded now (as the driver step found it, in a boot); None when
    planning and the driver step would load it first."""
    from gpunode.driver import userspace

    if "driver" in ctx.failed:
        raise NvidiaSmiError(*NO_DRIVER)
    found = ctx.found.get("driver_root")
    if found is None:
        found, why = userspace.loaded_root(ctx.host, ctx.config.driver.prebuilt_dirs)
        if found is None:
            if planning and ctx.found.get("driver_changes"):
                return None
            raise NvidiaSmiError(f"no loaded driver whose nvidia-smi the validator could run: "
                                 f"{why}")
    return plan(ctx.host, found.binaries, found.libraries, found.root)


def step_plan(ctx: Any) -> list[str]:
    the_plan = _plan_now(ctx, planning=True)
    if the_plan is None:
        return [f"write {WRAPPER} to run the loaded driver's nvidia-smi where the GPU "
                "Operator's validator does not find it, once the driver step has loaded it"]
    return [f"write {WRAPPER} to run {the_plan.target}: the GPU Operator's validator looks "
            "there"] if the_plan.script is not None else []


def step_apply(ctx: Any, fields: dict[str, Any]) -> bool:
    the_plan = _plan_now(ctx, planning=False)
    assert the_plan is not None  # only a plan may wait for the driver step
    changed = apply(ctx.host, the_plan)
    fields.update(nvidia_smi=the_plan.target, validator_runs=WRAPPER if changed else the_plan.found)
    return changed

