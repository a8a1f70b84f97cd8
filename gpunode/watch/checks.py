"""What the watch keeps as boot left it: containerd's config as gpunode configured it, and
gpunode's CDI spec current with the loaded driver and its GPUs.

containerd: when gpunode configured containerd this boot (its ledger, or the boot record's
containerd step), the watch asks `containerd configure`'s own planner (containerd/step.py)
what configure would change now. Nothing: the file is as configured. Something (another tool
rewrote the file without the `nvidia` runtime or CDI): the watch repairs it by running
configure itself, under the node lock (journalled, atomic, the backup as configure keeps
it), and reports a Warning Event, `{"kind": "repair", …}`. A running containerd is restarted
only as `watch.containerd_restart` allows: `when-idle` (the default) only while no container
runs — no `containerd-shim` process, the kernel's 15-character name of containerd-shim and
containerd-shim-runc-v2 (TASK_COMM_LEN) — `never`, or `always`; otherwise the Event says
"restart pending", as does `gpunode status`, and a later pass makes the restart once the
policy allows it (restart_due), unless containerd was restarted since.

CDI: gpunode's own spec (/var/run/cdi/nvidia.yaml, its header) is regenerated as boot's cdi
step makes it (cdi/node.py) whenever its bytes differ from what the node gives now (another
driver version, other devices, a socket that came up after boot): `{"kind": "cdi", …}`. A spec
that is not gpunode's is left alone (boot's cdi step decides about it).

A problem (a config that cannot be read or parsed, a driver gone) is reported once as an
Event, changes no file, and is looked at again on the next pass. With --dry-run the changes
are only printed. `findings` in the watch's state keeps the latest of each (state.py).
"""

from __future__ import annotations

import json
from typing import Any

from gpunode import log
from gpunode.config import AgentConfig
from gpunode.errors import GpunodeError
from gpunode.pipeline import state as bootstate
from gpunode.platform import processes, timestamps
from gpunode.platform.host import Host

SHIM = "containerd-shim"  # /proc/PID/comm of every container's shim (15 characters)
NODE_LOCK_WAIT = 10.0  # another gpunode command changing the node: repair on a later pass
SPEC_LIMIT = 4 << 20  # gpunode's spec is a few KiB; anything larger is not its own
KINDS = {"ContainerdConfigRepaired": "containerd", "ContainerdConfigUnchecked": "containerd",
         "ContainerdConfigRepairFailed": "containerd", "CDISpecRegenerated": "cdi",
         "ContainerdRestarted": "containerd", "ContainerdRestartFailed": "containerd",
         "CDISpecUnchecked": "cdi", "CDISpecRegenerateFailed": "cdi"}  # Event reason → check


def run(host: Host, config: AgentConfig, changes: list[dict[str, Any]],
        findings: dict[str, dict[str, str]], dry_run: bool, manager: Any = None) -> None:
    """Check containerd's config and the CDI spec; append what is (or, --dry-run, would be)
    done to `changes` and record it in `findings` (the watch state's)."""
    from gpunode.platform import systemd

    manager = manager if manager is not None else systemd.for_host(host.is_live)
    for finding in findings.values():  # done on an earlier pass whose report failed
        if "event" in finding:
            changes.append(json.loads(finding.pop("event")))
    drift = containerd_drift(host, config, manager)
    spec = cdi_drift(host, config)
    due = drift is None and restart_due(host, config, manager, findings)
    if dry_run or not (_acts(drift) or _acts(spec) or due):
        _report(changes, findings, "containerd",
                _containerd(host, config, manager, findings, drift, due, dry_run))
        _report(changes, findings, "cdi", _cdi_change(host, spec, dry_run))
        return
    from gpunode.errors import LockBusy
    from gpunode.platform import nodelock

    try:
        with nodelock.held(host, "watch", NODE_LOCK_WAIT):
            drift = containerd_drift(host, config, manager)  # as it is now, under the lock
            due = drift is None and restart_due(host, config, manager, findings)
            _report(changes, findings, "containerd",
                    _containerd(host, config, manager, findings, drift, due, False))
            _report(changes, findings, "cdi", _cdi_change(host, cdi_drift(host, config), False))
    except LockBusy as exc:
        log.get().warning("watch.repair_deferred", error=str(exc),
                          note="the next pass repairs what is still out of place")


