"""`gpunode label --registration cluster-azure` renders node pool values that cluster-azure's own
schema accepts: every rendering is validated against the chart's `global.nodePools` /
`$defs.machinePool` (customNodeTaints, customNodeLabels), an excerpt of the real
values.schema.json in tests/data/cluster-azure/.

The validators: always tests/helpers/schema_subset.py, a check of exactly the keywords the
excerpt uses that refuses any other keyword; and also the jsonschema library when it is installed
in this virtualenv (it is not one of the test extras: test_jsonschema_checks_the_cases_too is
skipped, saying so, when it is absent). Each case must hold under both."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO, HostFactory
from gpunode.kube import registration
from helpers import schema_subset
from hostile.support import Cli

SCHEMA = schema_subset.load()
HAVE_JSONSCHEMA = importlib.util.find_spec("jsonschema") is not None
Validator = Callable[[Any], list[str]]


def subset(document: Any) -> list[str]:
    return schema_subset.errors(SCHEMA, document)


def library(document: Any) -> list[str]:
    import jsonschema

    checker = jsonschema.Draft202012Validator(SCHEMA)
    return [f"{list(e.absolute_path)}: {e.message}" for e in checker.iter_errors(document)]


# Every case runs with each validator there is: schema-subset always, jsonschema where installed.
VALIDATORS = [pytest.param(subset, id="schema-subset")] + (
    [pytest.param(library, id="jsonschema")] if HAVE_JSONSCHEMA else [])


@pytest.mark.skipif(not HAVE_JSONSCHEMA, reason="jsonschema is not installed in this "
                    "virtualenv: the cases ran with the schema-subset check only")
def test_jsonschema_checks_the_cases_too() -> None:
    """Says, in the test report, whether the jsonschema library checked the cases as well."""
    assert [v.id for v in VALIDATORS] == ["schema-subset", "jsonschema"]

CONFIGS = {
    "defaults": "",
    "labels-and-every-effect": """
[kubernetes]
taints = ["nvidia.com/gpu=present:NoSchedule", "example.com/gpu-only=true:NoExecute",
          "dedicated=ml-team:PreferNoSchedule"]
labels = { "example.com/pool" = "gpu", "team" = "ml" }
""",
    "no-taints": "[kubernetes]\ntaints = []\n",
}
POOLS = {"default": [], "shortest": ["--pool", "gpu-a"], "longest": ["--pool", "g" * 20],
         "nc24ads": ["--pool", "gpu-a100", "--instance-type", "Standard_NC24ads_A100_v4"]}


def render(make_host: HostFactory, cli: Cli, config: str, flags: list[str]) -> dict[str, Any]:
    root = make_host("nc4as-t4-v3", "ready").root
    if config:
        (root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
        (root / "etc/gpunode/config.toml").write_text(config)
    result = cli("--root", str(root), "label", "--registration", "cluster-azure", *flags)
    assert result.code == 0, result.err
    document = yaml.safe_load(result.out)
    assert isinstance(document, dict)
    return document


@pytest.mark.parametrize("validate", VALIDATORS)
@pytest.mark.parametrize("flags", list(POOLS.values()), ids=list(POOLS))
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_every_cluster_azure_rendering_passes_the_charts_schema(
        make_host: HostFactory, cli: Cli, config: str, flags: list[str],
        validate: Validator) -> None:
    assert validate(render(make_host, cli, config, flags)) == []


def test_every_rendered_taint_has_key_value_and_effect_as_the_config_gives_them(
        make_host: HostFactory, cli: Cli) -> None:
    document = render(make_host, cli, CONFIGS["labels-and-every-effect"], [])
    pool = document["global"]["nodePools"][registration.DEFAULT_POOL]
    assert pool["customNodeTaints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": "example.com/gpu-only", "value": "true", "effect": "NoExecute"},
        {"key": "dedicated", "value": "ml-team", "effect": "PreferNoSchedule"}]
    assert pool["customNodeLabels"] == ["nvidia.com/gpu.present=true", "example.com/pool=gpu",
                                        "team=ml"]


@pytest.mark.parametrize("validate", VALIDATORS)
def test_the_committed_cluster_azure_pool_example_passes_the_charts_schema(
        validate: Validator) -> None:
    assert validate(yaml.safe_load((REPO / "deploy/cluster-azure-gpu-pool.yaml").read_text())) \
        == []


POOL_NAMES = ["gpu00", "gpu-t4", "a" * 20, "gpu", "gpu1", "a" * 21, "-gpu0", "gpu0-", "GPU00",
              "gpu_0", "gpu00\n", "gpü00", "9gpu9"]


# Not "gpu00\n" for jsonschema: it matches patterns with Python's re, whose final $ also
# matches before a newline; Helm's Go validator (and schema_subset) refuse that name.
@pytest.mark.parametrize(("name", "validate"), [
    pytest.param(name, v.values[0], id=f"{name!a}-{v.id}")
    for v in VALIDATORS for name in POOL_NAMES
    if not (v.id == "jsonschema" and name.endswith("\n"))])
def test_gpunode_takes_exactly_the_pool_names_the_chart_takes(name: str,
                                                               validate: Validator) -> None:
    pool = {"global": {"nodePools": {name: {"instanceType": "Standard_NC4as_T4_v3"}}}}
    assert (registration.pool_problem(name) is None) == (validate(pool) == [])


def pool_with(taint: dict[str, Any]) -> dict[str, Any]:
    return {"global": {"nodePools": {"gpu00": {"customNodeTaints": [taint]}}}}


# Documents the chart's schema refuses: the check must refuse each, as jsonschema does.
REFUSED = {
    "taint-without-value": pool_with({"key": "nvidia.com/gpu", "effect": "NoSchedule"}),
    "taint-bad-effect": pool_with({"key": "k", "value": "v", "effect": "NoPlease"}),
    "taint-value-not-a-string": pool_with({"key": "k", "value": True, "effect": "NoSchedule"}),
    "label-not-a-string": {"global": {"nodePools": {"gpu00": {"customNodeLabels": [{"a": "b"}]}}}},
    "pool-name-too-short": {"global": {"nodePools": {"gpu": {}}}},
    "replicas-negative": {"global": {"nodePools": {"gpu00": {"replicas": -1}}}},
    "top-level-provider-integration": {"providerIntegration": {}},
}


@pytest.mark.parametrize("validate", VALIDATORS)
@pytest.mark.parametrize("document", list(REFUSED.values()), ids=list(REFUSED))
def test_the_check_refuses_what_the_charts_schema_refuses(
        document: dict[str, Any], validate: Validator) -> None:
    assert validate(document) != []


def test_the_subset_check_refuses_a_keyword_it_does_not_know(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not in this subset"):
        schema_subset.errors({"type": "string", "pattern": "x"}, "y")
