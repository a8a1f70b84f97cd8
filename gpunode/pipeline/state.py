"""The boot record /run/gpunode/state.json: what the last `gpunode boot` did, step by step.

/run is emptied at every boot, so a record found there always belongs to the current boot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpunode.errors import RecordError
from gpunode.platform import records
from gpunode.platform.host import Host

STATE_PATH = "/run/gpunode/state.json"
SCHEMA_VERSION = 1


def render(started_at: str, finished_at: str, outcome: str, steps: list[dict[str, Any]]) -> bytes:
    """The record's bytes: boot writes them, and so does a CPU node's boot
    (pipeline/shortcut.py)."""
    record = {"schema_version": SCHEMA_VERSION, "started_at": started_at,
              "finished_at": finished_at, "outcome": outcome, "steps": steps}
    return (json.dumps(record, indent=2) + "\n").encode()


def no_gpu(started_at: str, finished_at: str, duration_ms: float) -> bytes:
    """The record of a node without NVIDIA function: its one detect step, as the pipeline
    records it."""
    step = {"name": "detect", "outcome": "ok", "duration_ms": duration_ms, "error": None,
            "hint": None, "code": None, "gpus": 0, "functions": 0, "changed": False}
    return render(started_at, finished_at, "no-gpu", [step])


@dataclass(frozen=True)
class BootRecord:
    """The last boot's record (/run/gpunode/state.json), read back and checked."""

    outcome: str  # "ok", "failed" or "no-gpu"
    finished_at: str | None
    steps: tuple[dict[str, Any], ...]
    raw: dict[str, Any]

    def step(self, name: str) -> dict[str, Any] | None:
        """The step called `name` in the last boot, None when that boot did not run it."""
        return next((s for s in self.steps if s.get("name") == name), None)

    @property
    def failed_steps(self) -> tuple[dict[str, Any], ...]:
        return tuple(s for s in self.steps if s.get("outcome") == "failed")


def read_record(host: Host) -> BootRecord | None:
    """The record, None when there is none; RecordError (or HostError: a FIFO, a directory,
    bytes that are not UTF-8) when it cannot be used."""
    text = host.read_optional(STATE_PATH)
    if text is None:
        return None
    try:
        return parse_record(text)
    except RecordError as exc:
        raise RecordError(f"{host.display(STATE_PATH)}: {exc}") from None


# Fields of a step that gpunode reads back (status, labels), and the types they must have;
# a step may carry other fields (the step's own log fields), which nothing reads.
_STEP_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "outcome": (str,),
    "duration_ms": (int, float),
    "error": (str, type(None)),
    "hint": (str, type(None)),
    "code": (str, type(None)),  # a failed step's error code (gpunode.errors)
    "strategy": (str, type(None)),
    "source": (str, type(None)),
    "flavour": (str, type(None)),
    "modules_loaded": (list,),
}
_REQUIRED_STEP_FIELDS = ("name", "outcome")
_TYPE_NAMES = {str: "a string", int: "a number", float: "a number", list: "an array",
               type(None): "null"}


def parse_record(text: str) -> BootRecord:
    """The record from its JSON text, every field gpunode reads back checked for its type."""
    raw = records.loads_json(text, "record", lambda message: RecordError(
        message.removeprefix("record: ")))
    if not isinstance(raw, dict):
        raise RecordError("not a JSON object")
    version = raw.get("schema_version")
    if not records.is_int(version) or version != SCHEMA_VERSION:
        raise RecordError(f"schema_version is {version!r}, expected {SCHEMA_VERSION}")
    outcome = raw.get("outcome")
    if outcome not in ("ok", "failed", "no-gpu"):
        raise RecordError(f"outcome is {outcome!r}, expected ok, failed or no-gpu")
    for key in ("started_at", "finished_at"):
        if not isinstance(raw.get(key), (str, type(None))):
            raise RecordError(f"{key} is {raw[key]!r}, expected a time as a string")
    steps = raw.get("steps", [])
    if not isinstance(steps, list):
        raise RecordError(f"steps is {_short(steps)}, expected an array of step objects")
    for number, step in enumerate(steps, start=1):
        _check_step(number, step)
    return BootRecord(outcome=outcome, finished_at=raw.get("finished_at"), steps=tuple(steps),
                      raw=raw)


def _check_step(number: int, step: Any) -> None:
    if not isinstance(step, dict):
        raise RecordError(f"step {number} is {_short(step)}, expected an object")
    for key in _REQUIRED_STEP_FIELDS:
        if key not in step:
            raise RecordError(f"step {number} has no {key!r}")
    for key, types in _STEP_FIELDS.items():
        if key not in step:
            continue
        value = step[key]
        if isinstance(value, bool) or not isinstance(value, types):
            expected = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in types))
            raise RecordError(f"step {number} ({_short(step.get('name'))}): {key} is "
                              f"{_short(value)}, expected {expected}")
    if step["outcome"] not in ("ok", "failed"):
        raise RecordError(f"step {number} ({step['name']}): outcome is "
                          f"{_short(step['outcome'])}, expected ok or failed")
    if not all(isinstance(m, str) for m in step.get("modules_loaded", [])):
        raise RecordError(f"step {number} ({step['name']}): modules_loaded is "
                          f"{_short(step['modules_loaded'])}, expected an array of strings")


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
