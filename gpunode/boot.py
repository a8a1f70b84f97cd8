"""`gpunode plan` and `gpunode boot`: the pipeline's steps in order, and the boot record.

plan: observe and decide, touch nothing. boot: the same decisions, applied, each step timed
and recorded in /run/gpunode/state.json for `gpunode status`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpunode import log
from gpunode.config import AgentConfig
from gpunode.detect import Detection, detect
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


def plan(host: Host, config: AgentConfig, systemd: Systemd) -> tuple[Detection, list[Action]]:
    from gpunode.containerd import step as containerd

    detection = detect(host)
    if not detection.gpus:
        return detection, []
    the_plan = containerd.plan(host, config.containerd, systemd)
    if not the_plan.changed:
        return detection, []
    return detection, [Action("containerd", line) for line in the_plan.describe()]


def boot(host: Host, config: AgentConfig, systemd: Systemd) -> BootRun:
    run = BootRun(started_at=_now())
    with _recorded(run, "detect") as fields:
        detection = detect(host)
        fields.update(gpus=len(detection.gpus), functions=len(detection.functions))
    if not detection.gpus:
        run.outcome = "no-gpu"
    else:
        _containerd(host, config, systemd, run)
    write_record(host, run)
    return run


def _containerd(host: Host, config: AgentConfig, systemd: Systemd, run: BootRun) -> None:
    from gpunode.containerd import step as containerd

    try:
        with _recorded(run, "containerd") as fields:
            the_plan = containerd.plan(host, config.containerd, systemd)
            outcome = containerd.apply(host, the_plan, systemd, config.containerd.restart_timeout)
            fields.update(changed=outcome.changed, restarted=outcome.restarted,
                          config=outcome.target)
    except GpunodeError:
        run.outcome = "failed"  # recorded and logged by _recorded; boot goes on to the record


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
