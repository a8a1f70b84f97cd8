"""Each fact gpunode states is written in one place: a text, path or format found in two
modules drifts (issue 11 found status's nouveau hint, device nodes and timestamps disagreeing
with the code that acts on them). Read from the package's string constants (ast): docstrings
and fixtures.py (fake host trees, test data) left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "gpunode"

# fact → a piece of its one spelling
FACTS = {
    "the nouveau blacklist": "options nouveau modeset=0",
    "the nouveau blacklist file": "/etc/modprobe.d/blacklist-nouveau.conf",
    "the agent config path": "/etc/gpunode/config.toml",
    "the timestamp format": "%Y-%m-%dT%H:%M:%S",
    "systemd's ExecStart prefixes": "-@+!:",
    "the kubelet's flag file": "/var/lib/kubelet/kubeadm-flags.env",
    "the running kernel's release": "/proc/sys/kernel/osrelease",
    "this boot's id": "/proc/sys/kernel/random/boot_id",
    "Flatcar's own driver unit": "nvidia.service",
    "Flatcar's sysext enablement file": "/etc/flatcar/enabled-sysext.conf",
    "the temporary-file suffix": ".gpunode-tmp",
    "the NVIDIA modules' load order": "nvidia_peermem",
    "the driver's /proc directory": "/proc/driver/nvidia",
    "gpunode's containerd drop-in": "10-gpunode.conf",
    "gpunode's kubelet drop-in": "20-gpunode-registration.conf",
}


def _constants(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


@pytest.mark.parametrize("fact", list(FACTS))
def test_the_fact_is_spelled_in_one_module(fact: str) -> None:
    spelled = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "fixtures.py" and any(FACTS[fact] in c for c in _constants(p)))
    assert len(spelled) == 1, f"{fact} is spelled in {spelled}"
