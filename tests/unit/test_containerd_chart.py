"""The containerd file the cluster chart (cluster-azure 8.0.0's `cluster` 7.0.0) writes on every
node: the golden vectors are its template rendered, and gpunode leaves it as it is, except the
two CDI lines containerd 1.7 needs; nothing is restarted for a file left alone.
tests/data/containerd/cluster-chart/README.md says where the template and its values come from;
real containerd's dumps of it: tests/integration/test_containerd_chart_real.py."""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TEST_DATA, HostFactory
from gpunode.cli.main import main
from gpunode.config import ContainerdConfig
from gpunode.containerd import extras, step
from gpunode.containerd.ledger import MEMLOCK_DROPIN
from gpunode.containerd.probe import NoProbe
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from helpers import fake_containerd
from helpers.cluster_chart import CONFIG, chart_node, vector
from helpers.fake_containerd import RecordingSystemd

TEMPLATE = TEST_DATA / "containerd" / "cluster-chart" / "config.toml.tpl"
# Each action of the template and what cluster-azure 8.0.0's values make of it (the README).
VALUES = {
    "$.Values.global.components.containerd.debug.level": "info",
    'include "cluster.image.registry" $': "gsoci.azurecr.io",
    "$.Values.providerIntegration.components.containerd.sandboxContainerImage.name":
        "giantswarm/pause",
    "$.Values.providerIntegration.components.containerd.sandboxContainerImage.tag": "3.10.1",
    'include "cluster.containerd.selinux.enabled" $': "false",
    "$.Values.global.components.containerd.cdi.specDirs | toJson": '["/etc/cdi","/var/run/cdi"]',
}
CDI_IF = "if $.Values.global.components.containerd.cdi.enabled"
ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def render(template: str, cdi: bool) -> str:
    """The template as helm's text/template renders it: `{{-` trims the whitespace before an
    action, `-}}` the whitespace after it; an action this table does not know fails."""
    out: list[str] = []
    shown = [True]
    position, trim_next = 0, False
    for match in ACTION.finditer(template):
        text = template[position:match.start()]
        text = text.lstrip() if trim_next else text
        text = text.rstrip() if match.group(1) else text
        if all(shown):
            out.append(text)
        action = match.group(2)
        if action == CDI_IF:
            shown.append(cdi)
        elif action == "end":
            shown.pop()
        elif all(shown):
            out.append(VALUES[action])
        position, trim_next = match.end(), bool(match.group(3))
    rest = template[position:]
    out.append(rest.lstrip() if trim_next else rest)
    return "".join(out)


@pytest.mark.parametrize(("name", "cdi"), [("cluster-azure", False),
                                           ("cluster-azure-containerd-1.7", False),
                                           ("cluster-azure-cdi", True)])
def test_the_vector_is_the_charts_template_rendered(name: str, cdi: bool) -> None:
    assert render(TEMPLATE.read_text(), cdi) == vector(name)


def test_the_charts_oom_score_lands_in_its_debug_table() -> None:
    """TOML puts the keys after `[debug]` into that table; containerd ignores them there."""
    doc = tomllib.loads(vector("cluster-azure"))
    assert "oom_score" not in doc
    assert doc["debug"] == {"level": "info", "oom_score": -999, "disabled_plugins": []}


@dataclass
class Probe(NoProbe):
    """The containerd version a test says the node runs; no dump."""

    daemon: tuple[int, int] | None

    def version(self, binary: str) -> tuple[int, int] | None:
        assert binary == "/opt/bin/containerd"  # the one the image-builder drop-in runs
        return self.daemon

    def dump(self, binary: str, path: str) -> None:
        return None


def tree(host: Host) -> dict[str, bytes | None]:
    return {str(p.relative_to(host.root)): p.read_bytes() if p.is_file() else None
            for p in sorted(host.root.rglob("*"))}


DAEMONS = [(1, 6), (2, 1), None]  # None: under --root, nobody can ask the version
DAEMON_IDS = ["containerd1.6", "containerd2.1", "version-unknown"]


@pytest.mark.parametrize("daemon", DAEMONS, ids=DAEMON_IDS)
def test_the_boot_step_leaves_the_charts_file_and_the_node_alone(
    make_host: HostFactory, daemon: tuple[int, int] | None,
) -> None:
    host = chart_node(make_host)
    before = tree(host)
    systemd = RecordingSystemd(state="active")
    the_plan, outcome = step.configure(host, ContainerdConfig(), systemd, 5,
                                       probe=Probe(daemon))
    assert the_plan.describe() == [
        "/etc/containerd/config.toml: runtime 'nvidia' is already as configured"]
    assert (outcome.changed, outcome.restarted, systemd.calls) == (False, False, [])
    assert tree(host) == before


