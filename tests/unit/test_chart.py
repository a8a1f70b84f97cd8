"""The cluster-azure and cluster-aws values: accepted by the real charts' schemas over a real
cluster's values, merged as Helm merges them (every pool and every list of the chart's kept),
the units in the chart's structured form and as the node gets them back, and the Secret. The
bootstrap unit in a real systemd: tests/integration/test_chart_bootstrap.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from conftest import REPO
from gpunode.delivery import chart, chartunit, ignition
from gpunode.errors import InputRefused, UsageError
from gpunode_testing import charts
from helpers.ignition_example import AGENT, SHA512, UNITS, URL, chart_rendered, snippet

PROVIDERS = ("cluster-azure", "cluster-aws")
GPU_UNITS = (chartunit.SYSEXT_UNIT, "gpunode.service", "gpunode-label.service",
             "gpunode-watch.service")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a test dependency) is "
                                 "needed to check the values against the charts' schemas")


def values(fmt: str, pool: chart.Pool | None = None) -> dict[str, Any]:
    """The rendered file as Helm reads it (the header is YAML comments)."""
    return dict(yaml.safe_load(chart_rendered(fmt, pool)))


def on_cluster(fmt: str, pool: chart.Pool | None = None, own_pools: bool = False
               ) -> dict[str, Any]:
    """The chart's CI cluster values (pools or not), then gpunode's, merged as `-f a -f b`."""
    return charts.values_files(charts.ci_cluster(fmt, own_pools), values(fmt, pool))


def subchart(fmt: str, pool: chart.Pool | None = None, own_pools: bool = False
             ) -> dict[str, Any]:
    return charts.cluster_values(charts.provider_values(fmt, on_cluster(fmt, pool, own_pools)))


def ours(fmt: str) -> dict[str, dict[str, Any]]:
    return {u["name"]: u for u in charts.worker_units(subchart(fmt))}


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_both_charts_schemas_accept_the_values_on_a_cluster_without_pools(fmt: str) -> None:
    assert charts.schema_errors(fmt, on_cluster(fmt)) == []


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_both_schemas_accept_the_values_beside_a_clusters_own_pools(fmt: str) -> None:
    pool = chart.Pool(default_pool=False)
    assert charts.schema_errors(fmt, on_cluster(fmt, pool, own_pools=True)) == []


def test_the_schema_check_refuses_what_the_old_values_file_did() -> None:
    """The values shipped before: subchart values at the top, a taint without `value`."""
    old = {"global": {"nodePools": {"gpu-t4": {
        "instanceType": "Standard_NC4as_T4_v3",
        "customNodeTaints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}},
           "providerIntegration": {"workers": {}}}
    errors = charts.schema_errors("cluster-azure", charts.values_files(
        charts.ci_cluster("cluster-azure", False), old))
    assert any("'providerIntegration' was unexpected" in e for e in errors), errors
    assert any("customNodeTaints.0: 'value' is a required property" in e for e in errors)


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_the_charts_default_pool_is_kept_unchanged_beside_the_gpu_pool(fmt: str) -> None:
    defaults = charts.chart_values(charts.PROVIDERS[fmt])["cluster"]["providerIntegration"][
        "workers"]["defaultNodePools"]
    pools = subchart(fmt)["global"]["nodePools"]
    assert set(pools) == {*defaults, chart.DEFAULT_POOL}
    assert {name: pools[name] for name in defaults} == defaults


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_with_no_default_pool_the_clusters_own_pools_stay_as_they_were(fmt: str) -> None:
    own = charts.ci_cluster(fmt)["global"]["nodePools"]
    pools = subchart(fmt, chart.Pool(default_pool=False), own_pools=True)["global"]["nodePools"]
    assert set(pools) == {*own, chart.DEFAULT_POOL}
    assert {name: pools[name] for name in own} == own


@pytest.mark.parametrize(("fmt", "sizing"), [
    ("cluster-azure", {"instanceType": "Standard_NC4as_T4_v3", "replicas": 3}),
    ("cluster-aws", {"instanceType": "g4dn.xlarge", "minSize": 3, "maxSize": 3}),
])
def test_the_gpu_pool_registers_with_the_taint_and_label_and_is_sized(
        fmt: str, sizing: dict[str, Any]) -> None:
    pool = subchart(fmt, chart.Pool(nodes=3))["global"]["nodePools"][chart.DEFAULT_POOL]
    assert pool == {**sizing, "customNodeLabels": ["nvidia.com/gpu.present=true"],
                    "customNodeTaints": [{"key": "nvidia.com/gpu", "value": "present",
                                          "effect": "NoSchedule"}]}


def _lists(document: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], list[Any]]:
    if isinstance(document, dict):
        return {p: v for key, value in document.items()
                for p, v in _lists(value, (*path, key)).items()}
    return {path: document} if isinstance(document, list) else {}


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_no_list_of_the_charts_own_defaults_is_lost_where_the_values_replace_it(
        fmt: str) -> None:
    """Helm replaces a list: every list gpunode's values set keeps every item the provider
    chart's or the cluster chart's defaults had there (cluster-aws: its /var/lib and /var/log
    mounts)."""
    rendered = values(fmt)
    provider = charts.chart_values(charts.PROVIDERS[fmt])
    cluster = {"cluster": charts.chart_values(charts.CLUSTER)}
    replaced = 0
    for defaults in (provider, cluster):
        default_lists = _lists(defaults)
        for path, ours_list in _lists(rendered).items():
            if path in default_lists:
                replaced += 1
                assert [i for i in default_lists[path] if i not in ours_list] == [], path
    assert replaced >= (1 if fmt == "cluster-aws" else 0)  # cluster-aws: the units


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_nothing_goes_where_the_chart_drops_it_or_replaces_its_own(fmt: str) -> None:
    """No storage.files/links (the template never writes them), no raw CLC, no
    preKubeadmCommands (they would replace the chart's)."""
    text = chart_rendered(fmt)
    assert "preKubeadmCommands" not in text and "postKubeadmCommands" not in text
    additional = charts.dig(values(fmt), *chart.UNITS_PATH)
    assert set(additional) == {"systemd", "storage"}
    assert set(additional["storage"]) == {"directories"}
    kept = charts.chart_values(charts.PROVIDERS[fmt])["cluster"]["providerIntegration"][
        "workers"]["kubeadmConfig"].get("preKubeadmCommands")
    merged = subchart(fmt)["providerIntegration"]["workers"]["kubeadmConfig"]
    assert merged.get("preKubeadmCommands") == kept


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


@pytest.mark.parametrize("name", ["gpunode.service", "gpunode-label.service",
                                  "gpunode-watch.service"])
def test_the_unit_the_chart_writes_is_the_one_of_units_plus_the_gpu_condition(
        name: str) -> None:
    written = charts.settings(charts.unit_text(ours("cluster-azure")[name]["contents"]))
    source = charts.settings((UNITS / name).read_text())
    source.setdefault(("Service", "RemainAfterExit"), ["no"])  # systemd's default, spelled
    added = {("Service", "ExecCondition"): [chartunit.GPU_CONDITION.partition("=")[2]]}
    if name == "gpunode.service":
        source[("Unit", "After")].append(chartunit.SYSEXT_UNIT)
    assert written == {**source, **added}


def test_the_bootstrap_unit_runs_before_gpunode_containerd_and_the_kubelet() -> None:
    unit = ours("cluster-azure")[chartunit.SYSEXT_UNIT]["contents"]
    written = charts.settings(charts.unit_text(unit))
    assert written[("Service", "Type")] == ["oneshot"]
    assert written[("Service", "RemainAfterExit")] == ["yes"]
    assert set(written[("Unit", "Before")]) == {"gpunode.service", "containerd.service",
                                                "kubelet.service", "kubeadm.service"}
    assert {"systemd-sysext.service", "ensure-sysext.service"} <= set(
        written[("Unit", "After")])
    # Wanted, not waited for: on a CPU node the ordering alone would delay containerd.
    assert written[("Unit", "Wants")] == ["network-online.target"]
    assert "network-online.target" not in written[("Unit", "After")]
    image = "/opt/extensions/gpunode/gpunode-0.1.0-x86-64.raw"
    assert written[("Service", "Environment")] == [
        f"GPUNODE_SYSEXT_URL={URL}", f"GPUNODE_SYSEXT_SHA512={SHA512}",
        f"GPUNODE_SYSEXT_IMAGE={image}"]
    fetch, merge = written[("Service", "ExecStart")]
    assert "sha512sum --check" in fetch and "--retry" in fetch and "rm -f" in fetch
    assert "/etc/extensions/gpunode.raw" in merge and merge.endswith("systemd-sysext refresh'")
    assert not any(k in written for k in (("Service", "PrivateTmp"),
                                          ("Service", "ProtectHome")))


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
    additional = charts.dig(values("cluster-azure"), *chart.UNITS_PATH)
    assert additional["storage"]["directories"] == [
        {"path": "/opt/extensions/gpunode", "mode": 0o755},
        {"path": "/etc/extensions", "mode": 0o755}]


def test_every_file_comes_from_the_secret_that_is_rendered_beside_the_values() -> None:
    secret = yaml.safe_load(chart_rendered("cluster-secret"))
    assert (secret["apiVersion"], secret["kind"], secret["metadata"]["name"]) == (
        "v1", "Secret", chart.SECRET_NAME)
    files = charts.worker_files(subchart("cluster-azure"))
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


def test_the_units_leave_most_of_cluster_apis_additional_config_to_the_chart() -> None:
    """The chart's own units share the 32768 characters of additionalConfig."""
    written = sum(len(charts.unit_text(u["contents"])) for u in ours("cluster-azure").values()
                  if "contents" in u)
    assert written < ignition.CLC_LIMIT // 4


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
