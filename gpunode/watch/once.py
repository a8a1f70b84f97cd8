"""`gpunode watch --once`: read what the kernel logged this boot, decide, report, remember.

observe() reads the host (the /dev/kmsg records, the GPUs' UUIDs from /proc/driver/nvidia, the
GPUs present now, the boot record's GPU count, this boot's id); decide() is pure: from what
was observed and what was already reported (state.py) to the changes — the GPUReady
condition (False: GPUFellOffBus for Xid 79, GPUXidFatal for the other fatal Xids, GPUMissing
when fewer GPUs are present than the boot detected; when that clears, what `gpunode label`
would set) and one Warning Event per non-fatal Xid, at most one per GPU and Xid every
EVENT_INTERVAL_US of kernel time. run() sends them with the kubelet's credentials (report.py:
a PATCH only for a condition that changed) and writes the state only after they were
accepted, so a failed run reports again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpunode import log
from gpunode.config import AgentConfig
from gpunode.errors import GpunodeError, HostError
from gpunode.gpu import detect, driverinfo
from gpunode.kube import labels
from gpunode.pipeline import state as bootstate
from gpunode.platform import kernelinfo, records
from gpunode.platform.host import Host
from gpunode.watch import checks, vmsize, xid
from gpunode.watch import state as watchstate
from gpunode.watch.state import Finding, WatchState

KMSG = "/dev/kmsg"
KMSG_LIMIT = 32 << 20  # the kernel's largest ring buffer (CONFIG_LOG_BUF_SHIFT at most 25)
EVENT_INTERVAL_US = 600_000_000  # one Event per GPU and Xid every 10 minutes of kernel time
MAX_EVENTS = 20  # per run: a flood of Xids is not a flood of Events
LOCK_WAIT_SECONDS = 60  # another pass reporting: it takes a request timeout or two
MAX_MESSAGE = 1024  # a condition's message, as `gpunode label` caps it
WATCH_REASONS = watchstate.WATCH_REASONS  # the conditions it sets


@dataclass(frozen=True)
class Observed:
    """What one watch pass reads of the host: this boot's kernel log and the GPUs present now."""

    boot_id: str
    records: list[str]
    uuids: dict[str, str]  # GPU address → UUID, as the driver says under /proc
    present: list[str]  # the GPUs' addresses now
    boot_gpus: int | None  # how many GPUs this boot's `gpunode boot` detected
    vm_size: vmsize.Claim | None = None  # on Azure: the GPUs the VM size has (vmsize.py)
    # GPUs the driver lists but has not initialized (no UUID: gpu/init.py) → why
    uninitialized: dict[str, str] = field(default_factory=dict)


@dataclass
class Decision:
    """One watch pass's result: the state to remember, and the changes to report."""

    state: WatchState
    changes: list[dict[str, Any]] = field(default_factory=list)


def observe(host: Host, config: AgentConfig, kmsg: list[str] | None = None) -> Observed:
    """The host as the watch sees it; `kmsg`: the records the daemon (daemon.py) read since
    its last pass, instead of the whole of /dev/kmsg."""
    stat = host.stat(KMSG) if kmsg is None else None
    if kmsg is None and stat is None and not host.is_live:
        raise HostError("read", host.display(KMSG), "does not exist: under --root the watch "
                        "reads the node's kernel log from this file (its /dev/kmsg records, "
                        "e.g. saved on the node with 'timeout 1 cat /dev/kmsg')")
    if stat is not None and stat.st_size > KMSG_LIMIT:
        raise HostError("read", host.display(KMSG), f"is {stat.st_size} bytes, more than the "
                        f"kernel's largest log buffer ({KMSG_LIMIT} bytes): not a kernel log")
    if kmsg is None:
        kmsg = host.read_records(KMSG, limit=KMSG_LIMIT)
    infos = driverinfo.read_gpu_infos(host)
    found = detect.detect(host, use_udev=config.detect.use_udev)
    return Observed(boot_id=(host.read_optional(kernelinfo.BOOT_ID) or "").strip(),
                    records=kmsg, uuids={a: i.uuid for a, i in infos.items() if i.uuid},
                    present=[g.address for g in found.gpus], boot_gpus=_boot_gpus(host),
                    vm_size=vmsize.claim(host), uninitialized=_uninitialized(infos))


