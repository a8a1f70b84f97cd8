"""The boot record's place and bytes (/run/gpunode/state.json), in a module that imports
nothing at all: boot (gpunode/pipeline/boot.py) and the CPU node's fast path (gpunode/pipeline/fastpath.py)
write the same document; gpunode/pipeline/state.py reads it.

The fast path's record is always the same shape, so it is written from a template rather than
by the json module, whose import (with `re`) costs more than that whole boot;
tests/unit/test_fastpath_cpu.py checks that the template gives render()'s bytes exactly.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

STATE_PATH = "/run/gpunode/state.json"
SCHEMA_VERSION = 1

_NO_GPU = """\
{{
  "schema_version": {schema},
  "started_at": "{started}",
  "finished_at": "{finished}",
  "outcome": "no-gpu",
  "steps": [
    {{
      "name": "detect",
      "outcome": "ok",
      "duration_ms": {duration!r},
      "error": null,
      "hint": null,
      "code": null,
      "gpus": 0,
      "functions": 0,
      "changed": false
    }}
  ]
}}
"""


def render(started_at: str, finished_at: str, outcome: str, steps: list[dict[str, Any]]) -> bytes:
    import json

    record = {"schema_version": SCHEMA_VERSION, "started_at": started_at,
              "finished_at": finished_at, "outcome": outcome, "steps": steps}
    return (json.dumps(record, indent=2) + "\n").encode()


def no_gpu_detect_step(duration_ms: float) -> dict[str, Any]:
    """The one step of a boot on a node without NVIDIA function, as the pipeline records it."""
    return {"name": "detect", "outcome": "ok", "duration_ms": duration_ms, "error": None,
            "hint": None, "code": None, "gpus": 0, "functions": 0, "changed": False}


def no_gpu(started_at: str, finished_at: str, duration_ms: float) -> bytes:
    """render(started_at, finished_at, "no-gpu", [no_gpu_detect_step(duration_ms)]), without
    the json module (timestamps are timestamps.utc_timestamp's, which need no escaping)."""
    return _NO_GPU.format(schema=SCHEMA_VERSION, started=started_at, finished=finished_at,
                          duration=float(duration_ms)).encode()
