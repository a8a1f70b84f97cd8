"""`gpunode plan` and `gpunode boot`: the pipeline's steps in order, and the boot record.

plan: observe and decide, touch nothing. boot: the same decisions, applied, each step timed
and recorded in /run/gpunode/state.json for `gpunode status`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpunode import log
from gpunode.config import DEFAULT_CONFIG_PATH, AgentConfig
from gpunode.detect import Detection, detect, require_decided
from gpunode.driver.modules import Kmod
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.state import SCHEMA_VERSION, STATE_PATH
from gpunode.systemd import Systemd


@dataclass(frozen=True)
class Action:
    step: str
    description: str


@dataclass
class BootRun:
    started_at: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    outcome: str = "ok"
    watched: list[str] = field(default_factory=list)  # what a no-op boot must find unchanged


# Inputs every boot depends on, whatever the node: the agent config, the PCI functions, the
# kernel and this boot.
BASE_INPUTS = ("/etc/gpunode/config.toml", "/sys/bus/pci/devices",
               "/proc/sys/kernel/osrelease", "/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Adapters:
    """Everything the pipeline asks of the outside world, in one place for tests to replace."""

    systemd: Systemd
    kmod: Kmod
    build: Any = None  # (fetcher, builder) for the build strategy


def adapters_for(host: Host, config: AgentConfig) -> Adapters:
    from gpunode.driver import builders
    from gpunode.driver.modules import KmodTools
    from gpunode.systemd import for_host

    return Adapters(systemd=for_host(host.is_live), kmod=KmodTools(may_load=host.is_live),
                    build=builders.default_adapters(config.driver.build, host))


@dataclass(frozen=True)
class Problem:
    """A step boot would attempt and that would fail as the node is now."""

    step: str
    error: str
    hint: str | None


@dataclass(frozen=True)
class Plan:
    detection: Detection
    actions: list[Action]
    problems: list[Problem]


def plan(host: Host, config: AgentConfig, adapters: Adapters) -> Plan:
    """What boot would do, step by step. A step that could not be done (no driver source, a
    refused containerd config) is part of the answer, not a failure to answer: boot attempts
    each step anyway, and so the plan names every problem at once."""
    from gpunode.containerd import step as containerd
    from gpunode.driver import step as driver

    detection = detect(host, use_udev=config.detect.use_udev)
    require_decided(detection)
    result = Plan(detection, [], [])
    if not detection.gpus:
        return result

    def driver_actions() -> list[str]:
        the_plan = driver.plan(host, config.driver, detection, adapters.kmod)
        return the_plan.describe() if the_plan.changed else []

    def containerd_actions() -> list[str]:
        # While an interrupted change is pending, boot rolls it back first: say so.
        the_plan = containerd.preview(host, config.containerd, adapters.systemd)
        return the_plan.describe() if the_plan.changed else []

    def registration_actions() -> list[str]:
        from gpunode.kube import registration

        k = config.kubernetes
        text, why = registration.plan_kubelet_dropin(host, k.taints, dict(k.labels))
        return [f"{why}: the kubelet registers with the GPU taint and labels"] \
            if text is not None else []

    steps = [("driver", driver_actions), ("containerd", containerd_actions)]
    if config.kubernetes.register_with == "kubelet":
        steps.append(("registration", registration_actions))
    for name, describe in steps:
        try:
            result.actions.extend(Action(name, line) for line in describe())
        except GpunodeError as exc:
            result.problems.append(Problem(name, str(exc), exc.hint or None))
    return result


FLATCAR_NVIDIA_UNIT = "nvidia.service"


class ConflictError(GpunodeError):
    hint = (f"mask it: 'systemctl mask {FLATCAR_NVIDIA_UNIT}' (gpunode's Ignition snippet does "
            "this), then reboot")


def _refuse_flatcar_nvidia(host: Host, systemd: Systemd) -> None:
    """Flatcar's own nvidia.service compiles and installs a driver too: never both at once.

    Where no service manager answers (an image build, a chroot, a container) nobody can say
    whether it runs: that is logged, and boot goes on."""
    state = systemd.active_state(FLATCAR_NVIDIA_UNIT)
    enabled = systemd.enabled(FLATCAR_NVIDIA_UNIT)
    if host.is_live and not systemd.available:  # known only once it was asked
        log.get().warning("boot.preflight_unchecked", unit=FLATCAR_NVIDIA_UNIT,
                          reason=systemd.unavailable_reason,
                          note=f"could not check that Flatcar's {FLATCAR_NVIDIA_UNIT} is not "
                          "running or enabled; mask it where gpunode installs the driver")
        return
    if state in ("active", "activating") or enabled:
        raise ConflictError(f"Flatcar's {FLATCAR_NVIDIA_UNIT} is {state} and "
                            f"{'enabled' if enabled else 'not enabled'}: it installs the driver "
                            "its own way, and gpunode will not race it")


def boot(host: Host, config: AgentConfig, adapters: Adapters) -> BootRun:
    run = BootRun(started_at=_now())
    try:
        _refuse_flatcar_nvidia(host, adapters.systemd)
    except ConflictError as exc:
        log.get().error("step.failed", step="preflight", exc=exc)
        run.steps.append({"name": "preflight", "outcome": "failed", "duration_ms": 0.0,
                          "error": str(exc), "hint": exc.hint})
        run.outcome = "failed"
        write_record(host, run)
        return run
    try:
        with _recorded(run, "detect") as fields:
            detection = detect(host, use_udev=config.detect.use_udev)
            fields.update(gpus=len(detection.gpus), functions=len(detection.functions))
            require_decided(detection)  # a possible GPU nobody can identify is not "no-gpu"
    except GpunodeError:
        run.outcome = "failed"  # recorded and logged by _recorded
        write_record(host, run)
        return run
    if not detection.gpus:
        run.outcome = "no-gpu"
    else:
        # Each step is attempted even when an earlier one failed: the runtime config does not
        # need the driver, and the record then names every problem at once.
        _step(run, "driver", lambda fields: _driver(host, config, detection, adapters, fields,
                                                    run.watched))
        _step(run, "containerd", lambda fields: _containerd(host, config, adapters, fields,
                                                            run.watched))
        if config.kubernetes.register_with == "kubelet":
            _step(run, "registration", lambda fields: _registration(host, config, adapters,
                                                                    fields, run.watched))
    write_record(host, run)
    if run.outcome != "failed":
        _write_stamp(host, run, config)
    return run


def _write_stamp(host: Host, run: BootRun, config: AgentConfig) -> None:
    """Inputs of this successful boot, for the no-op fast path (gpunode/fastpath.py)."""
    from gpunode import __version__, fastpath

    if config.source not in ("defaults", host.display(DEFAULT_CONFIG_PATH)):
        return  # --config elsewhere: the fast path does not apply
    stamp = fastpath.compute(str(host.root), [*BASE_INPUTS, *run.watched], __version__, None)
    host.make_dirs(fastpath.STAMP.rpartition("/")[0])
    host.write_atomic(fastpath.STAMP, (json.dumps(stamp) + "\n").encode())


def _step(run: BootRun, name: str, action: Callable[[dict[str, Any]], None]) -> None:
    try:
        with _recorded(run, name) as fields:
            action(fields)
    except GpunodeError:
        run.outcome = "failed"  # recorded and logged by _recorded; boot goes on to the record


def _driver(host: Host, config: AgentConfig, detection: Detection, adapters: Adapters,
            fields: dict[str, Any], watched: list[str]) -> None:
    from gpunode.driver import step as driver

    the_plan = driver.plan(host, config.driver, detection, adapters.kmod)
    fields.update(strategy=the_plan.choice.strategy, flavour=the_plan.flavour.flavour,
                  action=the_plan.choice.action, reason=the_plan.choice.reason)
    outcome = driver.apply(host, the_plan, config.driver, adapters.kmod, adapters.build)
    fields.update(outcome.fields())
    watched += ["/proc/driver/nvidia/version", "/proc/driver/nvidia/gpus",
                *(node.path for node in driver.wanted_nodes(host))]


def _registration(host: Host, config: AgentConfig, adapters: Adapters,
                  fields: dict[str, Any], watched: list[str]) -> None:
    """The kubelet registers with the GPU taint and label (written before it first starts)."""
    from gpunode.kube import registration

    k = config.kubernetes
    text, why = registration.plan_kubelet_dropin(host, k.taints, dict(k.labels))
    fields.update(changed=text is not None, reason=why)
    if text is not None:
        host.make_dirs(registration.KUBELET_DROPIN.rpartition("/")[0])
        host.write_atomic(registration.KUBELET_DROPIN, text.encode())
        if adapters.systemd.available:
            adapters.systemd.daemon_reload()
        else:
            fields.update(daemon_reload=f"skipped: {adapters.systemd.unavailable_reason}; the "
                          "kubelet's service manager reads the drop-in when it next loads units")
    watched += [registration.KUBELET_DROPIN, registration.KUBELET_CLIENT_CERT]


def _containerd(host: Host, config: AgentConfig, adapters: Adapters,
                fields: dict[str, Any], watched: list[str]) -> None:
    from gpunode.containerd import step as containerd
    from gpunode.systemd_unit import SYSTEM_UNIT_PATHS

    # An interrupted earlier run is rolled back first, then planned and applied.
    # The step fills config, planned_change and changed as they happen (step.apply).
    the_plan, outcome = containerd.configure(host, config.containerd, adapters.systemd,
                                             config.containerd.restart_timeout, report=fields)
    fields.update(restarted=outcome.restarted)
    watched += [the_plan.active.path, the_plan.target, containerd.DROPIN, containerd.LEDGER,
                containerd.JOURNAL, containerd.IMPORT_FILE,
                "/etc/systemd/system/containerd.service.d",
                "/etc/containerd/conf.d", config.containerd.runtime_path,
                *(f"{d}/containerd.service" for d in SYSTEM_UNIT_PATHS)]


@contextmanager
def _recorded(run: BootRun, name: str) -> Iterator[dict[str, Any]]:
    """A log.step whose outcome, duration and fields also go into the boot record."""
    start = time.perf_counter()
    entry: dict[str, Any] = {"name": name, "outcome": "ok", "duration_ms": 0.0, "error": None,
                             "hint": None}
    fields: dict[str, Any] = {}
    try:
        with log.step(name) as fields:
            yield fields
    except GpunodeError as exc:
        entry.update(outcome="failed", error=str(exc), hint=exc.hint or None)
        raise
    finally:
        entry["duration_ms"] = round((time.perf_counter() - start) * 1000, 2)
        run.steps.append({**entry, **fields})


def write_record(host: Host, run: BootRun) -> None:
    record = {"schema_version": SCHEMA_VERSION, "started_at": run.started_at,
              "finished_at": _now(), "outcome": run.outcome, "steps": run.steps}
    host.make_dirs(STATE_PATH.rpartition("/")[0])
    host.write_atomic(STATE_PATH, (json.dumps(record, indent=2) + "\n").encode())


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
