"""What `gpunode watch` already reported this boot: /run/gpunode/watch.json.

/run is emptied by every boot, and /dev/kmsg holds only this boot, so the file is valid for
the boot whose id it names (/proc/sys/kernel/random/boot_id): records up to `last_seq` were
read, `fatal` are the fatal Xids found (they hold until the next boot), `events` when the
last Event per GPU and Xid was sent (kernel microseconds, for the rate limit), `gpus` the GPUs
the watch first saw this boot, `condition` the GPUReady it last reported, `findings` the
latest containerd repair, CDI regeneration or problem of checks.py, `xids` how many of each
Xid per GPU it read and `counts` how many repairs it made (for `gpunode metrics`).
`gpunode status` reads it back (its `watch` check). Every list is bounded, so the file stays
small however many lines the kernel logs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gpunode.errors import HostError
from gpunode.platform import records, timestamps
from gpunode.platform.host import Host
from gpunode.watch.xid import FELL_OFF_BUS

WATCH_STATE = "/run/gpunode/watch.json"
WATCH_LOCK = "/run/gpunode/watch.lock"  # held from reading the state to writing it
SCHEMA = 1
MAX_FINDINGS = 64  # fatal Xids kept (the first of each GPU and code)
MAX_EVENT_KEYS = 256  # GPU and Xid pairs whose last Event (and count) is remembered
# the GPUReady reasons the watch itself sets (once.py); any other is `gpunode label`'s
WATCH_REASONS = ("GPUFellOffBus", "GPUXidFatal", "GPUMissing", "GPUNotInitialized")
# the Event reasons of checks.py's repairs that `counts` counts, and under which name
COUNTED = {"ContainerdConfigRepaired": "containerd_repairs",
           "CDISpecRegenerated": "cdi_regenerations"}


@dataclass(frozen=True)
class Finding:
    """A fatal Xid the watch found this boot; it holds until the next boot."""

    address: str
    uuid: str | None
    code: int
    seq: int
    usec: int
    text: str


@dataclass
class WatchState:
    """What `gpunode watch` already reported this boot, as /run/gpunode/watch.json keeps it."""

    boot_id: str
    last_seq: int = -1
    fatal: list[Finding] = field(default_factory=list)
    events: dict[str, list[int]] = field(default_factory=dict)  # "addr/code" → [usec, skipped]
    gpus: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    condition: dict[str, str] | None = None  # {status, reason, message} last reported
    updated_at: str = ""
    # the latest repair or problem of checks.py, per kind ("containerd", "cdi"):
    # {status: repaired|regenerated|problem, message, at[, restart]}
    findings: dict[str, dict[str, str]] = field(default_factory=dict)
    # Xids read this boot, per GPU and code ("addr/code" → how many; at most MAX_EVENT_KEYS)
    xids: dict[str, int] = field(default_factory=dict)
    # repairs made this boot, per name of COUNTED
    counts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA, **asdict(self)}


def headline(state: WatchState | None) -> str | None:
    """The GPUReady reason of what the watch found this boot (status's `watch` check fails
    for it), or None: GPUFellOffBus (Xid 79), GPUXidFatal (another fatal Xid), GPUMissing."""
    if state is None:
        return None
    if state.fatal:
        return "GPUFellOffBus" if any(f.code == FELL_OFF_BUS for f in state.fatal) \
            else "GPUXidFatal"
    if state.missing or (state.condition or {}).get("reason") == "GPUMissing":
        return "GPUMissing"
    return None


def read(host: Host) -> tuple[WatchState | None, str | None]:
    """The state, and why a file there could not be used (it is then started afresh: the worst
    is a finding reported twice, never one hidden)."""
    try:
        text = host.read_optional(WATCH_STATE)
    except HostError as exc:  # a FIFO, a directory, bytes that are not UTF-8
        return None, str(exc)
    if text is None:
        return None, None
    try:
        return parse(records.loads_json(text, host.display(WATCH_STATE))), None
    except (ValueError, TypeError, KeyError) as exc:
        return None, f"{host.display(WATCH_STATE)}: {exc}"


def parse(doc: Any) -> WatchState:
    """The state from its JSON document, every field checked (ValueError when one is wrong)."""
    if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA:
        raise ValueError(f"not a watch state of schema {SCHEMA}")
    boot_id, last_seq = doc.get("boot_id"), doc.get("last_seq")
    if not isinstance(boot_id, str) or not records.is_int(last_seq):
        raise ValueError("boot_id is not a string or last_seq not an integer")
    fatal = []
    for item in _list(doc, "fatal")[:MAX_FINDINGS]:
        if not isinstance(item, dict):
            raise ValueError("a fatal finding is not an object")
        finding = Finding(**{f.name: item.get(f.name) for f in fields(Finding)})
        if not (isinstance(finding.address, str) and records.is_int(finding.code)
                and isinstance(finding.text, str) and records.is_int(finding.seq)):
            raise ValueError("a fatal finding has a field of the wrong type")
        fatal.append(finding)
    events = doc.get("events") or {}
    if not isinstance(events, dict) or not all(
            isinstance(v, list) and len(v) == 2 and all(map(records.is_int, v))
            for v in events.values()):
        raise ValueError("events is not a map of [usec, skipped]")
    condition = doc.get("condition")
    if condition is not None and not (isinstance(condition, dict) and all(
            isinstance(condition.get(k), str) for k in ("status", "reason", "message"))):
        raise ValueError("condition is not {status, reason, message}")
    gpus, missing = _list(doc, "gpus"), _list(doc, "missing")
    if not all(isinstance(a, str) for a in [*gpus, *missing]):
        raise ValueError("gpus and missing are not lists of addresses")
    findings = doc.get("findings") or {}
    if not isinstance(findings, dict) or len(findings) > MAX_FINDINGS or not all(
            isinstance(k, str) and isinstance(v, dict)
            and all(isinstance(x, str) for x in [*v.keys(), *v.values()])
            for k, v in findings.items()):
        raise ValueError("findings is not a map of kind → {status, message, at}")
    for finding in findings.values():
        if "event" in finding and not _event(finding["event"]):
            raise ValueError("a finding's unreported event is not an Event's JSON")
    xids, counts = _counts(doc, "xids"), _counts(doc, "counts")
    return WatchState(boot_id, last_seq, fatal, dict(list(events.items())[-MAX_EVENT_KEYS:]),
                      gpus, missing, condition, str(doc.get("updated_at") or ""), findings,
                      dict(list(xids.items())[-MAX_EVENT_KEYS:]), counts)


def write(host: Host, state: WatchState) -> None:
    state.updated_at = timestamps.utc_timestamp()
    host.write_atomic(WATCH_STATE, (json.dumps(state.to_json(), indent=2) + "\n").encode(),
                      make_parents=True)


def _event(text: str) -> bool:
    """`text` is a change the watch kept to report again (checks.keep_unreported)."""
    try:
        change = json.loads(text)
    except ValueError:
        return False
    return isinstance(change, dict) and all(
        isinstance(change.get(k), str) for k in ("kind", "type", "reason", "message"))


def _counts(doc: dict[str, Any], key: str) -> dict[str, int]:
    """A map of counts; absent in a state an older gpunode wrote (then nothing was counted)."""
    value = doc.get(key) or {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and records.is_int(v) and v >= 0 for k, v in value.items()):
        raise ValueError(f"{key} is not a map of counts")
    return value


def _list(doc: dict[str, Any], key: str) -> list[Any]:
    value = doc.get(key) or []
    if not isinstance(value, list):
        raise ValueError(f"{key} is not a list")
    return value
