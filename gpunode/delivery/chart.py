"""`gpunode ignition --format cluster-azure|cluster-aws|cluster-secret`: the node snippet as
values of Giant Swarm's cluster charts, and the Secret those values name.

cluster-azure (8.0.0) and cluster-aws (9.0.0) both take the provider-independent `cluster`
chart (7.0.0) as a subchart, so its values live under `cluster:`, and neither takes raw
Container Linux Config: the chart assembles each worker's Ignition from structured
`systemd.units` and `storage.directories`/`storage.filesystems` (it drops `storage.files` and
`storage.links`), writes files only from Secrets (CAPI `files` with `contentFrom.secret`), and
applies both to every worker pool; per pool there are only `customNodeLabels` ("k=v") and
`customNodeTaints` ({key, value, effect}). Sources, by file and commit:

- giantswarm/cluster@ad135475ddd1ab0f2eb2bca6e63bbd72d879b6e3 (v7.0.0):
  helm/cluster/templates/clusterapi/workers/_helpers_flatcar.tpl (what goes into a worker's
  additionalConfig), .../workers/_helpers_files.tpl (`internal.advancedConfiguration.workers.
  files`), values.schema.json;
- giantswarm/cluster-azure@d5bdf6ae61ca69df9b8b28235e84f7392ad7d2c2 (v8.0.0) and
  giantswarm/cluster-aws@371a1cac60e76c45f84d08c1bacd1d6aa3b6afa7 (v9.0.0): values.yaml (the
  default pool `def00`, the chart's own worker units) and values.schema.json (`global.nodePools`).

So the snippet's parts go: the sysext download and link into the bootstrap unit
(chartunit.sysext_unit), the inline files into the Secret and `files` entries, the units into
`cluster.providerIntegration.workers.kubeadmConfig.ignition.containerLinuxConfig.
additionalConfig.systemd.units` in the structured form, and the node pools into
`global.nodePools`: the GPU pool with its registration taint and label, and the chart's
default pool kept beside it (a `global.nodePools` map replaces the chart's defaults).

Where the two providers differ: an AWS pool is an auto-scaling group sized by `minSize` and
`maxSize` (its schema has no `replicas`), an Azure pool has `replicas`; instance types look
different (`g4dn.xlarge`, `Standard_NC4as_T4_v3`); and cluster-aws sets worker units of its
own (the /var/lib and /var/log mounts) at the very path gpunode's go, a list Helm replaces
rather than merges, so they are carried in gpunode's list unchanged.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from gpunode import __version__, delivery
from gpunode.config import DEFAULT_CONFIG_PATH, AgentConfig, parse_text
from gpunode.delivery import chartunit, ignition
from gpunode.errors import UsageError
from gpunode.kube import registration

FORMATS = delivery.CHART_FORMATS
SECRET_NAME = "gpunode-files"
CLUSTER_CHART = "giantswarm/cluster 7.0.0 (ad135475ddd1ab0f2eb2bca6e63bbd72d879b6e3)"
UNITS_PATH = ("cluster", "providerIntegration", "workers", "kubeadmConfig", "ignition",
              "containerLinuxConfig", "additionalConfig")
FILES_PATH = ("cluster", "internal", "advancedConfiguration", "workers", "files")
# A node pool's name, as both charts' schemas have it (global.nodePools patternProperties).
POOL_RE = re.compile(r"[a-z0-9][-a-z0-9]{3,18}[a-z0-9]")
DEFAULT_POOL = "gpu00"
MAX_NODES = 1000  # the cluster chart's $defs.nodePool replicas/maxSize maximum


def _mount(name: str, what: str, where: str, description: str) -> dict[str, Any]:
    return {"contents": {"install": {"wantedBy": ["local-fs-pre.target"]},
                         "mount": {"type": "xfs", "what": what, "where": where},
                         "unit": {"defaultDependencies": False, "description": description}},
            "enabled": True, "name": name}


@dataclass(frozen=True)
class Chart:
    """One Giant Swarm cluster chart's facts as gpunode uses them, read at one commit."""

    name: str
    version: str
    source: str  # repository@commit of the values.yaml and schema these facts come from
    instance_type: str  # the GPU pool's default
    instance_type_re: re.Pattern[str]
    instance_type_example: str
    sized_by: tuple[str, ...]  # the pool keys that take the node count
    default_pool: tuple[str, dict[str, Any]]  # workers.defaultNodePools of the chart
    kept_units: tuple[dict[str, Any], ...]  # the chart's own units at UNITS_PATH


