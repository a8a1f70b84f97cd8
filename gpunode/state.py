"""The boot record /run/gpunode/state.json: what the last `gpunode boot` did, step by step.

/run is emptied at every boot, so a record found there always belongs to the current boot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpunode.host import Host

STATE_PATH = "/run/gpunode/state.json"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class BootRecord:
    outcome: str  # "ok", "failed" or "no-gpu"
    finished_at: str | None
    steps: tuple[dict[str, Any], ...]
    raw: dict[str, Any]

    @property
    def failed_steps(self) -> tuple[dict[str, Any], ...]:
        return tuple(s for s in self.steps if s.get("outcome") == "failed")


class RecordError(ValueError):
    """The record exists but cannot be understood; the message says what is wrong."""


def read_record(host: Host) -> BootRecord | None:
    text = host.read_optional(STATE_PATH)
    if text is None:
        return None
    return parse_record(text)


def parse_record(text: str) -> BootRecord:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecordError("not a JSON object")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(f"schema_version is {raw.get('schema_version')!r}, expected "
                          f"{SCHEMA_VERSION}")
    outcome = raw.get("outcome")
    if outcome not in ("ok", "failed", "no-gpu"):
        raise RecordError(f"outcome is {outcome!r}, expected ok, failed or no-gpu")
    steps = raw.get("steps", [])
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise RecordError("steps is not a list of objects")
    return BootRecord(outcome=outcome, finished_at=raw.get("finished_at"), steps=tuple(steps),
                      raw=raw)
