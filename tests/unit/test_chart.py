"""The cluster-azure and cluster-aws values as gpunode prints them: the pools, the units in the
chart's structured form, the directories, the files and the Secret they come from, and every
unit or option the charts cannot take refused. What the charts make of the values, rendered by
a real helm: tests/integration/test_chart_helm.py; the bootstrap unit in a real systemd:
tests/integration/test_chart_bootstrap.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from conftest import REPO
from gpunode.delivery import chart, chartunit, ignition
from gpunode.errors import InputRefused, UsageError
from helpers.ignition_example import AGENT, SHA512, UNITS, chart_rendered, snippet

PROVIDERS = ("cluster-azure", "cluster-aws")
GPU_UNITS = (chartunit.SYSEXT_UNIT, "gpunode.service", "gpunode-label.service",
             "gpunode-watch.service")


def values(fmt: str, pool: chart.Pool | None = None) -> dict[str, Any]:
    """The rendered file as Helm reads it (the header is YAML comments)."""
    return dict(yaml.safe_load(chart_rendered(fmt, pool)))


def additional(fmt: str) -> dict[str, Any]:
    document: Any = values(fmt)
    for key in chart.UNITS_PATH:
        document = document[key]
    return dict(document)


def ours(fmt: str) -> dict[str, dict[str, Any]]:
    return {u["name"]: u for u in additional(fmt)["systemd"]["units"]}


@pytest.mark.parametrize(("fmt", "sizing"), [
    ("cluster-azure", {"instanceType": "Standard_NC4as_T4_v3", "replicas": 3}),
    ("cluster-aws", {"instanceType": "g4dn.xlarge", "minSize": 3, "maxSize": 3}),
])
def test_the_gpu_pool_registers_with_the_taint_and_label_and_is_sized(
        fmt: str, sizing: dict[str, Any]) -> None:
    pool = values(fmt, chart.Pool(nodes=3))["global"]["nodePools"][chart.DEFAULT_POOL]
    assert pool == {**sizing, "customNodeLabels": ["nvidia.com/gpu.present=true"],
                    "customNodeTaints": [{"key": "nvidia.com/gpu", "value": "present",
                                          "effect": "NoSchedule"}]}


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_the_charts_default_pool_rides_along_unless_the_cluster_has_pools(fmt: str) -> None:
    """By default the chart's own default pool is listed beside the GPU pool (a nodePools map
    replaces the chart's defaults); with --no-default-pool only the GPU pool is."""
    name, default = chart.CHARTS[fmt].default_pool
    assert values(fmt)["global"]["nodePools"][name] == default
    assert set(values(fmt, chart.Pool(default_pool=False))["global"]["nodePools"]) == {
        chart.DEFAULT_POOL}


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_nothing_goes_where_the_chart_drops_it_or_replaces_its_own(fmt: str) -> None:
    """No storage.files/links (the template never writes them), no raw CLC, no
    preKubeadmCommands (they would replace the chart's)."""
    text = chart_rendered(fmt)
    assert "preKubeadmCommands" not in text and "postKubeadmCommands" not in text
    assert set(additional(fmt)) == {"systemd", "storage"}
    assert set(additional(fmt)["storage"]) == {"directories"}


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_the_units_are_the_mask_the_bootstrap_and_gpunodes_own_in_the_structured_form(
        fmt: str) -> None:
    units = ours(fmt)
    assert units["nvidia.service"] == {"name": "nvidia.service", "mask": True,
                                       "enabled": False}
    for name in GPU_UNITS:
        unit = units[name]
        assert unit["enabled"] is True and set(unit) == {"name", "enabled", "contents"}
        service = unit["contents"]["service"]
        assert isinstance(service["type"], str) and service["remainAfterExit"] in ("yes", "no")
        assert service["additionalFields"].splitlines()[0] == chartunit.GPU_CONDITION
        assert "{{" not in service["additionalFields"]
        assert unit["contents"]["install"] == {"wantedBy": ["multi-user.target"]}
    assert list(units)[-5:] == ["nvidia.service", *GPU_UNITS]


def test_cluster_aws_values_carry_the_charts_own_worker_units_first() -> None:
    """Helm replaces a list: cluster-aws's own /var/lib and /var/log mounts, at the very path
    gpunode's units go, are carried unchanged (the render proves the chart keeps them:
    test_chart_helm.py's CPU pool comparison)."""
    assert list(ours("cluster-aws"))[:2] == ["var-lib.mount", "var-log.mount"]
    assert next(iter(ours("cluster-azure"))) == "nvidia.service"