CHARTS = {
    "cluster-azure": Chart(
        "cluster-azure", "8.0.0",
        "giantswarm/cluster-azure@d5bdf6ae61ca69df9b8b28235e84f7392ad7d2c2",
        "Standard_NC4as_T4_v3", re.compile(r"[A-Za-z][A-Za-z0-9_]{0,127}"),
        "Standard_NC4as_T4_v3", ("replicas",),
        ("def00", {"customNodeLabels": ["label=default"], "instanceType": "Standard_D4as_v5",
                   "machineHealthCheck": {"enabled": True, "maxUnhealthy": "40%",
                                          "nodeStartupTimeout": "10m",
                                          "unhealthyNotReadyTimeout": "300s",
                                          "unhealthyUnknownTimeout": "300s"},
                   "replicas": 2, "rootVolumeSizeGB": 50}),
        ()),
    "cluster-aws": Chart(
        "cluster-aws", "9.0.0",
        "giantswarm/cluster-aws@371a1cac60e76c45f84d08c1bacd1d6aa3b6afa7",
        "g4dn.xlarge", re.compile(r"[a-z][a-z0-9]*\.[a-z0-9]+"), "g4dn.xlarge",
        ("minSize", "maxSize"),
        ("def00", {"customNodeLabels": ["label=default"], "instanceType": "r6i.xlarge",
                   "instanceWarmup": 600, "maxSize": 3, "minHealthyPercentage": 90,
                   "minSize": 3}),
        (_mount("var-lib.mount", "/dev/disk/by-label/lib", "/var/lib", "lib volume"),
         _mount("var-log.mount", "/dev/disk/by-label/log", "/var/log", "log volume"))),
}


@dataclass(frozen=True)
class Pool:
    """The GPU node pool the chart values add, as the command line sets it."""

    name: str = DEFAULT_POOL
    instance_type: str | None = None  # None: the chart's default
    nodes: int = 1
    # The chart's default pool beside the GPU pool: a `global.nodePools` map replaces the
    # chart's defaults, so a cluster that has no pools of its own would lose its CPU nodes.
    # False for a cluster whose values list pools already (Helm merges the pool maps).
    default_pool: bool = True


def pool_settings(fmt: str, pool: str | None, instance_type: str | None,
                  nodes: int | None, no_default_pool: bool = False) -> Pool:
    """--pool, --instance-type, --nodes and --no-default-pool for `fmt`, checked against the
    chart's schema (a UsageError, exit 2); refused for a format without node pools rather
    than ignored."""
    given = [flag for flag, value in (("--pool", pool), ("--instance-type", instance_type),
                                      ("--nodes", nodes),
                                      ("--no-default-pool", no_default_pool or None))
             if value is not None]
    if fmt not in CHARTS:
        if given:
            raise UsageError(f"{' and '.join(given)}: only --format cluster-azure and "
                             f"cluster-aws have node pools, not --format {fmt}")
        return Pool()
    chart = CHARTS[fmt]
    settings = Pool(DEFAULT_POOL if pool is None else pool, instance_type,
                    1 if nodes is None else nodes, not no_default_pool)
    if not POOL_RE.fullmatch(settings.name):
        raise UsageError(f"--pool {registration.shown(settings.name)}: {fmt}'s node pool names "
                         "are 5-20 lowercase letters, digits and '-', starting and ending "
                         "with a letter or digit (its schema's global.nodePools)")
    if instance_type is not None and not chart.instance_type_re.fullmatch(instance_type):
        raise UsageError(f"--instance-type {registration.shown(instance_type)}: not a {fmt} "
                         f"instance type, e.g. {chart.instance_type_example}")
    if not 0 <= settings.nodes <= MAX_NODES:
        raise UsageError(f"--nodes {settings.nodes}: a node pool has 0 to {MAX_NODES} nodes")
    if settings.default_pool and settings.name == chart.default_pool[0]:
        raise UsageError(f"--pool {settings.name}: that is the name of {fmt}'s default pool, "
                         "which the values keep beside the GPU pool; name the GPU pool "
                         "otherwise (or give --no-default-pool)")
    return settings


# -- the snippet's parts, in the chart's terms ---------------------------------------------------


def _remote(s: ignition.Snippet) -> ignition.File:
    return next(f for f in s.files if f.url is not None)


def _inline(s: ignition.Snippet) -> list[ignition.File]:
    return [f for f in s.files if f.inline is not None]


def secret_key(f: ignition.File) -> str:
    return f.path.rsplit("/", 1)[1]


def _check_url(url: str) -> None:
    """The URL goes into a unit's Environment= and a shell word: quotes, backslashes, `$` and
    backquotes would change what both read (ignition.check_url checked the rest)."""
    bad = sorted({c for c in url if c in "\"'\\$`"})
    if bad:
        raise UsageError(f"--sysext-url {url!r}: {' '.join(bad)} cannot go into the chart's "
                         "unit as written", "percent-encode them (\" %22, ' %27, \\ %5C, "
                         "$ %24, ` %60)")


