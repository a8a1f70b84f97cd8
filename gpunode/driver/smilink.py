"""The boot step `nvidia_smi` (kubernetes.stack = "gpu-operator"): the loaded driver's
nvidia-smi where the GPU Operator's validator looks for it.

With a pre-installed driver the validator runs `chroot /host <path>` for the first of
/usr/bin, /usr/sbin, /bin, /sbin and /opt/bin `/nvidia-smi` that resolves inside the host root
to a non-empty executable regular file (NVIDIA/gpu-operator cmd/nvidia-validator/main.go:
hostNvidiaSMISearchPaths, resolveHostNvidiaSMI, validateHostDriver). A Flatcar driver sysext
has it in /usr/bin and Flatcar's own layout in /opt/bin: nothing to do. A driver gpunode loads
from a prebuilt directory or its build cache has it in that root's bin/ (driver/userspace.py
DriverRoot.binaries), and /usr is read-only on Flatcar, so gpunode links /opt/bin/nvidia-smi
to it — only where nothing is there, or the link is gpunode's own (it points into a driver
root gpunode loads from). A validator path that would find another nvidia-smi first is
refused, naming it: the validator would run that one.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Any

from gpunode.errors import GpunodeError, NvidiaSmiError
from gpunode.host import Host

LINK = "/opt/bin/nvidia-smi"
VALIDATOR_PATHS = ("/usr/bin/nvidia-smi", "/usr/sbin/nvidia-smi", "/bin/nvidia-smi",
                   "/sbin/nvidia-smi", LINK)  # the validator's order (its WSL path aside)
NO_DRIVER = ("the driver step failed: there is no loaded driver whose nvidia-smi the GPU "
             "Operator's validator could run", "fix the driver step first (see its error)")


@dataclass(frozen=True)
class Plan:
    target: str  # the loaded driver's nvidia-smi
    found: str | None  # the path the validator runs now, None: none
    link: bool  # LINK is (re)pointed at target


def applies(ctx: Any) -> bool:
    """Only in the gpu-operator stack, on a node with GPUs (boot.STEPS)."""
    return (ctx.detection is not None and bool(ctx.detection.gpus)
            and ctx.config.kubernetes.stack == "gpu-operator")


def plan(host: Host, binaries: tuple[str, ...], root: str,
         own_roots: tuple[str, ...]) -> Plan:
    """What makes the validator run the loaded driver's nvidia-smi (`binaries` of its driver
    root `root`); `own_roots` are the directories whose links are gpunode's own."""
    target = next((b for b in binaries if b.rpartition("/")[2] == "nvidia-smi"), None)
    if target is None:
        raise NvidiaSmiError(f"the loaded driver's user-space ({root}) has no nvidia-smi: the "
                             "GPU Operator's validator cannot check the driver",
                             hint="use a driver build whose user-space includes nvidia-smi")
    found = reachable(host)
    if found is not None and _same(host, found, target):
        return Plan(target, found, False)
    if found is not None and found != LINK:
        raise NvidiaSmiError(f"the GPU Operator's validator would run {host.display(found)}, "
                             f"which is not the loaded driver's nvidia-smi ({target})")
    current = host.read_link(LINK)
    if host.lstat(LINK) is not None and not (current is not None and _own(current, own_roots)):
        what = f"a link to {current}" if current is not None else "not a link"
        raise NvidiaSmiError(f"{host.display(LINK)} is not gpunode's ({what}), so gpunode "
                             f"cannot point it at the loaded driver's {target}",
                             hint=f"remove {LINK}; gpunode then links it to the loaded driver's "
                             "nvidia-smi")
    return Plan(target, found, True)


def apply(host: Host, the_plan: Plan) -> bool:
    if the_plan.link:
        host.symlink(LINK, the_plan.target)
    return the_plan.link


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


def _same(host: Host, path: str, other: str) -> bool:
    a, b = host.stat(path), host.stat(other)
    return a is not None and b is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _own(target: str, own_roots: tuple[str, ...]) -> bool:
    return target.rpartition("/")[2] == "nvidia-smi" and any(
        target.startswith(root.rstrip("/") + "/") for root in own_roots)


# -- the boot step (boot.STEPS) ------------------------------------------------------------------


def _own_roots(ctx: Any) -> tuple[str, ...]:
    from gpunode.driver import cache

    return (cache.CACHE_ROOT, *ctx.config.driver.prebuilt_dirs)


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
            raise NvidiaSmiError(f"no loaded driver whose nvidia-smi could be linked: {why}")
    return plan(ctx.host, found.binaries, found.root, _own_roots(ctx))


def step_plan(ctx: Any) -> list[str]:
    the_plan = _plan_now(ctx, planning=True)
    if the_plan is None:
        return [f"link {LINK} to the loaded driver's nvidia-smi where the GPU Operator's "
                "validator does not find it, once the driver step has loaded the driver"]
    return [f"link {LINK} → {the_plan.target}: the GPU Operator's validator looks there"] \
        if the_plan.link else []


def step_apply(ctx: Any, fields: dict[str, Any]) -> bool:
    the_plan = _plan_now(ctx, planning=False)
    assert the_plan is not None  # only a plan may wait for the driver step
    changed = apply(ctx.host, the_plan)
    fields.update(nvidia_smi=the_plan.target, validator_runs=LINK if changed else the_plan.found)
    return changed


def step_inputs(ctx: Any) -> list[str]:
    """Every validator path: a new nvidia-smi ahead of the link, or the link gone, re-runs."""
    return list(VALIDATOR_PATHS)
