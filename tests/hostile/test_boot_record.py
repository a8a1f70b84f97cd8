"""The pipeline's own record under hostile edits: a failed step's `code` that is no string.

The code is what operators and tests match (gpunode.errors), so a record whose code is a
number, a list or true is refused as a whole, like any other mistyped field, and shown as a
last_boot warning; the live checks still answer.
"""

from __future__ import annotations

import json

import pytest

from conftest import HostFactory
from hostile.support import Cli

RECORD = "/run/gpunode/state.json"


def _record(code: object) -> str:
    step = {"name": "containerd", "outcome": "failed", "duration_ms": 3.0,
            "error": "runtime binary /usr/bin/nvidia-container-runtime is missing",
            "hint": "install the NVIDIA container toolkit", "code": code}
    return json.dumps({"schema_version": 1, "started_at": "2026-11-29T08:00:01Z",
                       "finished_at": "2026-11-29T08:00:02Z", "outcome": "failed",
                       "steps": [step]})


BAD_CODES = {"number": (5, "code is 5, expected a string or null"),
             "list": (["x"], 'code is ["x"], expected a string or null'),
             "true": (True, "code is true, expected a string or null")}


@pytest.mark.parametrize("bad", list(BAD_CODES))
def test_a_failed_step_whose_code_is_no_string_is_a_last_boot_warning(
    make_host: HostFactory, cli: Cli, bad: str
) -> None:
    code, reason = BAD_CODES[bad]
    host = make_host("nc4as-t4-v3", "ready", extra={RECORD: _record(code)})
    result = cli("--root", str(host.root), "status", "--json")
    doc = json.loads(result.out)
    last = next(c for c in doc["checks"] if c["name"] == "last_boot")
    assert (result.code, last["state"], doc["last_boot"]) == (0, "warn", None)
    assert f"step 1 ('containerd'): {reason}" in last["detail"], last["detail"]


def test_a_failed_step_with_a_string_code_is_shown_as_the_last_boots_failure(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra={RECORD: _record("runtime-missing")})
    result = cli("--root", str(host.root), "status", "--json")
    doc = json.loads(result.out)
    last = next(c for c in doc["checks"] if c["name"] == "last_boot")
    assert (last["state"], doc["last_boot"]["steps"][0]["code"]) == ("warn", "runtime-missing")
    assert "containerd: runtime binary" in last["detail"]
