"""The watch's changes sent with the kubelet's credentials: the GPUReady condition (one GET,
then a status PATCH only when the Node's condition differs) and Warning Events on the Node.

A kubelet may patch its own Node's status and create Events (the system:node role);
NodeRestriction's refusal comes back as one ApiError with client.py's hint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpunode import log
from gpunode.config import AgentConfig
from gpunode.kube import labels, nodename
from gpunode.kube.client import NodeApi, read_kubeconfig, with_retries
from gpunode.platform import timestamps
from gpunode.platform.host import Host

EVENT_NAMESPACE = "default"  # where the kubelet records its own Node's Events
COMPONENT = "gpunode-watch"


def apply(host: Host, config: AgentConfig, changes: list[dict[str, Any]],
          api_factory: Callable[[], Any] | None = None,
          retry_seconds: float | None = None) -> list[str]:
    """Send `changes`; the calls made ("GET path", "PATCH path", "POST path"). The GET is
    tried again for `retry_seconds` (default kubernetes.request_timeout); the daemon, which
    has its own backoff, says 0."""
    k = config.kubernetes
    api = api_factory() if api_factory else NodeApi(read_kubeconfig(host, k.kubeconfig),
                                                    k.request_timeout)
    name, _ = nodename.node_name(host, k.node_name)
    deadline = time.monotonic() + (k.request_timeout if retry_seconds is None else retry_seconds)
    now = timestamps.utc_timestamp()
    for change in changes:
        if change["kind"] == "condition":
            node = with_retries(lambda: api.get_node(name), f"get node {name}", deadline)
            existing = (node.get("status") or {}).get("conditions") or []
            wanted = labels.Condition(change["status"], change["reason"], change["message"])
            patch = labels.condition_patch(existing, wanted, now)
            if patch is not None:
                api.patch_status(name, patch)
        else:
            api.create_event(EVENT_NAMESPACE, event_object(name, change, now))
    log.get().info("watch.reported", node=name, changes=len(changes), calls=list(api.calls))
    return list(api.calls)


def event_object(node: str, change: dict[str, Any], now: str) -> dict[str, Any]:
    """A core/v1 Event about the Node, as the kubelet records its own (involvedObject's uid is
    the Node's name, namespace default)."""
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{node}.", "namespace": EVENT_NAMESPACE},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
            "type": change["type"], "reason": change["reason"], "message": change["message"],
            "source": {"component": COMPONENT, "host": node}, "reportingComponent": COMPONENT,
            "reportingInstance": node, "firstTimestamp": now, "lastTimestamp": now, "count": 1}