@pytest.mark.parametrize("daemon", [*DAEMONS, (1, 7)], ids=[*DAEMON_IDS, "containerd1.7"])
def test_at_first_boot_the_memlock_dropin_is_written_and_nothing_restarted(
    make_host: HostFactory, daemon: tuple[int, int] | None,
) -> None:
    """Before containerd starts: the config file stays byte for byte (1.7: plus the CDI
    lines), the LimitMEMLOCK drop-in beside it is read by one daemon-reload, and containerd
    starts once, with both."""
    host = chart_node(make_host, memlock=False)
    systemd = RecordingSystemd(state="inactive")
    _, outcome = step.configure(host, ContainerdConfig(), systemd, 5, probe=Probe(daemon))
    assert (host.root / CONFIG).read_text() == (
        vector("cluster-azure-containerd-1.7", "expected") if daemon == (1, 7)
        else vector("cluster-azure"))
    assert (host.root / MEMLOCK_DROPIN.lstrip("/")).read_text() == extras.MEMLOCK_TEXT
    assert (outcome.restarted, systemd.calls) == (False, ["daemon-reload"])


def test_containerd_1_7_gets_the_two_cdi_lines_and_nothing_else(make_host: HostFactory) -> None:
    host = chart_node(make_host)
    step.configure(host, ContainerdConfig(), NoSystemd(), 5, probe=Probe((1, 7)))
    text = (host.root / CONFIG).read_text()
    assert text == vector("cluster-azure-containerd-1.7", "expected")
    diff = [line for line in difflib.ndiff(vector("cluster-azure").splitlines(),
                                           text.splitlines()) if line[:2] in ("- ", "+ ")]
    assert diff == ["+ enable_cdi = true", '+ cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]']
    assert not step.plan(host, ContainerdConfig(), NoSystemd(), probe=Probe((1, 7))).changed


def test_the_cdi_lines_on_a_running_containerd_1_7_restart_it_once(
    make_host: HostFactory,
) -> None:
    host = chart_node(make_host)
    with fake_containerd.listening(host):  # the chart's file sets no [grpc] address
        systemd = RecordingSystemd(state="active")
        _, outcome = step.configure(host, ContainerdConfig(), systemd, 5, probe=Probe((1, 7)))
    assert (outcome.restarted, systemd.calls) == (True, ["restart containerd.service"])


@pytest.mark.parametrize("daemon", [(1, 6), (1, 7), (2, 1), None],
                         ids=["containerd1.6", "containerd1.7", "containerd2.1",
                              "version-unknown"])
def test_the_charts_cdi_variant_is_left_alone_on_every_version(
    make_host: HostFactory, daemon: tuple[int, int] | None,
) -> None:
    host = chart_node(make_host, "cluster-azure-cdi")
    before = tree(host)
    systemd = RecordingSystemd(state="active")
    _, outcome = step.configure(host, ContainerdConfig(), systemd, 5, probe=Probe(daemon))
    assert (outcome.changed, systemd.calls) == (False, [])
    assert tree(host) == before


def run(capsys: pytest.CaptureFixture[str], root: Path, *argv: str) -> tuple[int, str]:
    code = main(["--log-format", "json", "--root", str(root), *argv])
    return code, capsys.readouterr().out


def test_containerd_configure_says_already_configured_and_writes_nothing(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str],
) -> None:
    host = chart_node(make_host)
    before = tree(host)
    code, out = run(capsys, host.root, "containerd", "configure")
    assert (code, out) == (0, "/etc/containerd/config.toml: runtime 'nvidia' is already as "
                              "configured\n")
    after = tree(host)
    assert set(after) - set(before) == {"run", "run/gpunode", "run/gpunode/lock"}  # the node lock
    assert {k: after[k] for k in before} == before


def test_boot_on_the_chart_node_records_the_containerd_step_unchanged(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str],
) -> None:
    host = chart_node(make_host)
    code, _ = run(capsys, host.root, "boot")
    record = json.loads((host.root / "run/gpunode/state.json").read_text())
    containerd = next(s for s in record["steps"] if s["name"] == "containerd")
    assert (code, record["outcome"]) == (0, "ok")
    assert (containerd["changed"], containerd["restarted"]) == (False, False)
    assert (host.root / CONFIG).read_text() == vector("cluster-azure")
    code, out = run(capsys, host.root, "status")
    assert (code, out.splitlines()[0].endswith("READY")) == (0, True)
