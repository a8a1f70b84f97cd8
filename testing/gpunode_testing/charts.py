"""Giant Swarm's cluster charts rendered by a real helm, read back as Cluster API objects.

The charts are test data at pinned commits in `../shared/charts/` beside the checkout (never
copied into the project): cluster-azure 8.0.0 and cluster-aws 9.0.0, each with its `cluster`
7.0.0 subchart under `charts/cluster`. `helm template` renders them with the values files given
(helm itself merges them over the charts' defaults and checks both charts' schemas), and the
output is read with a YAML loader that refuses a duplicate key, so a document holding two
objects is an error rather than the last object silently winning.

What helm cannot tell, and so stays in the tests: what Cluster API's kubeadm bootstrap and
Flatcar's config transpiler make of a pool's Container Linux Config (no transpiler is packaged
by a registry the tests reach: docs/delivery.md), and what a node does with it
(tests/integration/test_chart_bootstrap.py runs the rendered units in a real systemd).
`settings` reads a unit file as systemd does, to compare the rendered units with units/.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHECKOUT = Path(__file__).resolve().parents[2]


def shared_charts() -> Path:
    """../shared/charts beside the checkout; for a clone of a local checkout (CI clones one
    into a directory of its own), beside the checkout it was cloned from."""
    beside = CHECKOUT.parent / "shared" / "charts"
    if beside.is_dir():
        return beside
    try:
        origin = subprocess.run(["git", "-C", str(CHECKOUT), "config", "--get",
                                 "remote.origin.url"], capture_output=True, text=True,
                                timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return beside
    source = Path(origin.removeprefix("file://"))
    if origin and source.is_absolute() and (source.parent / "shared" / "charts").is_dir():
        return source.parent / "shared" / "charts"
    return beside


SHARED_CHARTS = shared_charts()
RELEASE = "test-wc"  # the charts' own CI clusters are named so
NAMESPACE = "org-giantswarm"
CLC_LIMIT = 32768  # Cluster API's ContainerLinuxConfig.additionalConfig maxLength
RENDER_TIMEOUT_S = 120


@dataclass(frozen=True)
class Chart:
    """One provider chart as the tests render it."""

    name: str
    directory: str  # under SHARED_CHARTS
    commit: str

    @property
    def path(self) -> Path:
        return SHARED_CHARTS / self.directory

    @property
    def ci_values(self) -> Path:
        """The chart's own CI cluster: the values a real cluster brings beside gpunode's."""
        return self.path / "ci" / "ci-values.yaml"


CHARTS = {
    "cluster-azure": Chart("cluster-azure", "azure-v8.0.0",
                           "d5bdf6ae61ca69df9b8b28235e84f7392ad7d2c2"),
    "cluster-aws": Chart("cluster-aws", "aws-v9.0.0", "371a1cac60e76c45f84d08c1bacd1d6aa3b6afa7"),
}
POOL_KINDS = ("MachineDeployment", "MachinePool")


def missing() -> str | None:
    """Why the charts cannot be rendered here, or None when every one is in place."""
    absent = [str(c.path) for c in CHARTS.values() if not (c.path / "Chart.yaml").is_file()]
    if absent:
        return (f"the Giant Swarm charts are test data in ../shared/charts beside the checkout "
                f"or the checkout it was cloned from (shared/charts/README.md), absent here: "
                f"{', '.join(absent)}")
    return None


def ci_values_without_pools(fmt: str, directory: Path) -> Path:
    """The chart's CI cluster without its `global.nodePools` (so the chart's default pools, or
    only the values' pools where those list some), written into `directory`."""
    values = yaml.safe_load(CHARTS[fmt].ci_values.read_text())
    del values["global"]["nodePools"]
    path = directory / f"{fmt}-ci-without-pools.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


class HelmFailed(RuntimeError):
    """`helm template` exited non-zero; carries the command and what helm printed."""

    def __init__(self, command: Sequence[str], returncode: int, stderr: str) -> None:
        self.command, self.returncode, self.stderr = list(command), returncode, stderr
        super().__init__(f"{' '.join(command)} exited {returncode}:\n{stderr.strip()}")