def _uninitialized(infos: dict[str, driverinfo.GpuInfo]) -> dict[str, str]:
    """The GPUs not up, each with why its UUID is not known (the same words every pass: the
    kernel's own line, in the records of one pass only, is status's to show)."""
    return {a: i.uuid_problem or "its UUID is not known"
            for a, i in sorted(infos.items()) if not i.initialized}


def _boot_gpus(host: Host) -> int | None:
    """The GPU count the boot's detect step recorded; None without a (usable) boot record."""
    try:
        record = bootstate.read_record(host)
    except (HostError, ValueError) as exc:
        log.get().warning("watch.boot_record_unusable", error=str(exc))
        return None
    step = record.step("detect") if record is not None else None
    count = step.get("gpus") if step is not None else None
    return count if records.is_int(count) else None


def decide(seen: Observed, previous: WatchState | None, fatal: tuple[int, ...],
           ignored: tuple[int, ...]) -> Decision:
    """The new state and the changes to report: pure."""
    if previous is None or previous.boot_id != seen.boot_id:
        previous = WatchState(boot_id=seen.boot_id)
    new = WatchState(boot_id=seen.boot_id, last_seq=previous.last_seq,
                     fatal=list(previous.fatal),
                     events={k: list(v) for k, v in previous.events.items()},
                     gpus=previous.gpus or sorted(seen.present), condition=previous.condition,
                     findings={k: dict(v) for k, v in previous.findings.items()},
                     xids=dict(previous.xids), counts=dict(previous.counts))
    decision = Decision(new)
    uuids = dict(seen.uuids)
    xids = []
    for raw in seen.records:
        record = xid.parse_record(raw)
        if record is None or record.seq <= previous.last_seq:
            continue
        new.last_seq = max(new.last_seq, record.seq)
        named = xid.parse_uuid(record)
        if named is not None:
            uuids.setdefault(*named)
        found = xid.parse_xid(record)
        if found is not None:
            xids.append(found)
    for found in xids:
        _count_xid(new, found)
        kind = xid.classify(found.code, fatal, ignored)
        if kind == xid.FATAL:
            _add_fatal(new, found, uuids.get(found.address))
        elif kind == xid.EVENT:
            _event(decision, found, uuids.get(found.address))
        else:
            log.get().debug("watch.xid_ignored", address=found.address, xid=found.code,
                            note="an application error (k8s-device-plugin's list)")
    new.missing = sorted(set(new.gpus) - set(seen.present))
    short = seen.boot_gpus is not None and len(seen.present) < seen.boot_gpus
    short = short or (seen.vm_size is not None and len(seen.present) < seen.vm_size.gpus)
    condition = _condition(new, short, seen, uuids)
    if condition is not None:
        decision.changes.insert(0, condition)
        new.condition = {k: condition[k] for k in ("status", "reason", "message")}
    return decision


def _add_fatal(new: WatchState, found: xid.Xid, uuid: str | None) -> None:
    if any(f.address == found.address and f.code == found.code for f in new.fatal):
        return
    if len(new.fatal) < watchstate.MAX_FINDINGS:
        new.fatal.append(Finding(found.address, uuid, found.code, found.seq, found.usec,
                                 found.text))


def _count_xid(new: WatchState, found: xid.Xid) -> None:
    """Every Xid read, ignored ones too, counted per GPU and code (`gpunode metrics`); the
    pair counted longest ago is forgotten first when MAX_EVENT_KEYS pairs are kept."""
    key = f"{found.address}/{found.code}"
    new.xids[key] = new.xids.get(key, 0) + 1
    while len(new.xids) > watchstate.MAX_EVENT_KEYS:
        new.xids.pop(next(iter(new.xids)))


