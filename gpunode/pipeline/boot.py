"""`gpunode plan` and `gpunode boot`: one list of steps, walked to plan and to boot.

Each step (STEPS) says when it applies, what it would do as the node is now (`plan`: action
lines, nothing touched) and how it does it (`apply`: fills the step's record fields and says
whether it changed the node). `plan`, `boot` and the boot record (/run/gpunode/state.json, for
`gpunode status`) all walk this one list, so they cannot disagree about which steps run or in
which order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from gpunode import log
from gpunode.config import AgentConfig
from gpunode.driver import smilink
from gpunode.driver.modules import Kmod
from gpunode.errors import ConflictError, DriverError, GpunodeError
from gpunode.gpu import init as gpu_init
from gpunode.gpu.detect import Detection, detect, require_decided
from gpunode.pipeline import state
from gpunode.platform import flatcar, timestamps
from gpunode.platform.host import Host
from gpunode.platform.systemd import Systemd


@dataclass(frozen=True)
class Action:
    """One line of what a step would do, as `gpunode plan` shows it."""

    step: str
    description: str


@dataclass
class BootRun:
    """One boot as it runs: what its boot record will say."""

    started_at: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    outcome: str = "ok"


@dataclass(frozen=True)
class Adapters:
    """Everything the pipeline asks of the outside world, in one place for tests to replace."""

    systemd: Systemd
    kmod: Kmod
    build: Any = None  # (fetcher, builder) for the build strategy
    probe: Any = None  # what the containerd binary says (containerd.probe); None: by the host
    gpus: Any = None  # who brings the GPUs up (gpu/initializers.py); None: nobody (--root)


def adapters_for(host: Host, config: AgentConfig) -> Adapters:
    from gpunode.containerd.probe import CommandProbe, NoProbe
    from gpunode.driver.modules import KmodTools
    from gpunode.driver.step import LazyBuildAdapters
    from gpunode.gpu import initializers
    from gpunode.platform.systemd import for_host

    systemd = for_host(host.is_live)
    return Adapters(systemd=systemd, kmod=KmodTools(may_load=host.is_live),
                    build=LazyBuildAdapters(config.driver.build, host),
                    probe=CommandProbe() if host.is_live else NoProbe(),
                    gpus=initializers.for_host(host, systemd))


@dataclass(frozen=True)
class Problem:
    """A step boot would attempt and that would fail as the node is now."""

    step: str
    error: str
    hint: str | None
    code: str  # the error's stable code (gpunode.errors), as the boot record would carry it


@dataclass(frozen=True)
class Plan:
    """What `gpunode plan` answers: what boot would do as the node is now, and what would fail."""

    detection: Detection | None  # None when boot would stop before detecting (preflight)
    actions: list[Action]
    problems: list[Problem]


@dataclass
class Context:
    """What the steps of one plan or boot share: the node, and what earlier steps found."""

    host: Host
    config: AgentConfig
    adapters: Adapters
    detection: Detection | None = None
    found: dict[str, Any] = field(default_factory=dict)  # a step's apply → its inputs
    failed: set[str] = field(default_factory=set)  # the steps that failed (or would) so far


def _has_gpus(ctx: Context) -> bool:
    return ctx.detection is not None and bool(ctx.detection.gpus)


@dataclass(frozen=True)
class Step:
    """One step of the pipeline: plan and apply wrap the step module's own API (driver/step.py,
    containerd/step.py, kube/registration.py), so plan and boot decide with the same code."""

    name: str
    plan: Callable[[Context], list[str]]  # what apply would do; a GpunodeError: a Problem
    apply: Callable[[Context, dict[str, Any]], bool]  # fills the record fields; True: changed
    applies: Callable[[Context], bool] = lambda ctx: True
    gate: bool = False  # when it fails, boot stops there (the later steps need it)
    observes: bool = False  # plan is computed from it: when it fails there is no plan
    quiet: bool = False  # a check: logged and recorded only when it fails
    # What boot starts once the step succeeded, to run while the later steps work (outside
    # the step's record and duration)
    then: Callable[[Context], None] | None = None


# -- preflight: this boot, this config, and nobody else installing a driver ---------------------

def _refuse_flatcar_nvidia(host: Host, systemd: Systemd) -> None:
    """Flatcar's own nvidia.service compiles and installs a driver too: never both at once.

    Where no service manager answers on a live host (a chroot, a container) nobody can say
    whether it runs: that is logged, and boot goes on. Under --root (a mounted image, a
    fixture) the tree's own unit files say whether it is enabled: a `*.wants/` link, unless a
    mask to /dev/null overrides it."""
    from gpunode.platform.systemd_unit import enabled_by_links

    state = systemd.active_state(flatcar.NVIDIA_UNIT)
    enabled = systemd.enabled(flatcar.NVIDIA_UNIT) or (
        not host.is_live and enabled_by_links(host, flatcar.NVIDIA_UNIT))
    if host.is_live and not systemd.available:  # known only once it was asked
        log.get().warning("boot.preflight_unchecked", unit=flatcar.NVIDIA_UNIT,
                          reason=systemd.unavailable_reason,
                          note=f"could not check that Flatcar's {flatcar.NVIDIA_UNIT} is not "
                          "running or enabled; mask it where gpunode installs the driver")
        return
    if state in ("active", "activating") or enabled:
        raise ConflictError(f"Flatcar's {flatcar.NVIDIA_UNIT} is {state} and "
                            f"{'enabled' if enabled else 'not enabled'}: it installs the driver "
                            "its own way, and gpunode will not race it",
                            hint=f"mask it: 'systemctl mask {flatcar.NVIDIA_UNIT}' (gpunode's "
                            "Ignition snippet does this), then reboot")


def _preflight_plan(ctx: Context) -> list[str]:
    _refuse_flatcar_nvidia(ctx.host, ctx.adapters.systemd)
    return []


def _preflight_apply(ctx: Context, fields: dict[str, Any]) -> bool:
    _refuse_flatcar_nvidia(ctx.host, ctx.adapters.systemd)
    return False


# -- detect ---------------------------------------------------------------------------------------


def _detect_plan(ctx: Context) -> list[str]:
    ctx.detection = detect(ctx.host, use_udev=ctx.config.detect.use_udev)
    require_decided(ctx.detection)  # a possible GPU nobody can identify is not "no-gpu"
    return []


def _detect_apply(ctx: Context, fields: dict[str, Any]) -> bool:
    ctx.detection = detection = detect(ctx.host, use_udev=ctx.config.detect.use_udev)
    fields.update(gpus=len(detection.gpus), functions=len(detection.functions))
    require_decided(detection)
    return False


def _locate_containerd(ctx: Context) -> None:
    """A GPU node: containerd's config located now, its probes started, so that they run
    while preflight, driver and cdi work (containerd/locate.py)."""
    if _has_gpus(ctx):
        from gpunode.containerd import locate

        ctx.found["located"] = locate.early(ctx.host, ctx.config.containerd,
                                            ctx.adapters.systemd, ctx.adapters.probe)


# -- driver ---------------------------------------------------------------------------------------


def _driver_plan(ctx: Context) -> list[str]:
    from gpunode.driver import step as driver

    assert ctx.detection is not None  # detect ran: the GPU steps apply only after it
    the_plan = driver.plan(ctx.host, ctx.config.driver, ctx.detection, ctx.adapters.kmod)
    ctx.found["driver_changes"] = the_plan.changed
    return the_plan.describe() if the_plan.changed else []


def _driver_apply(ctx: Context, fields: dict[str, Any]) -> bool:
    from gpunode.driver import step as driver

    assert ctx.detection is not None
    the_plan = driver.plan(ctx.host, ctx.config.driver, ctx.detection, ctx.adapters.kmod)
    if the_plan.baked is not None:  # the sysext it merges could bring containerd drop-ins:
        ctx.found.pop("located", None)  # the containerd step locates after it, and probes
        if ctx.adapters.probe is not None:
            ctx.adapters.probe.discard()
    fields.update(strategy=the_plan.choice.strategy, flavour=the_plan.flavour.flavour,
                  action=the_plan.choice.action, reason=the_plan.choice.reason)
    outcome = driver.apply(ctx.host, the_plan, ctx.config.driver, ctx.adapters.kmod,
                           ctx.adapters.build)
    fields.update(outcome.fields())
    ctx.found["driver_root"] = outcome.driver_root
    return (bool(outcome.loaded or outcome.nodes) or the_plan.sysext_line is not None
            or the_plan.choice.action == "build")


# -- cdi: the node's CDI spec, from the driver as the driver step left it -------------------------
def _cdi_applies(ctx: Context) -> bool:
    """With GPUs; without, only to remove a spec gpunode wrote (a GPU gone since)."""
    from gpunode.cdi import node as cdinode

    return _has_gpus(ctx) or (ctx.detection is not None and cdinode.written_by_gpunode(ctx.host))


def _cdi_plan(ctx: Context) -> list[str]:
    from gpunode.cdi import node as cdinode
    from gpunode.cdi import spec as cdi

    if "driver" in ctx.failed:
        raise DriverError(*cdinode.NO_DRIVER)
    try:
        line, _ = cdinode.preview(ctx.host, _has_gpus(ctx), ctx.config.driver.prebuilt_dirs,
                                  capabilities=ctx.config.cdi.wanted)
    except DriverError:
        if not ctx.found.get("driver_changes"):
            raise
        # the driver step loads the driver first: the spec is made from it then
        return [f"write {cdi.SPEC_PATH} once the driver step has loaded the driver"]
    return [line] if line else []


def _cdi_apply(ctx: Context, fields: dict[str, Any]) -> bool:
    from gpunode.cdi import node as cdinode

    if "driver" in ctx.failed:
        raise DriverError(*cdinode.NO_DRIVER)
    return cdinode.apply(ctx.host, _has_gpus(ctx), fields, ctx.config.driver.prebuilt_dirs,
                         ctx.found.get("driver_root"),  # the driver step's, found just now
                         ctx.config.cdi.wanted)


# -- containerd -----------------------------------------------------------------------------------


def _containerd_plan(ctx: Context) -> list[str]:
    from gpunode.containerd import step as containerd

    # While an interrupted change is pending, boot rolls it back first: say so.
    the_plan = containerd.preview(ctx.host, ctx.config.containerd, ctx.adapters.systemd,
                                  probe=ctx.adapters.probe)
    return the_plan.describe() if the_plan.changed else []


def _containerd_apply(ctx: Context, fields: dict[str, Any]) -> bool:
    from gpunode.containerd import journal
    from gpunode.containerd import step as containerd

    # An interrupted earlier run is rolled back first (a change, even when the plan from the
    # rolled-back files then changes nothing), then planned and applied.
    # The step fills config, planned_change and changed as they happen (step.apply).
    c = ctx.config.containerd
    rolls_back = journal.pending(ctx.host)
    the_plan, outcome = containerd.configure(ctx.host, c, ctx.adapters.systemd,
                                             c.restart_timeout, report=fields,
                                             probe=ctx.adapters.probe,
                                             located=ctx.found.get("located"))
    fields.update(restarted=outcome.restarted)
    ctx.found["containerd"] = the_plan
    return outcome.changed or rolls_back


# -- registration: the kubelet registers with the GPU taint and label ----------------------------


def _registration_applies(ctx: Context) -> bool:
    return _has_gpus(ctx) and ctx.config.kubernetes.register_with == "kubelet"


def _dropin(ctx: Context) -> tuple[str | None, str]:
    from gpunode.kube import registration

    k = ctx.config.kubernetes
    return registration.plan_kubelet_dropin(ctx.host, k.taints, dict(k.labels), k.stack)


def _registration_plan(ctx: Context) -> list[str]:
    text, why = _dropin(ctx)
    return [f"{why}: the kubelet registers with the GPU taint and labels"] \
        if text is not None else []


def _registration_apply(ctx: Context, fields: dict[str, Any]) -> bool:
    """The drop-in is written before the kubelet first starts (registration.py says why)."""
    from gpunode.kube import registration

    text, why = _dropin(ctx)
    fields.update(reason=why)
    if text is not None:
        fields.update(registration.write_kubelet_dropin(ctx.host, text, ctx.adapters.systemd))
    return text is not None


# Boot walks them in this order. Each step after preflight is attempted even when an earlier one
# failed: the runtime config does not need the driver, and the record names every problem at
# once. A failed gate (detect, preflight) stops the boot there.
STEPS: tuple[Step, ...] = (
    Step("detect", _detect_plan, _detect_apply, gate=True, observes=True,
         then=_locate_containerd),
    # Only where there is a GPU for two drivers to race over: a CPU node's boot is decided
    # from sysfs alone (pipeline/shortcut.py), without asking systemd anything.
    Step("preflight", _preflight_plan, _preflight_apply, applies=_has_gpus,
         gate=True, quiet=True),
    Step("driver", _driver_plan, _driver_apply, applies=_has_gpus),
    Step("nvidia_smi", smilink.step_plan, smilink.step_apply, applies=smilink.applies),
    # The GPUs brought up (persistenced, or one open each) and waited for: the spec names each
    # by its UUID, which the driver knows only then (gpu/init.py).
    Step("gpu_init", gpu_init.step_plan, gpu_init.step_apply, applies=_has_gpus),
    Step("cdi", _cdi_plan, _cdi_apply, applies=_cdi_applies),
    Step("containerd", _containerd_plan, _containerd_apply, applies=_has_gpus),
    Step("registration", _registration_plan, _registration_apply,
         applies=_registration_applies),
)


# -- the walks ------------------------------------------------------------------------------------


def plan(host: Host, config: AgentConfig, adapters: Adapters) -> Plan:
    """What boot would do, step by step. A step that could not be done (no driver source, a
    refused containerd config, Flatcar's nvidia.service running) is part of the answer, not a
    failure to answer: the plan names every problem boot would record. Only a failed detection
    is a failure to answer (nobody can say which steps apply)."""
    ctx = Context(host, config, adapters)
    actions: list[Action] = []
    problems: list[Problem] = []
    for step in STEPS:
        if not step.applies(ctx):
            continue
        try:
            actions.extend(Action(step.name, line) for line in step.plan(ctx))
        except GpunodeError as exc:
            if step.observes:
                raise
            problems.append(Problem(step.name, str(exc), exc.hint or None, exc.code))
            ctx.failed.add(step.name)
            if step.gate:
                break
    return Plan(ctx.detection, actions, problems)


def boot(host: Host, config: AgentConfig, adapters: Adapters,
         recorded: Callable[[BootRun], None] | None = None) -> BootRun:
    """Every step that applies, then the record; `recorded` is called as soon as that is written
    (cli/commands.py boot: gpunode.service's READY=1)."""
    run = BootRun(started_at=_now())
    ctx = Context(host, config, adapters)
    for step in STEPS:
        if not step.applies(ctx):
            continue
        try:
            with _recorded(run, step) as fields:
                changed = step.apply(ctx, fields)
                if not step.quiet:
                    fields.update(changed=changed)
        except GpunodeError:
            run.outcome = "failed"  # recorded and logged by _recorded
            ctx.failed.add(step.name)
            if step.gate:
                break
            continue
        if step.then is not None:
            step.then(ctx)
    if run.outcome != "failed" and not _has_gpus(ctx):
        run.outcome = "no-gpu"
    if adapters.probe is not None:  # a program started early and never asked (locate.early)
        adapters.probe.discard()
    write_record(host, run)
    if recorded is not None:
        recorded(run)
    return run


@contextmanager
def _recorded(run: BootRun, step: Step) -> Iterator[dict[str, Any]]:
    """A log.step whose outcome, duration and fields also go into the boot record (a quiet
    step: only when it fails)."""
    start = time.perf_counter()
    entry: dict[str, Any] = {"name": step.name, "outcome": "ok", "duration_ms": 0.0,
                             "error": None, "hint": None, "code": None}
    fields: dict[str, Any] = {}
    try:
        with (nullcontext(fields) if step.quiet else log.step(step.name)) as fields:
            yield fields
    except GpunodeError as exc:
        if step.quiet:
            log.get().error("step.failed", step=step.name, exc=exc)
        entry.update(outcome="failed", error=str(exc), hint=exc.hint or None, code=exc.code)
        raise
    finally:
        entry["duration_ms"] = round((time.perf_counter() - start) * 1000, 2)
        if not step.quiet or entry["outcome"] == "failed":
            run.steps.append({**entry, **fields})


def write_record(host: Host, run: BootRun) -> None:
    host.write_atomic(state.STATE_PATH, state.render(run.started_at, _now(), run.outcome,
                                                     run.steps), make_parents=True)


def _now() -> str:
    return timestamps.utc_timestamp()
