"""Real containerd 1.6, 1.7 and 2.x read the cluster chart's containerd file before and after
gpunode's edit on a node laid out as cluster-azure provisions it, the version asked of that very
binary as boot asks the node's: the chart's nvidia runtime runs the toolkit's runtime on every
version, 1.7 has CDI on only after the edit (the only change), and the chart's CDI variant is
left as it is. The decisions on fixture hosts: tests/unit/test_containerd_chart.py."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.config import ContainerdConfig
from gpunode.containerd import schema, step
from gpunode.containerd.probe import CommandProbe
from gpunode.platform.systemd import NoSystemd
from helpers.cluster_chart import CONFIG, chart_node, vector
from real.containerd_bins import dump_config, ensure_containerd

VERSIONS = ("1.6", "1.7", "2")


def dumped(binary: Path, path: Path) -> dict[str, Any]:
    doc = tomllib.loads(dump_config(binary, path))
    version = schema.config_version(doc)
    cri = schema.lookup(doc, schema.cri_path(version))
    return {"doc": doc, "cri": cri, "runtimes": schema.lookup(doc, schema.runtimes_path(version))}


def edited(make_host: HostFactory, version: str, name: str) -> tuple[Path, dict, dict, bool]:
    """(the config, containerd `version`'s dump of it before and after boot's edit, whether
    the edit changed the file)."""
    binary = ensure_containerd(version)
    host = chart_node(make_host, name)
    path = host.root / CONFIG
    before = dumped(binary, path)
    _, outcome = step.configure(host, ContainerdConfig(), NoSystemd(), 5,
                                probe=CommandProbe(binary_override=str(binary)))
    return path, before, dumped(binary, path), outcome.changed


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["cluster-azure", "cluster-azure-cdi"])
def test_the_charts_nvidia_runtime_runs_the_toolkit_before_and_after(
    make_host: HostFactory, version: str, name: str,
) -> None:
    _, before, after, _ = edited(make_host, version, name)
    for dump in (before, after):
        nvidia = dump["runtimes"]["nvidia"]
        assert nvidia["runtime_type"] == "io.containerd.runc.v2"
        assert nvidia["options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"
        assert nvidia["options"]["SystemdCgroup"] is True
        assert dump["cri"]["containerd"].get("default_runtime_name", "runc") == "runc"


@pytest.mark.parametrize(("version", "cdi_before", "changed"), [
    ("1.6", None, False),  # no CDI at all: the key is dropped from the dump
    ("1.7", False, True),  # off by default: gpunode switches it on
    ("2", True, False),  # on by default
])
def test_only_containerd_1_7_gets_cdi_switched_on_and_nothing_else_changes(
    make_host: HostFactory, version: str, cdi_before: bool | None, changed: bool,
) -> None:
    path, before, after, did_change = edited(make_host, version, "cluster-azure")
    assert before["cri"].get("enable_cdi") is cdi_before
    assert did_change is changed
    assert path.read_text() == vector("cluster-azure-containerd-1.7" if changed
                                      else "cluster-azure", "expected")
    if version == "1.7":
        assert after["cri"]["enable_cdi"] is True
        assert "/var/run/cdi" in after["cri"]["cdi_spec_dirs"]
        for dump in (before, after):
            dump["cri"].pop("enable_cdi")
    assert after["doc"] == before["doc"]


@pytest.mark.parametrize("version", ["1.7", "2"])
def test_the_charts_cdi_variant_has_cdi_on_and_is_left_as_it_is(
    make_host: HostFactory, version: str,
) -> None:
    path, before, after, changed = edited(make_host, version, "cluster-azure-cdi")
    assert (changed, path.read_text()) == (False, vector("cluster-azure-cdi"))
    assert after["cri"]["enable_cdi"] is True
    assert after["cri"]["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert after["doc"] == before["doc"]


@pytest.mark.parametrize("version", VERSIONS)
def test_containerd_ignores_the_charts_oom_score_under_debug(version: str,
                                                             tmp_path: Path) -> None:
    """The chart's `oom_score = -999` follows `[debug]`: containerd runs with its default 0."""
    path = tmp_path / "config.toml"
    path.write_text(vector("cluster-azure"))
    dump = dumped(ensure_containerd(version), path)["doc"]
    assert dump["oom_score"] == 0
    assert dump["debug"]["level"] == "info"