def template(helm: Path, chart: Path, values: Iterable[Path]) -> str:
    """`helm template` of `chart` with the values files, later ones over earlier ones."""
    command = [str(helm), "template", RELEASE, str(chart), "--namespace", NAMESPACE]
    for path in values:
        command += ["--values", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=RENDER_TIMEOUT_S)
    if result.returncode != 0:
        raise HelmFailed(command, result.returncode, result.stderr)
    return result.stdout


class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """PyYAML's safe loader (with libyaml's parser where PyYAML has it), refusing a mapping
    that repeats a key (YAML says keys are unique; PyYAML and Go's non-strict decoders keep
    the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first at line {seen[key].start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def strict_load_all(text: str) -> list[Any]:
    """Every YAML document of `text`; a duplicate key raises yaml's ConstructorError."""
    return list(yaml.load_all(text, Loader=_StrictLoader))


def strict_load(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)


class NotOneObject(ValueError):
    """A rendered document that is not exactly one Kubernetes object."""


@dataclass(frozen=True)
class Pool:
    """A worker pool as the chart renders it: the MachineDeployment or MachinePool and the
    references it makes to its bootstrap config and its infrastructure template."""

    name: str  # the pool's key in global.nodePools, e.g. "def00"
    kind: str
    bootstrap: tuple[str, str]  # (kind, name)
    infrastructure: tuple[str, str]


class Manifests:
    """A render's objects, each document exactly one object with a kind and a name."""

    def __init__(self, text: str) -> None:
        self.objects: list[dict[str, Any]] = []
        for index, document in enumerate(strict_load_all(text)):
            if document is None:
                continue  # an empty document (a template that rendered nothing)
            if not (isinstance(document, dict) and document.get("kind")
                    and (document.get("metadata") or {}).get("name")):
                raise NotOneObject(f"document {index} is not one object with a kind and a "
                                   f"name: {str(document)[:200]}")
            self.objects.append(document)
        self.by_key = {(o["kind"], o["metadata"]["name"]): o for o in self.objects}

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.by_key.get((kind, name))

    def named(self, kind: str) -> list[str]:
        return sorted(name for k, name in self.by_key if k == kind)

    def pools(self) -> dict[str, Pool]:
        pools = {}
        for obj in self.objects:
            if obj["kind"] not in POOL_KINDS:
                continue
            spec = obj["spec"]["template"]["spec"]
            name = obj["metadata"]["name"].removeprefix(f"{RELEASE}-")
            boot, infra = spec["bootstrap"]["configRef"], spec["infrastructureRef"]
            pools[name] = Pool(name, obj["kind"], (boot["kind"], boot["name"]),
                               (infra["kind"], infra["name"]))
        return pools

    def bootstrap(self, pool: str) -> dict[str, Any]:
        """The pool's KubeadmConfigTemplate (MachineDeployment) or KubeadmConfig (MachinePool)
        spec, as CAPI's kubeadm bootstrap reads it."""
        obj = self.get(*self.pools()[pool].bootstrap)
        assert obj is not None, f"pool {pool}'s bootstrap config was not rendered"
        spec: dict[str, Any] = obj["spec"]
        return spec["template"]["spec"] if obj["kind"] == "KubeadmConfigTemplate" else spec

    def clc_text(self, pool: str) -> str:
        """The pool's ignition.containerLinuxConfig.additionalConfig, the text CAPBK transpiles."""
        text: str = self.bootstrap(pool)["ignition"]["containerLinuxConfig"]["additionalConfig"]
        return text

    def clc(self, pool: str) -> dict[str, Any]:
        document = strict_load(self.clc_text(pool))
        assert isinstance(document, dict), f"pool {pool}'s additionalConfig is not a mapping"
        return document

    def units(self, pool: str) -> dict[str, dict[str, Any]]:
        return {u["name"]: u for u in self.clc(pool)["systemd"]["units"]}


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
