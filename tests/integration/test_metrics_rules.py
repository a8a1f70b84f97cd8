"""The alert rules and the Grafana dashboard of deploy/ read by the real promtool (tests/real/
promtool.py): the rules parse (`promtool check rules`), their unit tests pass and cover every
alert (`promtool test rules`), and every dashboard query parses with Prometheus' PromQL parser,
names only series gpunode prints, and, evaluated by Prometheus' engine on the fixture nodes'
own `gpunode metrics`, counts what the panel's title says."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpunode_testing import alertrules, metricsfleet
from real import promtool

pytestmark = pytest.mark.usefixtures("real_promtool")
REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy/gpunode-alerts.rules.yaml"
MANIFEST = REPO / "deploy/gpunode-alerts.prometheusrule.yaml"
RULE_TESTS = REPO / "tests/data/metrics/gpunode-alerts.test.yaml"
DASHBOARD = REPO / "deploy/gpunode-dashboard.json"
SCRAPE_LABELS = {"instance", "job"}  # what node-exporter's scrape adds to every series


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, dict[str, str],
                                                                            float]]]:
    """node → its samples (name, labels without empty ones, value): every fixture machine,
    an ND96 whose GPU fell off the bus, a T4 of a 4-GPU size, a CPU node (metricsfleet)."""
    found = {}
    for node, text in metricsfleet.texts(tmp_path_factory.mktemp("fleet")).items():
        found[node] = [(s.name, {k: v for k, v in s.labels.items() if v}, s.value)
                       for family in text_string_to_metric_families(text)
                       for s in family.samples]
    return found


@pytest.fixture(scope="module")
def emitted(fleet: dict[str, list[tuple[str, dict[str, str], float]]]) -> dict[str, set[str]]:
    """Every series name the fleet prints, and the label names it has."""
    names: dict[str, set[str]] = {}
    for samples in fleet.values():
        for name, labels, _ in samples:
            names.setdefault(name, set()).update(labels)
    return names


def check(result: Any) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return str(result.stdout)


# -- the alert rules --------------------------------------------------------------------------


def test_promtool_accepts_the_rule_file_and_the_prometheusrules_groups(tmp_path: Path) -> None:
    assert "SUCCESS: 7 rules found" in check(promtool.run(["check", "rules", RULES]))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(MANIFEST.read_text())["spec"]))
    assert "SUCCESS: 7 rules found" in check(promtool.run(["check", "rules", spec]))


def test_the_prometheusrule_is_the_rule_file_as_the_generator_writes_it() -> None:
    assert MANIFEST.read_text() == alertrules.render(RULES.read_text())


def test_the_rules_unit_tests_pass_and_each_alert_fires_in_one() -> None:
    assert "SUCCESS" in check(promtool.run(["test", "rules", RULE_TESTS.name],
                                           cwd=RULE_TESTS.parent))
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    fired = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == alerts


def test_every_alert_has_a_one_line_runbook_and_a_severity() -> None:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert "\n" not in rule["annotations"]["runbook"].strip(), rule["alert"]
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]


def test_the_rules_and_their_tests_use_only_series_gpunode_prints(
        emitted: dict[str, set[str]]) -> None:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert set(metric_names(rule["expr"])) <= set(emitted), rule["alert"]
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for series in test["input_series"]:
            name, _, labels = series["series"].partition("{")
            assert name in emitted, series
            assert set(re.findall(r'(\w+)="', labels)) <= emitted[name] | SCRAPE_LABELS, series


# -- the dashboard ----------------------------------------------------------------------------

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$node": "nc4as-t4-v3"}
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                "group_right", "bool", "offset"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables filled in) of every panel target."""
    queries = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append((panel["title"], expr))
    return queries


def metric_names(expr: str) -> list[str]:
    """The series names a PromQL expression selects (not its functions, keywords, labels)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    words = re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", bare)
    return [w for w, call in words if not call and w not in PROMQL_WORDS]


def test_every_dashboard_query_parses_with_prometheus_own_parser(tmp_path: Path) -> None:
    rules = tmp_path / "dashboard.rules.yaml"
    queries = dashboard_queries()
    recorded = [{"record": f"dashboard:query_{n}", "expr": expr}
                for n, (_, expr) in enumerate(queries)]
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]}))
    assert f"SUCCESS: {len(queries)} rules found" in check(promtool.run(["check", "rules",
                                                                        rules]))


def test_the_dashboard_names_only_series_gpunode_prints(emitted: dict[str, set[str]]) -> None:
    used = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
    templating = json.loads(DASHBOARD.read_text())["templating"]["list"]
    used |= {name for v in templating if v["type"] == "query"
             for name in re.findall(r"label_values\((\w+)", v["definition"])}
    assert used and used <= set(emitted), used - set(emitted)


def test_the_fleet_panels_count_the_fixture_fleet_as_prometheus_evaluates_them(
        fleet: dict[str, list[tuple[str, dict[str, str], float]]], tmp_path: Path) -> None:
    series = [{"series": _selector(name, {**labels, "instance": node, "job": "node-exporter"}),
               "values": f"{value:g}x5"} for node, samples in fleet.items()
              for name, labels, value in samples]
    ready = {node: v for node, samples in fleet.items() for name, _, v in samples
             if name == "gpunode_gpu_ready_condition"}
    states = [labels for name, labels, v in fleet["nd96-fallen"]
              if name == "gpunode_gpu_state" and v == 1]
    counts = {node: {name: v for name, _, v in samples if name.startswith("gpunode_gpus_")}
              for node, samples in fleet.items()}
    missing = sum(max(0, c["gpunode_gpus_expected"] - c["gpunode_gpus_detected"])
                  for c in counts.values() if "gpunode_gpus_expected" in c)
    queries = dict(dashboard_queries())
    cases = [
        (queries["GPU nodes ready"], [{"labels": "{}", "value": sum(ready.values())}]),
        (queries["GPU nodes not ready"],
         [{"labels": "{}", "value": len(ready) - sum(ready.values())}]),
        (queries["Boots failed"], [{"labels": "{}", "value": 0}]),
        (queries["GPUs missing"], [{"labels": "{}", "value": missing}]),
        (queries["GPUs"].replace("nc4as-t4-v3", "nd96-fallen"), [{"labels": _selector(
            "gpunode_gpu_state", {**labels, "instance": "nd96-fallen", "job": "node-exporter"}),
            "value": 1} for labels in states]),
    ]
    assert 0 < sum(ready.values()) < len(ready) and missing == 3  # both kinds of node
    assert [s["state"] for s in states].count("fell-off-bus") == 1 and len(states) == 8
    tests = tmp_path / "dashboard.test.yaml"
    (tmp_path / "empty.rules.yaml").write_text("groups: []\n")
    tests.write_text(yaml.safe_dump({
        "rule_files": ["empty.rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
            {"expr": expr, "eval_time": "2m", "exp_samples": samples}
            for expr, samples in cases]}]}))
    assert "SUCCESS" in check(promtool.run(["test", "rules", tests.name], cwd=tmp_path))


def _selector(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"
