"""`gpunode nodes`'s pure parts: a Node read down to its row, what a terminal is shown, and
which kubeconfig is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.errors import NodesKubeconfigError
from gpunode.kube import nodes


def test_a_node_without_labels_or_conditions_is_a_row_of_unknowns_that_is_not_ready() -> None:
    row = nodes.row({"metadata": {"name": "x"}})
    assert (row.ready, row.gpu_ready, row.kubelet_ready, row.count, row.gpunode) == (
        False, None, None, None, None)
    assert row.problem.startswith("no GPUReady condition")


def test_odd_values_from_the_server_are_shown_as_text_never_trusted() -> None:
    row = nodes.row({"metadata": {"name": "x", "labels": {"nvidia.com/gpu.count": "8x"}},
                     "status": {"conditions": [{"type": "GPUReady", "status": 1}]}})
    assert (row.count, row.gpu_ready["status"]) == (None, "1")


def test_control_characters_reach_the_terminal_escaped() -> None:
    row = nodes.row({"metadata": {"name": "evil\x1b[2J"}, "status": {"conditions": [
        {"type": "GPUReady", "status": "False", "message": "a\nb\x07"}]}})
    text = nodes.render([row])
    assert "\x1b" not in text and "\x07" not in text
    assert "evil\\x1b[2J: GPUReady=False (no reason): a\\nb\\x07" in text


def test_kubeconfig_comes_from_the_flag_then_one_kubeconfig_then_home(tmp_path: Path) -> None:
    assert nodes.kubeconfig_path("rel/config", {}) == str(Path.cwd() / "rel/config")
    assert nodes.kubeconfig_path(None, {"KUBECONFIG": "/a/b"}) == "/a/b"
    assert nodes.kubeconfig_path(None, {"KUBECONFIG": ""}).endswith("/.kube/config")
    with pytest.raises(NodesKubeconfigError, match="lists 2 files"):
        nodes.kubeconfig_path(None, {"KUBECONFIG": "/a:/b"})
