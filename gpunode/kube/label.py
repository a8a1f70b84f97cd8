"""`gpunode label`: the node's labels and GPUReady condition, from what `status.observe` read
(the one reading of the host status and label share), then applied with the kubelet's
credentials — one GET, and a PATCH only for what differs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gpunode import status
from gpunode.config import AgentConfig
from gpunode.errors import ApiError, UndecidedError
from gpunode.kube import labels
from gpunode.kube.client import NodeApi, read_kubeconfig, with_retries
from gpunode.platform import timestamps
from gpunode.platform.host import Host

NOTHING_TO_LABEL = "no NVIDIA GPU: nothing to label"


@dataclass(frozen=True)
class Desired:
    """The labels and GPUReady condition the Node should have, from one reading of the host."""

    node: str
    labels: dict[str, str]
    condition: labels.Condition
    # why nobody can tell whether this node has a GPU (detect.undecided_reason), or None
    undecided: str | None = None
    usable_gpus: int = 0  # detected GPUs containers can use (not passed through to VMs)

    @property
    def gpu(self) -> bool | None:
        """Whether the node has NVIDIA GPUs to label: None when nobody can tell (undecided)."""
        if self.undecided is not None:
            return None
        return self.usable_gpus > 0

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "gpu": self.gpu, "labels": self.labels,
                "condition": {"type": "GPUReady", "status": self.condition.status,
                              "reason": self.condition.reason,
                              "message": self.condition.message},
                "undecided": self.undecided}


@dataclass(frozen=True)
class Outcome:
    """What `gpunode label` changed on the Node, and the API calls it made."""

    node: str
    labels_changed: bool
    condition_changed: bool
    calls: tuple[str, ...]


def desired(facts: status.StatusFacts, report: status.Report) -> Desired:
    """Labels and condition from what status observed and evaluated, nothing read again, so
    `label` and `status` see one host (the labels: status.wanted_labels).

    When nobody can tell whether the node has a GPU (detect.undecided_reason), the labels are
    the user's and gpunode.io/ready=false, without any nvidia.com/gpu.* label, and GPUReady is
    False with status's failing checks as the reason; `undecided` says why (`label` then
    exits 1)."""
    name = facts.node_name.require()
    from gpunode.watch.state import headline

    condition = labels.condition_for([(c.name, c.state, c.detail) for c in report.checks],
                                     headline(facts.watch))
    undecided = facts.undecided
    usable = len(facts.detection.usable_gpus) if facts.detection is not None else 0
    return Desired(name, status.wanted_labels(facts, report.verdict == "ready"), condition,
                   undecided, usable)


def for_host(host: Host, config: AgentConfig) -> Desired:
    """What `label --dry-run` prints: the host observed once (without asking the API server)."""
    facts = status.observe(host, config, contact_api=False)
    return desired(facts, status.evaluate(facts))


def apply(host: Host, config: AgentConfig, want: Desired, api: NodeApi | None = None,
          now: str | None = None) -> Outcome:
    k = config.kubernetes
    api = api or NodeApi(read_kubeconfig(host, k.kubeconfig), k.request_timeout)
    deadline = time.monotonic() + k.wait_seconds
    node = with_retries(lambda: api.get_node(want.node), f"get node {want.node}", deadline)
    metadata = node.get("metadata", {})
    patch = labels.label_patch(metadata.get("labels") or {}, metadata.get("annotations") or {},
                               want.labels, labels.handed_over(k.stack))
    if patch is not None:
        api.patch_node(want.node, patch)
    conditions = (node.get("status") or {}).get("conditions") or []
    stamp = now or timestamps.utc_timestamp()
    status_patch = labels.condition_patch(conditions, want.condition, stamp)
    if status_patch is not None:
        api.patch_status(want.node, status_patch)
    return Outcome(want.node, patch is not None, status_patch is not None, tuple(api.calls))


def require_decided(want: Desired, labelled: bool) -> None:
    """`label`'s refusal when the node's GPUs cannot be identified (exit 1, as boot and `driver
    load` refuse them), raised after the honest labels were set (or, with --dry-run, printed)."""
    if want.undecided is not None:
        done = "labelled" if labelled else "would label"
        raise UndecidedError(f"{done} GPUReady=False: {want.undecided}")


def document(want: Desired, outcome: Outcome | None, dry_run: bool) -> dict[str, Any]:
    """`label --json`: what is wanted and (unless --dry-run) what changed. A node without a GPU
    gets the same document, saying there is nothing to do."""
    if want.gpu is False:
        done = {} if dry_run else {"labels_changed": False, "condition_changed": False,
                                   "calls": []}
        return {"schema_version": 1, "node": want.node, "gpu": False, "labels": {},
                "condition": None, "undecided": None, "message": NOTHING_TO_LABEL, **done}
    changed = {} if outcome is None else {"labels_changed": outcome.labels_changed,
                                          "condition_changed": outcome.condition_changed,
                                          "calls": list(outcome.calls)}
    return {"schema_version": 1, **want.to_json(), **changed}


__all__ = ["ApiError", "Desired", "Outcome", "apply", "desired", "document", "for_host",
           "require_decided"]