def keep_unreported(host: Host, new: Any, changes: list[dict[str, Any]]) -> None:
    """The report of this pass failed (the API server away): keep its repairs and problems
    in the state the pass started from, so the next pass reports them (a repair is done and
    would otherwise go unsaid; the kernel log is read again anyway)."""
    from gpunode.watch import state

    kept = {kind: {**new.findings[kind], "event": json.dumps(change)} for change in changes
            for kind in [KINDS.get(change.get("reason", ""))] if kind in new.findings}
    if not kept:
        return  # nothing done that a rerun would not find again: the state stays as it was
    previous, _ = state.read(host)
    if previous is None or previous.boot_id != new.boot_id:
        previous = state.WatchState(boot_id=new.boot_id)
    previous.findings.update(kept)
    state.write(host, previous)


def _containerd(host: Host, config: AgentConfig, manager: Any,
                findings: dict[str, dict[str, str]], drift: Any, due: bool,
                dry_run: bool) -> dict[str, Any] | None:
    if due:
        return _restart_change(host, config, manager, findings, dry_run)
    return _containerd_change(host, config, drift, manager, dry_run)


def _acts(found: Any) -> bool:
    return found is not None and not isinstance(found, str)


def _report(changes: list[dict[str, Any]], findings: dict[str, dict[str, str]], kind: str,
            change: dict[str, Any] | None) -> None:
    """A repair is always reported; a problem only when it is new (not one Event per pass)."""
    if change is None:
        if findings.get(kind, {}).get("status") == "problem":
            findings.pop(kind)  # its cause cleared
        return
    finding = {"status": change.pop("status"), "message": change["message"],
               "at": timestamps.utc_timestamp()}
    for key in ("restart", "file"):
        if change.get(key):
            finding[key] = change[key]
    if finding["status"] == "problem" and findings.get(kind, {}).get("message") == \
            finding["message"]:
        return
    findings[kind] = finding
    changes.append(change)


# -- containerd ---------------------------------------------------------------------------------


def configured_by_gpunode(host: Host) -> bool:
    """gpunode configured containerd on this node: its ledger is there, or this boot's
    containerd step succeeded finding nothing to change (a config that already had everything
    gets no ledger). A boot that changed the config wrote a ledger: that ledger gone means
    `gpunode containerd revert` took gpunode's changes out, which the watch leaves so."""
    from gpunode.containerd.ledger import LEDGER

    try:
        if host.exists(LEDGER):
            return True
        record = bootstate.read_record(host)
    except (GpunodeError, ValueError):
        return False  # status reports an unusable boot record; the watch claims nothing
    step = record.step("containerd") if record is not None else None
    return step is not None and step.get("outcome") == "ok" and not step.get("changed")


def containerd_drift(host: Host, config: AgentConfig, manager: Any) -> Any:
    """configure's plan when it would change something now (step.Plan); a sentence when that
    cannot be judged or done now; None when the config is as gpunode configured it (or
    gpunode did not configure containerd)."""
    from gpunode.containerd import step

    if not configured_by_gpunode(host):
        return None
    try:
        preview = step.preview(host, config.containerd, manager)
    except (GpunodeError, ValueError) as exc:  # ValueError: schema.SchemaError, the layout
        hint = f" ({exc.hint})" if getattr(exc, "hint", None) else ""
        return f"cannot check containerd's config against what gpunode configured: {exc}{hint}"
    if isinstance(preview, step.PendingRollback):
        return (f"an interrupted gpunode change to {preview.target} is pending; run 'gpunode "
                "containerd configure': it rolls the change back, then configures")
    return preview if preview.changed else None


def restart_allowed(host: Host, policy: str) -> tuple[bool, str]:
    """(may the watch restart a running containerd now, why not)."""
    if policy == "always":
        return True, ""
    if policy == "never":
        return False, 'watch.containerd_restart = "never"'
    shims = processes.observe(host, (SHIM,)).running[SHIM]
    if shims:
        return False, (f"{len(shims)} container{'s' if len(shims) != 1 else ''} running; "
                       'watch.containerd_restart = "when-idle"')
    return True, ""


