"""`gpunode nodes`: the cluster's GPU nodes as the API server knows them, from an operator's
workstation — which are broken, and why.

One chunked LIST (`GET /api/v1/nodes?labelSelector=gpunode.io/ready&limit=500`, following
metadata.continue as kubectl does with its default --chunk-size of 500; kubernetes.io/docs/
reference/using-api/api-concepts/#retrieving-large-results-sets-in-chunks). The selector is
the label `gpunode label` gives every GPU node in either stack (kube/labels.py): in the
gpu-operator stack there is no nvidia.com/gpu.present of gpunode's, and a node gpunode never
labelled is not listed. Each node is read down to one summary row as its page arrives.

A node is ready when its GPUReady condition and the kubelet's Ready are both True: a GPUReady
of a node whose kubelet stopped reporting is stale.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.config import AgentConfig
from gpunode.errors import KubeconfigError, NodesKubeconfigError, ReplyError
from gpunode.kube import labels
from gpunode.kube.client import NodeApi
from gpunode.kube.kubeconfig import read_kubeconfig
from gpunode.platform.host import Host

SELECTOR = f"{labels.PREFIX}ready"
PAGE = 500
MAX_NODES = 50_000  # ten times Kubernetes' documented limit of 5,000 nodes a cluster
DEFAULT_KUBECONFIG = "~/.kube/config"


@dataclass(frozen=True)
class Row:
    """One GPU node of `gpunode nodes`, read down from the Node object the API server lists."""

    name: str
    gpu_ready: dict[str, str | None] | None  # status, reason, message, last_transition_time
    kubelet_ready: str | None  # the Ready condition's status
    count: int | None
    allocatable: int | None
    product: str | None
    driver: str | None
    flavour: str | None
    gpunode: str | None

    @property
    def ready(self) -> bool:
        return (self.gpu_ready or {}).get("status") == "True" and self.kubelet_ready == "True"

    @property
    def problem(self) -> str | None:
        """Why the node is not ready, in one sentence; None when it is."""
        if self.gpu_ready is None:
            return ("no GPUReady condition: gpunode label has not set it (is "
                    "gpunode-label.service failing on the node?)")
        status = self.gpu_ready.get("status")
        if status != "True":
            why = self.gpu_ready.get("message") or "no message"
            return f"GPUReady={status} ({self.gpu_ready.get('reason') or 'no reason'}): {why}"
        if self.kubelet_ready != "True":
            return (f"the kubelet's Ready is {self.kubelet_ready or 'missing'}: GPUReady=True "
                    "may be stale")
        return None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ready": self.ready, "problem": self.problem,
                "gpu_ready": self.gpu_ready, "kubelet_ready": self.kubelet_ready,
                "gpus": {"count": self.count, "allocatable": self.allocatable,
                         "product": self.product},
                "driver": {"version": self.driver, "flavour": self.flavour},
                "gpunode_version": self.gpunode}


def kubeconfig_path(given: str | None, environ: Mapping[str, str]) -> str:
    """--kubeconfig, else KUBECONFIG (one file: gpunode merges none), else ~/.kube/config;
    made absolute against the working directory."""
    if given is None:
        listed = [p for p in environ.get("KUBECONFIG", "").split(":") if p]
        if len(listed) > 1:
            raise NodesKubeconfigError("KUBECONFIG", f"lists {len(listed)} files, and gpunode "
                                       "reads one", "name it with --kubeconfig FILE")
        given = listed[0] if listed else os.path.expanduser(DEFAULT_KUBECONFIG)
        if given.startswith("~"):
            raise NodesKubeconfigError(given, "cannot be found: no home directory",
                                       "name the kubeconfig with --kubeconfig FILE")
    if not given:
        raise NodesKubeconfigError("--kubeconfig", "is empty", "name a kubeconfig file")
    return os.path.abspath(given)


def connect(path: str, context: str | None, timeout: float) -> NodeApi:
    """The API client for the operator's kubeconfig; a kubeconfig that cannot be used is a
    NodesKubeconfigError (exit 2: the operator's input, as a bad agent config is)."""
    try:
        return NodeApi(read_kubeconfig(Host(), path, context, operator=True), timeout)
    except NodesKubeconfigError:
        raise
    except KubeconfigError as exc:
        raise NodesKubeconfigError(exc.path, exc.reason, exc.given_hint) from exc


def gpu_nodes(api: NodeApi, page: int = PAGE) -> list[Row]:
    """Every node SELECTOR matches, page by page, each read down to its Row. Bounded: at most
    max_pages(page) pages (an API server may answer a page short, even empty, and a next one;
    one that hands out fresh tokens for empty pages for ever is cut off there), each call
    within kubernetes.request_timeout."""
    rows: list[Row] = []
    token: str | None = None
    seen: set[str] = set()
    for _ in range(max_pages(page)):
        reply = api.list_nodes(SELECTOR, page, token)
        rows.extend(row(item) for item in reply["items"])
        token = (reply.get("metadata") or {}).get("continue") or None
        if token is None:
            return rows
        url = f"{api.config.server.rstrip('/')}/api/v1/nodes"
        if token in seen:
            raise ReplyError("list nodes", url, "repeats a continue token: the listing would "
                             "never end")
        if len(rows) > MAX_NODES:
            raise ReplyError("list nodes", url, f"has more than {MAX_NODES} nodes and still "
                             "a next page")
        seen.add(token)
    raise ReplyError("list nodes", f"{api.config.server.rstrip('/')}/api/v1/nodes",
                     f"still has a next page after {max_pages(page)} pages ({len(rows)} nodes): "
                     "the listing would never end")


def max_pages(page: int) -> int:
    """The most pages a listing may take: every node's page full, twice over, and some."""
    return 2 * (MAX_NODES // page) + 10


def row(node: dict[str, Any]) -> Row:
    """A Node (as client.check_node checked it) → its summary."""
    metadata = node["metadata"]
    found = metadata.get("labels") or {}
    status = node.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    gpu = conditions.get("GPUReady")
    gpu_ready = None if gpu is None else {
        "status": _text(gpu.get("status")), "reason": _text(gpu.get("reason")),
        "message": _text(gpu.get("message")),
        "last_transition_time": _text(gpu.get("lastTransitionTime"))}
    kubelet = conditions.get("Ready")
    return Row(name=_text(metadata.get("name")) or "?", gpu_ready=gpu_ready,
               kubelet_ready=None if kubelet is None else _text(kubelet.get("status")),
               count=_count(found.get(f"{labels.NVIDIA}gpu.count")),
               allocatable=_count((status.get("allocatable") or {}).get("nvidia.com/gpu")),
               product=found.get(f"{labels.NVIDIA}gpu.product"),
               driver=found.get(f"{labels.NVIDIA}cuda.driver-version.full"),
               flavour=found.get(f"{labels.PREFIX}driver-flavour"),
               gpunode=found.get(labels.VERSION_LABEL))


def _text(value: object) -> str | None:
    """A string field as sent; anything else (a server's garbage) as its JSON-ish text."""
    return value if isinstance(value, str) or value is None else repr(value)[:200]


def _count(value: object) -> int | None:
    return int(value) if isinstance(value, str) and value.isdigit() and len(value) < 7 \
        else None


def document(rows: list[Row], server: str) -> dict[str, Any]:
    broken = sum(not r.ready for r in rows)
    return {"schema_version": 1, "server": server, "selector": SELECTOR,
            "ready": broken == 0, "count": len(rows), "not_ready": broken,
            "nodes": [r.to_json() for r in rows]}


def render(rows: list[Row]) -> str:
    """The aligned table, then one line per node that is not ready saying why."""
    from gpunode.cli import render as tables

    if not rows:
        return f"no GPU nodes: no node has the label {SELECTOR} (gpunode label sets it)"
    table = [("NODE", "READY", "GPUREADY", "REASON", "KUBELET", "GPUS", "ALLOC", "PRODUCT",
              "DRIVER", "GPUNODE", "SINCE")]
    for r in rows:
        gpu = r.gpu_ready or {}
        driver = " ".join(x for x in (r.driver, f"({r.flavour})" if r.flavour else None) if x)
        table.append(tuple(_cell(x) for x in (
            r.name, "yes" if r.ready else "NO", gpu.get("status") or "missing",
            gpu.get("reason"), r.kubelet_ready, r.count, r.allocatable, r.product, driver,
            r.gpunode, gpu.get("last_transition_time"))))
    lines = tables.table(table)
    broken = [r for r in rows if not r.ready]
    lines.append(f"{len(rows)} GPU node(s): {len(rows) - len(broken)} ready, "
                 f"{len(broken)} not ready")
    lines.extend(f"{_cell(r.name)}: {_cell(r.problem, 400)}" for r in broken)
    return "\n".join(lines)


def _cell(value: object, limit: int = 60) -> str:
    """A value as a terminal may show it: control characters escaped, long text cut."""
    if value is None or value == "":
        return "-"
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def command(config: AgentConfig, kubeconfig: str | None, context: str | None,
            as_json: bool) -> int:
    """Exit 0 when every GPU node is ready (or there is none), 1 when one is not; the
    kubeconfig refused is exit 2 (NodesKubeconfigError), the API server failing exit 1 with
    nothing on stdout."""
    import json
    import sys

    from gpunode import log

    api = connect(kubeconfig_path(kubeconfig, os.environ), context,
                  config.kubernetes.request_timeout)
    with log.step("nodes", server=api.config.server, selector=SELECTOR) as fields:
        rows = gpu_nodes(api)
        broken = [r.name for r in rows if not r.ready]
        fields.update(count=len(rows), not_ready=len(broken), pages=len(api.calls))
    if as_json:
        print(json.dumps(document(rows, api.config.server), indent=2))
    else:
        print(render(rows))
    sys.stdout.flush()
    return 1 if broken else 0