def _event(decision: Decision, found: xid.Xid, uuid: str | None) -> None:
    key = f"{found.address}/{found.code}"
    last = decision.state.events.get(key)
    sent = sum(1 for c in decision.changes if c["kind"] == "event")
    if (last is not None and found.usec - last[0] < EVENT_INTERVAL_US) or sent >= MAX_EVENTS:
        if last is not None:
            last[1] += 1
        return
    skipped = last[1] if last is not None else 0
    decision.state.events.pop(key, None)
    decision.state.events[key] = [found.usec, 0]
    while len(decision.state.events) > watchstate.MAX_EVENT_KEYS:
        decision.state.events.pop(next(iter(decision.state.events)))
    more = f" ({skipped} more since the last Event)" if skipped else ""
    who = f", pid {found.pid}" + (f" ({found.process})" if found.process else "") \
        if found.pid is not None else ""
    decision.changes.append({
        "kind": "event", "type": "Warning", "reason": "GPUXid",
        "message": f"gpunode watch: Xid {found.code} on GPU {_gpu_words(found.address, uuid)}"
                   f"{who}: {found.text}{more}"[:MAX_MESSAGE],
        "gpu": {"address": found.address, "uuid": uuid}, "xid": found.code,
        "seq": found.seq})


def _condition(new: WatchState, short: bool, seen: Observed,
               uuids: dict[str, str]) -> dict[str, Any] | None:
    """GPUReady as the watch sees it, when it differs from what it last reported; None when
    it is unchanged, or when the watch has nothing to say (gpunode label owns GPUReady)."""
    gpu = None
    if new.fatal:
        first = next((f for f in new.fatal if f.code == xid.FELL_OFF_BUS), new.fatal[0])
        reason = "GPUFellOffBus" if first.code == xid.FELL_OFF_BUS else "GPUXidFatal"
        words = [f"Xid {f.code} on GPU {_gpu_words(f.address, f.uuid)}: {f.text}"
                 for f in new.fatal]
        gpu = {"address": first.address, "uuid": first.uuid}
        wanted = labels.Condition("False", reason, "gpunode watch: " + "; ".join(words))
    elif new.missing or short:
        expected = max(len(new.gpus), seen.boot_gpus or 0)
        names = f" (missing: {', '.join(new.missing)})" if new.missing else ""
        if new.missing:
            gpu = {"address": new.missing[0], "uuid": uuids.get(new.missing[0])}
        said = f"of the {expected} GPUs this boot detected are present{names}"
        vm = seen.vm_size
        if vm is not None and vm.gpus > expected:  # the VM size knows more than the boot saw
            said = f"of the {vm.gpus} GPUs of an Azure {vm.size} are present ({vm.source})"
        wanted = labels.Condition("False", "GPUMissing",
                                  f"gpunode watch: {len(seen.present)} {said}")
    elif seen.uninitialized:
        # a GPU the driver has not brought up (boot's gpu_init step failed, or it went down):
        # no pod should land on it
        first = next(iter(seen.uninitialized))
        gpu = {"address": first, "uuid": None}
        words = "; ".join(f"{a}: {why}" for a, why in seen.uninitialized.items())
        wanted = labels.Condition("False", "GPUNotInitialized", "gpunode watch: "
                                  f"{len(seen.uninitialized)} of the driver's GPUs not "
                                  f"initialized: {words}")
    elif new.condition is not None and new.condition["reason"] in WATCH_REASONS:
        # its cause cleared: True here, made what `gpunode label` would say by run()
        wanted = labels.Condition("True", "GPUReady", f"gpunode watch: all {len(seen.present)} "
                                  "GPUs present and no fatal Xid this boot")
    else:
        return None
    message = wanted.message[:MAX_MESSAGE]
    if new.condition == {"status": wanted.status, "reason": wanted.reason, "message": message}:
        return None
    return {"kind": "condition", "type": "GPUReady", "status": wanted.status,
            "reason": wanted.reason, "message": message, "gpu": gpu}


def _gpu_words(address: str, uuid: str | None) -> str:
    return f"{address} ({uuid})" if uuid else f"{address} (UUID unknown)"