def _containerd_change(host: Host, config: AgentConfig, drift: Any, manager: Any,
                       dry_run: bool) -> dict[str, Any] | None:
    if drift is None:
        return None
    if isinstance(drift, str):
        return _problem("ContainerdConfigUnchecked", drift)
    from gpunode.containerd import step
    from gpunode.containerd.discover import CONTAINERD_UNIT

    what = "; ".join(drift.describe())
    allowed, why = restart_allowed(host, config.watch.containerd_restart)
    running = manager.active_state(CONTAINERD_UNIT) == "active"
    unmanaged = not getattr(manager, "available", True)
    why = (manager.unavailable_reason or "no service manager answers") if unmanaged else why
    if dry_run:
        restart = ("unknown" if unmanaged and drift.config_changed else
                   "not-needed" if not (running and drift.config_changed) else
                   "restart" if allowed else "pending")
        return _repair(drift.target, what, restart, why, would=True)
    fields: dict[str, Any] = {}
    try:
        _, outcome = step.configure(host, config.containerd, manager,
                                    config.containerd.restart_timeout, report=fields,
                                    restart_allowed=allowed)
    except (GpunodeError, ValueError) as exc:
        return _problem("ContainerdConfigRepairFailed",
                        f"repairing {drift.target} failed: {exc}; it is as it was")
    restart = ("restarted" if outcome.restarted else
               "pending" if outcome.restart_pending else
               "unknown" if unmanaged and drift.config_changed else "not-needed")
    log.get().warning("watch.containerd_repaired", config=outcome.target, restart=restart,
                      changes=list(outcome.descriptions))
    return _repair(outcome.target, what, restart, why, would=False)


def restart_due(host: Host, config: AgentConfig, manager: Any,
                findings: dict[str, dict[str, str]]) -> bool:
    """A restart an earlier repair left pending may be made now: containerd still runs from
    before the repaired file was written (systemd's start time of its main process against
    the file's mtime, as status judges a pending restart) and the policy allows it now. Once
    containerd was restarted since (by anyone), the finding says so."""
    from gpunode.containerd.discover import CONTAINERD_UNIT
    from gpunode.containerd.ledger import WRITABLE_CONFIG

    finding = findings.get("containerd") or {}
    if finding.get("restart") != "pending" or not getattr(manager, "available", False):
        return False
    try:
        main = manager.main_process(CONTAINERD_UNIT)
        written = host.stat(finding.get("file") or WRITABLE_CONFIG)
    except GpunodeError:
        return False
    if main is None or written is None:
        return False
    if main.started > written.st_mtime:
        finding["restart"] = "restarted"  # someone did: it runs the repaired file
        return False
    return restart_allowed(host, config.watch.containerd_restart)[0]


def _restart_change(host: Host, config: AgentConfig, manager: Any,
                    findings: dict[str, dict[str, str]], dry_run: bool) -> dict[str, Any]:
    """The restart a repair left pending, made now that the policy allows it."""
    from gpunode.containerd import restart
    from gpunode.containerd.ledger import WRITABLE_CONFIG

    target = findings.get("containerd", {}).get("file") or WRITABLE_CONFIG
    if not dry_run:
        try:
            restart.restart(host, manager, host.read_optional(target) or "",
                            config.containerd.restart_timeout)
        except GpunodeError as exc:
            return _problem("ContainerdRestartFailed", f"restarting containerd after the "
                            f"repair failed: {exc}; see 'journalctl -u containerd'")
    verb = "would restart" if dry_run else "restarted"
    return {"kind": "event", "type": "Normal", "reason": "ContainerdRestarted",
            "message": f"gpunode watch: {verb} containerd, which ran the config from before "
                       f"the repair of {target}, now that watch.containerd_restart = "
                       f"\"{config.watch.containerd_restart}\" allows it",
            "file": target, "restart": "restart" if dry_run else "restarted",
            "status": "repaired"}


def _repair(target: str, what: str, restart: str, why: str, would: bool) -> dict[str, Any]:
    said = {"restarted": "; containerd was restarted",
            "restart": "; containerd would be restarted",
            "pending": f"; restart pending ({why}): run 'systemctl restart containerd' when "
                       "the node's pods can take it",
            "unknown": f"; whether containerd runs with the old config is unknown ({why}): "
                       "whoever runs it must restart it",
            "not-needed": ""}[restart]
    verb = "would repair" if would else "repaired"
    return {"kind": "repair", "type": "Warning", "reason": "ContainerdConfigRepaired",
            "message": f"gpunode watch: {target} is no longer as gpunode configured it; "
                       f"{verb} as 'gpunode containerd configure' does ({what}){said}"[:1024],
            "file": target, "restart": restart, "status": "repaired"}


