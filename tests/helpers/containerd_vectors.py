"""The containerd golden vectors (tests/data/containerd/vectors/<name>/: input.toml,
expected.toml and the optional spec.json of the runtime to add), shared by the unit tests of
the edit and the integration tests that show them to real containerd."""

from __future__ import annotations

import json
from typing import Any

from conftest import TEST_DATA
from gpunode.containerd.edit import RuntimeSpec

VECTORS = TEST_DATA / "containerd" / "vectors"


def spec_for(name: str) -> RuntimeSpec:
    """The runtime vector `name` adds: its spec.json, or the defaults where it has none."""
    path = VECTORS / name / "spec.json"
    options: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if "cdi_spec_dirs" in options:
        options["cdi_spec_dirs"] = tuple(options["cdi_spec_dirs"])
    return RuntimeSpec(**options)
