"""The boot record's place and bytes (/run/gpunode/state.json), in a module as cheap to import
as json: boot (gpunode/boot.py) and the CPU node's fast path (gpunode/fastpath.py) write the
same document; gpunode/state.py reads it."""

from __future__ import annotations

import json
from typing import Any

STATE_PATH = "/run/gpunode/state.json"
SCHEMA_VERSION = 1


def render(started_at: str, finished_at: str, outcome: str, steps: list[dict[str, Any]]) -> bytes:
    record = {"schema_version": SCHEMA_VERSION, "started_at": started_at,
              "finished_at": finished_at, "outcome": outcome, "steps": steps}
    return (json.dumps(record, indent=2) + "\n").encode()