def test_a_percent_escape_in_the_url_reaches_curl_as_written() -> None:
    url = "https://downloads.example.com/gpu%20node/gpunode.raw"
    unit = chart.units(ignition.snippet(url, SHA512, None, UNITS))[1]
    assert unit["contents"]["service"]["environment"][0] == (
        "GPUNODE_SYSEXT_URL=https://downloads.example.com/gpu%%20node/gpunode.raw")


@pytest.mark.parametrize("url", ["https://example.com/a'b.raw", 'https://example.com/a"b.raw',
                                 "https://example.com/$x.raw", "https://example.com/a`b.raw"])
def test_a_url_the_unit_could_not_quote_is_refused(url: str) -> None:
    with pytest.raises(UsageError, match="cannot go into the chart's unit"):
        chart.units(ignition.snippet(url, SHA512, None, UNITS))


def test_the_directories_are_those_the_bootstrap_unit_writes_into() -> None:
    assert additional("cluster-azure")["storage"]["directories"] == [
        {"path": "/opt/extensions/gpunode", "mode": 0o755},
        {"path": "/etc/extensions", "mode": 0o755}]


def test_every_file_comes_from_the_secret_that_is_rendered_beside_the_values() -> None:
    secret = yaml.safe_load(chart_rendered("cluster-secret"))
    assert (secret["apiVersion"], secret["kind"], secret["metadata"]["name"]) == (
        "v1", "Secret", chart.SECRET_NAME)
    files: Any = values("cluster-azure")
    for key in chart.FILES_PATH:
        files = files[key]
    assert {f["path"]: (f["permissions"], f["contentFrom"]["secret"]) for f in files} == {
        "/etc/gpunode/config.toml": ("0644", {"name": chart.SECRET_NAME, "key": "config.toml"}),
        "/etc/modprobe.d/blacklist-nouveau.conf": (
            "0644", {"name": chart.SECRET_NAME, "key": "blacklist-nouveau.conf"})}
    assert secret["stringData"]["config.toml"] == AGENT
    assert secret["stringData"]["blacklist-nouveau.conf"].startswith("blacklist nouveau\n")


def test_without_an_agent_config_the_secret_carries_only_the_blacklist() -> None:
    assert set(chart.secret(snippet(None))["stringData"]) == {"blacklist-nouveau.conf"}
    assert [f["path"] for f in chart.files(snippet(None))] == [
        "/etc/modprobe.d/blacklist-nouveau.conf"]


@pytest.mark.parametrize(("name", "fmt"), [("cluster-azure-values.yaml", "cluster-azure"),
                                           ("cluster-aws-values.yaml", "cluster-aws"),
                                           ("gpunode-secret.yaml", "cluster-secret")])
def test_committed_chart_examples_are_current(name: str, fmt: str) -> None:
    assert (REPO / "ignition" / name).read_text() == chart_rendered(fmt)


@pytest.mark.parametrize(("text", "message"), [
    ("[Unit]\nDescription=x\nConditionPathExists=/x\n", r"\[Unit\] ConditionPathExists=.*no "
     "place"),
    ("[Unit]\nDescription=x\n[Install]\nAlias=y.service\n", r"\[Install\] Alias="),
    ("[Unit]\nDescription=x\n[Service]\nExecStart=/bin/echo {{ .x }}\n", "{{"),
    ("[Unit]\nDescription=x\nAfter=\n", "an empty assignment"),
    ("[Service]\nType=oneshot\n", "no Description="),
    ("[Timer]\nOnBootSec=1\n", r"\[Timer\]"),
])
def test_a_unit_the_chart_cannot_express_is_refused_naming_the_setting(
        text: str, message: str) -> None:
    with pytest.raises(InputRefused, match=message):
        chartunit.structured(text, "units/x.service")


def test_pool_options_are_checked_against_the_charts_schema() -> None:
    assert chart.pool_settings("cluster-aws", "gpu-a10g", "g5.xlarge", 2) == chart.Pool(
        "gpu-a10g", "g5.xlarge", 2)
    for args, message in [(("cluster-azure", "gpu", None, None), "5-20 lowercase"),
                          (("cluster-aws", None, "Standard_NC4as_T4_v3", None), "g4dn"),
                          (("cluster-azure", None, None, 1001), "0 to 1000"),
                          (("cluster-azure", "def00", None, None), "default pool"),
                          (("butane", "gpu00", None, None), "only --format cluster-azure")]:
        with pytest.raises(UsageError, match=message):
            chart.pool_settings(*args)