def units(s: ignition.Snippet) -> list[dict[str, Any]]:
    """The snippet's units in the chart's form: masks as masks, the bootstrap unit, then
    gpunode's units from units/ with the GPU condition (gpunode.service after the bootstrap)."""
    image = _remote(s)
    _check_url(image.url or "")
    link = next(ln for ln in s.links if ln.target == image.path)
    out: list[dict[str, Any]] = [{"name": u.name, "mask": True, "enabled": False}
                                 for u in s.units if u.mask]
    out.append({"name": chartunit.SYSEXT_UNIT, "enabled": True,
                "contents": chartunit.sysext_unit(image.url or "", image.sha512 or "",
                                                  image.path, link.path)})
    for u in s.units:
        if u.contents is not None:
            contents = chartunit.structured(u.contents, u.name)
            after = (chartunit.SYSEXT_UNIT,) if u.name == "gpunode.service" else ()
            out.append({"name": u.name, "enabled": bool(u.enabled),
                        "contents": chartunit.gpu_only(contents, after)})
    return out


def directories(s: ignition.Snippet) -> list[dict[str, Any]]:
    """The directories the bootstrap unit writes into (the image's, the link's); 0o755 as the
    integer the schema wants (the template writes it as given, CLC reads it as decimal)."""
    wanted = [_remote(s).path.rsplit("/", 1)[0], *(ln.path.rsplit("/", 1)[0] for ln in s.links)]
    return [{"path": p, "mode": 0o755} for p in dict.fromkeys(wanted)]


def files(s: ignition.Snippet) -> list[dict[str, Any]]:
    return [{"path": f.path, "permissions": f"{f.mode:04o}",
             "contentFrom": {"secret": {"name": SECRET_NAME, "key": secret_key(f)}}}
            for f in _inline(s)]


def secret(s: ignition.Snippet) -> dict[str, Any]:
    """The Secret the `files` entries read, to create in the cluster's namespace."""
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": SECRET_NAME, "labels": {"app.kubernetes.io/name": "gpunode"}},
            "type": "Opaque",
            "stringData": {secret_key(f): f.inline for f in _inline(s)}}


def _agent(s: ignition.Snippet) -> AgentConfig:
    text = next((f.inline for f in s.files if f.path == DEFAULT_CONFIG_PATH), None)
    return AgentConfig() if text is None else parse_text(text, DEFAULT_CONFIG_PATH)


def gpu_pool(chart: Chart, pool: Pool, agent: AgentConfig) -> dict[str, Any]:
    instance_type = pool.instance_type or chart.instance_type
    # The same pool entry as `gpunode label --registration cluster-azure` (taints always with
    # the `value` both schemas require; a valueless one refused naming the agent config).
    registered = registration.cluster_azure(pool.name, instance_type, agent.kubernetes.taints,
                                            dict(agent.kubernetes.labels), agent.source,
                                            agent.kubernetes.stack)
    spec = registered["global"]["nodePools"][pool.name]
    return {"instanceType": instance_type, **dict.fromkeys(chart.sized_by, pool.nodes),
            "customNodeLabels": list(spec["customNodeLabels"]),
            "customNodeTaints": list(spec["customNodeTaints"])}


def values(s: ignition.Snippet, fmt: str, pool: Pool | None = None) -> dict[str, Any]:
    chart = CHARTS[fmt]
    pool = pool or Pool()
    pools = dict([copy.deepcopy(chart.default_pool)] if pool.default_pool else [])
    pools[pool.name] = gpu_pool(chart, pool, _agent(s))
    additional = {"systemd": {"units": [*copy.deepcopy(chart.kept_units), *units(s)]},
                  "storage": {"directories": directories(s)}}
    document: dict[str, Any] = {"global": {"nodePools": pools}}
    _put(document, UNITS_PATH, additional)
    _put(document, FILES_PATH, files(s))
    return document


def _put(document: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        document = document.setdefault(key, {})
    document[path[-1]] = value


def header(fmt: str) -> str:
    if fmt == "cluster-secret":
        return ("# The Secret gpunode's cluster-azure / cluster-aws values read their files from\n"
                f"# (rendered by gpunode {__version__}): create it in the namespace of the\n"
                "# Cluster before the cluster's workers are created, e.g.\n"
                "#   kubectl apply -n <org-namespace> -f gpunode-secret.yaml\n")
    chart = CHARTS[fmt]
    return (f"# {chart.name} {chart.version} values that deliver gpunode {__version__} to the "
            f"workers\n# (checked against {chart.source} and {CLUSTER_CHART}).\n"
            f"# Create the Secret {SECRET_NAME!r} first: gpunode ignition --format "
            "cluster-secret ...\n# Every worker pool gets the units; on a node without an "
            "NVIDIA GPU they are skipped\n# (ExecCondition=) and download nothing. The chart's "
            "default pool is kept as it is\n# (render with --no-default-pool when your cluster's "
            "values list pools of their own).\n")


def render(s: ignition.Snippet, fmt: str, pool: Pool | None = None) -> str:
    import yaml

    document = secret(s) if fmt == "cluster-secret" else values(s, fmt, pool)
    return header(fmt) + yaml.dump(document, Dumper=ignition.literal_dumper(), sort_keys=False,
                                   width=1000)