def _problem(reason: str, message: str) -> dict[str, Any]:
    return {"kind": "event", "type": "Warning", "reason": reason,
            "message": f"gpunode watch: {message}"[:1024], "status": "problem"}


# -- CDI ----------------------------------------------------------------------------------------


def cdi_drift(host: Host, config: AgentConfig) -> Any:
    """(why, the spec's new bytes) when gpunode's spec is not what the node gives now (another
    driver version, other devices, other mounts or hooks); a sentence when it cannot be judged;
    None otherwise."""
    from gpunode.cdi import node as cdinode
    from gpunode.cdi import spec as cdi

    try:
        old = host.read_optional_bytes(cdi.SPEC_PATH, limit=SPEC_LIMIT)
    except GpunodeError as exc:
        return f"cannot read the CDI spec: {exc}"
    if old is None or not old.startswith(cdi.HEADER.encode()):
        return None  # none, or not gpunode's: boot's cdi step decides about it
    try:
        document = cdinode.generate(host, config.driver.prebuilt_dirs,
                                    capabilities=config.cdi.wanted)
        version = cdinode.driver_version(host)
    except GpunodeError as exc:
        return f"cannot regenerate the CDI spec {cdi.SPEC_PATH}: {exc}"
    data = cdi.render(document, "yaml")
    if data == old:
        return None
    was_version, was_devices = spec_facts(old)
    devices = {str(d.get("name")) for d in document["devices"]}
    why = []
    if was_version != version:
        why.append(f"driver {was_version or 'unknown'} → {version}")
    if was_devices != devices:
        gone, new = sorted(was_devices - devices), sorted(devices - was_devices)
        why.append("devices" + (f" gone: {', '.join(gone)}" if gone else "")
                   + (";" if gone and new else "") + (f" new: {', '.join(new)}" if new else ""))
    if not why:  # the same devices of the same driver: its other edits (a socket that
        why.append("its mounts or hooks differ from what the node has now")  # came up later)
    return "; ".join(why), data


def spec_facts(data: bytes) -> tuple[str | None, set[str]]:
    """(the driver version its libcuda mount names, its device names) of a spec's bytes;
    (None, set()) for bytes that are no spec."""
    import re

    import yaml

    try:
        document = yaml.safe_load(data.decode("utf-8", "replace"))
    except yaml.YAMLError:
        return None, set()
    if not isinstance(document, dict):
        return None, set()
    devices = {str(d.get("name")) for d in document.get("devices") or []
               if isinstance(d, dict)} if isinstance(document.get("devices"), list) else set()
    edits = document.get("containerEdits")
    mounts = edits.get("mounts") if isinstance(edits, dict) else None
    for mount in mounts if isinstance(mounts, list) else []:
        path = mount.get("hostPath") if isinstance(mount, dict) else None
        found = re.search(r"/libcuda\.so\.(\d+\.\d+(?:\.\d+)?)$", path or "")
        if found:
            return found.group(1), devices
    return None, devices


def _cdi_change(host: Host, drift: Any, dry_run: bool) -> dict[str, Any] | None:
    from gpunode.cdi import node as cdinode
    from gpunode.cdi import spec as cdi

    if drift is None:
        return None
    if isinstance(drift, str):
        return _problem("CDISpecUnchecked", drift)
    why, data = drift
    if not dry_run:
        try:
            cdinode.write(host, cdi.SPEC_PATH, data)
        except GpunodeError as exc:
            return _problem("CDISpecRegenerateFailed", f"writing {cdi.SPEC_PATH} failed: {exc}")
    verb = "would regenerate" if dry_run else "regenerated"
    return {"kind": "cdi", "type": "Normal", "reason": "CDISpecRegenerated",
            "message": f"gpunode watch: {verb} {cdi.SPEC_PATH} ({why})"[:1024],
            "file": cdi.SPEC_PATH, "status": "regenerated"}
