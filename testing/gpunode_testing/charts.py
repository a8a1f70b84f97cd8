"""Giant Swarm's charts where gpunode's values meet them, for the tests: the released values and
schemas (tests/data/charts/, each with its source commit), Helm's merge of a values file over a
chart's defaults, and the cluster chart's template that writes a structured unit back as the
unit file a node gets.

No Helm runs here, so the two pieces of Helm the values depend on are restated, small:

- `coalesce`: Helm 3's CoalesceValues. Maps merge key by key, the given value wins; anything
  else (a list!) replaces the default whole; a null deletes the key. A subchart gets the
  parent's `<subchart>:` map coalesced over its own defaults, and the parent's `global` over
  its own `global`.
- `unit_text`: `cluster.internal.kubeadm.ignition.containerLinuxConfig.additionalConfig.
  systemd.units` of giantswarm/cluster@ad135475ddd1ab0f2eb2bca6e63bbd72d879b6e3 (v7.0.0),
  helm/cluster/templates/clusterapi/_helpers_flatcar.tpl, line for line: the keys in the
  template's order, one line per list item, `additionalFields` verbatim after `tpl` (which
  changes nothing in a text without `{{`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "charts"
PROVIDERS = {"cluster-azure": "cluster-azure-8.0.0", "cluster-aws": "cluster-aws-9.0.0"}
CLUSTER = "cluster-7.0.0"


def chart_values(directory: str) -> dict[str, Any]:
    return dict(yaml.safe_load((DATA / directory / "values.yaml").read_text()))


def chart_schema(directory: str) -> dict[str, Any]:
    return dict(json.loads((DATA / directory / "values.schema.json").read_text()))


def coalesce(defaults: Any, given: Any) -> Any:
    """Helm's merge of `given` over `defaults` (module docstring); neither is changed."""
    if not (isinstance(defaults, dict) and isinstance(given, dict)):
        return copy.deepcopy(given)
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = coalesce(out.get(key), value)
    return out


def provider_values(fmt: str, values: dict[str, Any]) -> dict[str, Any]:
    """What the provider chart (cluster-azure, cluster-aws) sees: `values` over its defaults."""
    return dict(coalesce(chart_values(PROVIDERS[fmt]), values))


def cluster_values(merged: dict[str, Any]) -> dict[str, Any]:
    """What the `cluster` subchart sees of the provider chart's merged values."""
    own = chart_values(CLUSTER)
    sub = dict(coalesce(own, merged.get("cluster", {})))
    sub["global"] = coalesce(own.get("global", {}), merged.get("global", {}))
    return sub


def schema_errors(fmt: str, values: dict[str, Any]) -> list[str]:
    """Every complaint of the provider chart's schema and the cluster chart's schema (each on
    the values that chart sees), as 'path: message'; [] when both accept the values."""
    import jsonschema

    merged = provider_values(fmt, values)
    errors = []
    for directory, document in ((PROVIDERS[fmt], merged), (CLUSTER, cluster_values(merged))):
        validator = jsonschema.Draft202012Validator(chart_schema(directory))
        errors += [f"{directory}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                   for e in validator.iter_errors(document)]
    return errors


def dig(document: Any, *path: str) -> Any:
    for key in path:
        document = (document or {}).get(key)
    return document


ADDITIONAL = ("ignition", "containerLinuxConfig", "additionalConfig")


def worker_units(sub: dict[str, Any]) -> list[dict[str, Any]]:
    """The units the chart adds to every worker from values (after its own defaults): those for
    all nodes, then those for workers (workers/_helpers_flatcar.tpl)."""
    pi = sub["providerIntegration"]
    return [*(dig(pi, "kubeadmConfig", *ADDITIONAL, "systemd", "units") or []),
            *(dig(pi, "workers", "kubeadmConfig", *ADDITIONAL, "systemd", "units") or [])]


def worker_directories(sub: dict[str, Any]) -> list[dict[str, Any]]:
    pi = sub["providerIntegration"]
    return [*(dig(pi, "kubeadmConfig", *ADDITIONAL, "storage", "directories") or []),
            *(dig(pi, "workers", "kubeadmConfig", *ADDITIONAL, "storage", "directories")
              or [])]


def worker_files(sub: dict[str, Any]) -> list[dict[str, Any]]:
    """The Secret-backed files of workers that come from values (workers/_helpers_files.tpl;
    the chart's own files aside)."""
    return [*(dig(sub, "providerIntegration", "kubeadmConfig", "files") or []),
            *(dig(sub, "internal", "advancedConfiguration", "files") or []),
            *(dig(sub, "providerIntegration", "workers", "kubeadmConfig", "files") or []),
            *(dig(sub, "internal", "advancedConfiguration", "workers", "files") or [])]


def unit_text(contents: dict[str, Any]) -> str:
    """The unit file the chart writes for a structured `contents` (module docstring)."""
    lines: list[str] = []
    unit, service = contents.get("unit"), contents.get("service")
    if unit:
        lines += ["[Unit]", f"Description={unit.get('description', '')}"]
        if "defaultDependencies" in unit:
            lines.append(f"DefaultDependencies={'yes' if unit['defaultDependencies'] else 'no'}")
        for key in ("after", "before", "partOf", "requires", "upholds", "wants"):
            lines += [f"{key[0].upper()}{key[1:]}={v}" for v in unit.get(key) or []]
        if unit.get("bindsTo"):
            lines.append(f"BindsTo={unit['bindsTo']}")
    if service:
        lines.append("[Service]")
        lines += [f"Environment={v}" for v in service.get("environment") or []]
        lines += [f"EnvironmentFile={v}" for v in service.get("environmentFile") or []]
        lines += [f"Type={service.get('type')}", f"RemainAfterExit={service['remainAfterExit']}"]
        if service.get("restart"):
            lines.append(f"Restart={service['restart']}")
        lines += [f"ExecStart={v}" for v in service.get("execStart") or []]
        if service.get("additionalFields"):
            fields = service["additionalFields"]
            assert "{{" not in fields, "Helm's tpl would evaluate it"
            lines += fields.splitlines()
    mount = contents.get("mount")
    if mount:
        lines += ["[Mount]", f"What={mount['what']}", f"Where={mount['where']}"]
        if mount.get("type"):
            lines.append(f"Type={mount['type']}")
    if contents.get("install"):
        lines += ["[Install]", *(f"WantedBy={w}" for w in contents["install"]["wantedBy"])]
    return "\n".join(lines) + "\n"


def settings(text: str) -> dict[tuple[str, str], list[str]]:
    """A unit file as systemd reads its settings: (section, key) → the values in order, a
    space-separated list of units split (After=a b is After=a plus After=b)."""
    out: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        split = key in ("After", "Before", "Wants", "Requires", "WantedBy", "PartOf")
        out.setdefault((section, key), []).extend(value.split() if split else [value])
    return out


def ci_cluster(fmt: str, with_pools: bool = True) -> dict[str, Any]:
    """The chart's own CI cluster (tests/data/charts/*/ci-values.yaml): the values a real
    cluster brings beside gpunode's; without its `global.nodePools` when not with_pools."""
    values = dict(yaml.safe_load((DATA / PROVIDERS[fmt] / "ci-values.yaml").read_text()))
    if not with_pools:
        del values["global"]["nodePools"]
    return values


def values_files(*documents: dict[str, Any]) -> dict[str, Any]:
    """Several `-f` values files, later ones over earlier ones, as Helm merges them."""
    out: dict[str, Any] = {}
    for document in documents:
        out = dict(coalesce(out, document))
    return out
