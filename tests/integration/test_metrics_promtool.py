"""`gpunode metrics` read by the real promtool (Debian's prometheus package, tests/real/
promtool.py): `promtool check metrics` parses the text with the Go parser a scrape and
node-exporter's textfile collector use, and lints names, help and counter suffixes."""

from __future__ import annotations

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.watch import once
from gpunode_testing import fixtures
from helpers.watch_api import FakeApi
from hostile.support import Cli
from real import promtool

pytestmark = pytest.mark.usefixtures("real_promtool")
MACHINE_STATES = [(m.name, s) for m in fixtures.MACHINES.values() for s in m.states]


@pytest.mark.parametrize(("machine", "state"), MACHINE_STATES,
                         ids=[f"{m}-{s}" for m, s in MACHINE_STATES])
def test_promtool_accepts_the_metrics_of_every_fixture_node(
        cli: Cli, make_host: HostFactory, machine: str, state: str) -> None:
    result = cli("--root", str(make_host(machine, state).root), "metrics")
    assert result.code == 0, result.err
    checked = promtool.run(["check", "metrics"], stdin=result.out)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_promtool_accepts_the_textfile_of_a_node_whose_watch_found_xids_and_a_repair(
        make_host: HostFactory) -> None:
    host = make_host("nd96amsr-a100-v4", "ready", extra={
        "/run/metadata/flatcar": "COREOS_AZURE_VMSIZE=Standard_ND96amsr_A100_v4\n",
        "/etc/containerd/config.toml": fixtures.FLATCAR_CONTAINERD_CONFIG})
    (host.root / "dev/kmsg").write_text(
        "3,1,1000000,-;NVRM: Xid (PCI:0001:00:00): 79, pid=1122, GPU has fallen off the bus.\n"
        "3,2,2000000,-;NVRM: Xid (PCI:0002:00:00): 13, pid=7, name=python, Graphics Exception\n")
    once.run(host, AgentConfig(kubernetes=KubernetesConfig(node_name="nd96-0")), False,
             FakeApi)
    text = (host.root / "var/lib/node_exporter/textfile_collector/gpunode.prom").read_text()
    assert "gpunode_xids_total{" in text and "gpunode_containerd_config_repairs_total 1" in text
    checked = promtool.run(["check", "metrics"], stdin=text)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")