def run(host: Host, config: AgentConfig, dry_run: bool,
        api_factory: Callable[[], Any] | None = None, kmsg: list[str] | None = None,
        unsent: Any = None, metrics: bool = True) -> Decision:
    """One pass: observe, decide, then print (--dry-run) or apply and remember. Two passes at
    once (a timer and a hand) take turns from reading the state to writing it, so the second
    sees what the first reported; what they observe is only read. The daemon passes the
    records it read (`kmsg`) and its `unsent` (daemon.Unsent: what the API server has not
    accepted yet), which sends the changes instead of report.apply. After the report, the
    node's metrics are written for node-exporter (`metrics` False: the daemon does it)."""
    seen = observe(host, config, kmsg)
    if dry_run:
        decision = _decide(host, config, seen, dry_run=True)
        for change in decision.changes:
            print(json.dumps(change, sort_keys=False))
        return decision
    with host.lock(watchstate.WATCH_LOCK, wait=LOCK_WAIT_SECONDS):
        decision = _decide(host, config, seen, dry_run=False)
        _count_repairs(decision)
        if unsent is not None:
            unsent.send(host, config, decision, api_factory)
        elif decision.changes:
            from gpunode.watch import report

            try:
                report.apply(host, config, decision.changes, api_factory)
            except GpunodeError:
                checks.keep_unreported(host, decision.state, decision.changes)
                raise
        watchstate.write(host, decision.state)
    if metrics:
        from gpunode.metrics import textfile  # after the report: no PATCH waits for the file

        textfile.write(host, config)
    return decision


def _count_repairs(decision: Decision) -> None:
    """The repairs checks.run made in this pass, added to the state's counts. A repair whose
    report failed comes back in a later pass's changes only where this pass's state was not
    written (checks.keep_unreported), so each is counted once."""
    for change in decision.changes:
        name = watchstate.COUNTED.get(change.get("reason", ""))
        if name is not None:
            decision.state.counts[name] = decision.state.counts.get(name, 0) + 1


def _decide(host: Host, config: AgentConfig, seen: Observed, dry_run: bool) -> Decision:
    """decide(), then the checks (containerd's config, the CDI spec: repaired unless
    `dry_run`), then GPUReady on recovery as `gpunode label` says it of the node as the checks
    left it (a spec regenerated for a GPU that came back is current by then)."""
    previous, problem = watchstate.read(host)
    if problem is not None:
        log.get().warning("watch.state_unusable", error=problem,
                          note="starting afresh: what this boot logged is reported again")
    decision = decide(seen, previous, config.watch.fatal_xids, config.watch.ignored_xids)
    checks.run(host, config, decision.changes, decision.state.findings, dry_run=dry_run)
    _recovery_as_label_says(host, config, decision, previous)
    return decision


def _recovery_as_label_says(host: Host, config: AgentConfig, decision: Decision,
                            previous: WatchState | None) -> None:
    """When the watch's own cause clears, GPUReady becomes what `gpunode label` would set
    (status's checks, the watch's new findings among them), not simply True: a driver that
    failed meanwhile is not hidden by a GPU that came back."""
    change = next((c for c in decision.changes if c["kind"] == "condition"), None)
    if change is None or change["status"] != "True":
        return
    from gpunode import status

    facts = dataclasses.replace(status.observe(host, config, contact_api=False),
                                watch=decision.state, watch_problem=None)
    checks = status.evaluate(facts).checks
    wanted = labels.condition_for([(c.name, c.state, c.detail) for c in checks],
                                  watchstate.headline(decision.state))
    said = {"status": wanted.status, "reason": wanted.reason, "message": wanted.message}
    if previous is not None and previous.condition == said:
        decision.changes.remove(change)
    else:
        change.update(said)
    decision.state.condition = said


def command(host: Host, config: AgentConfig, once: bool, dry_run: bool) -> int:
    """`gpunode watch --once`: exit 0 once everything was reported (or, --dry-run, printed).
    (Without --once, watch/__init__.py runs the daemon, daemon.py, instead.)"""
    with log.step("watch", dry_run=dry_run) as fields:
        decision = run(host, config, dry_run)
        fields.update(changes=len(decision.changes), last_seq=decision.state.last_seq,
                      fatal=len(decision.state.fatal), missing=decision.state.missing)
    return 0


__all__ = ["Decision", "Observed", "decide", "observe", "run"]
