"""`gpunode label`: compute the node's labels and GPUReady condition, then apply them with the
kubelet's credentials — one GET, and a PATCH only for what differs."""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from typing import Any

from gpunode import records, status
from gpunode.config import AgentConfig
from gpunode.detect import undecided_reason
from gpunode.errors import FileError, GpunodeError
from gpunode.host import Host
from gpunode.kube import labels
from gpunode.kube.client import ApiError, NodeApi, read_kubeconfig, with_retries

KUBELET_FLAG_FILES = ("/var/lib/kubelet/kubeadm-flags.env", "/etc/default/kubelet",
                      "/etc/sysconfig/kubelet")


@dataclass(frozen=True)
class Desired:
    node: str
    labels: dict[str, str]
    condition: labels.Condition
    # why nobody can tell whether this node has a GPU (detect.undecided_reason), or None
    undecided: str | None = None

    @property
    def gpu(self) -> bool | None:
        """Whether the node has NVIDIA GPUs to label: None when nobody can tell (undecided)."""
        if self.undecided is not None:
            return None
        return f"{labels.NVIDIA}gpu.present" in self.labels

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "gpu": self.gpu, "labels": self.labels,
                "condition": {"type": "GPUReady", "status": self.condition.status,
                              "reason": self.condition.reason,
                              "message": self.condition.message},
                "undecided": self.undecided}


@dataclass(frozen=True)
class Outcome:
    node: str
    labels_changed: bool
    condition_changed: bool
    calls: tuple[str, ...]


def node_name(host: Host, config: AgentConfig) -> tuple[str, str]:
    """The Node's name and where it came from, decided as the kubelet does: its
    --hostname-override if set (kubeadm writes it to kubeadm-flags.env), else the hostname."""
    if config.kubernetes.node_name:
        return config.kubernetes.node_name, "kubernetes.node_name"  # checked by config.py
    name, source = _kubelet_node_name(host)
    problem = node_name_problem(name)
    if problem is not None:
        raise NodeNameError(f"cannot use {name!r} (from {source}) as this node's name: {problem}")
    return name, source


_NODE_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def node_name_problem(name: str) -> str | None:
    """Why `name` cannot be a Node's name (a DNS-1123 subdomain, as the API server requires)."""
    if len(name) > 253 or not _NODE_NAME_RE.fullmatch(name):
        return ("a Node's name is lowercase letters, digits, '-' and '.', starting and ending "
                "with a letter or digit, at most 253 characters")
    return None


def _kubelet_node_name(host: Host) -> tuple[str, str]:
    for path in KUBELET_FLAG_FILES:
        for number, line in enumerate((host.read_optional(path) or "").splitlines(), 1):
            key, eq, value = line.partition("=")
            if not eq or key.lstrip().startswith("#"):
                continue
            try:
                words = shlex.split(value.strip().strip("\"'"))
            except ValueError as exc:  # "No closing quotation", "No escaped character"
                raise FileError(host.display(path), f"{key.strip()}: cannot split the "
                                f"kubelet's flags ({exc})", number,
                                "fix the quoting of that line (kubeadm writes KEY=\"--flag=value "
                                "...\"), or set kubernetes.node_name in the agent config") from exc
            for i, word in enumerate(words):
                # The kubelet ignores an empty override and takes the hostname.
                if word.startswith("--hostname-override=") and word.split("=", 1)[1]:
                    return word.split("=", 1)[1].lower(), f"--hostname-override in {path}"
                if word == "--hostname-override" and i + 1 < len(words) and words[i + 1]:
                    return words[i + 1].lower(), f"--hostname-override in {path}"
    hostname = (host.read_optional("/proc/sys/kernel/hostname") or "").strip().lower()
    if not hostname:
        raise NodeNameError()
    return hostname, "the hostname"


class NodeNameError(GpunodeError):
    hint = "set kubernetes.node_name in the agent config"

    def __init__(self, message: str = "cannot tell this node's name: no --hostname-override "
                 "for the kubelet and no hostname") -> None:
        super().__init__(message)


def desired(host: Host, config: AgentConfig) -> Desired:
    """Labels and condition from the host alone (what `label --dry-run` prints), computed from
    what `status.observe` read and nothing read again, so `label` and `status` see one host.

    When nobody can tell whether the node has a GPU (detect.undecided_reason), the labels are
    the user's and gpunode.io/ready=false, without any nvidia.com/gpu.* label, and GPUReady is
    False with status's failing checks as the reason; `undecided` says why (`label` then
    exits 1)."""
    facts = status.observe(host, config, contact_api=False)
    report = status.evaluate(facts)
    name = node_name(host, config)[0]
    condition = labels.condition_for([(c.name, c.state, c.detail) for c in report.checks])
    undecided = undecided_reason(facts.detection, facts.detection_error)
    if undecided is not None or facts.detection is None:
        wanted = {f"{labels.PREFIX}ready": "false", **config.kubernetes.labels}
        return Desired(name, wanted, condition, undecided)
    wanted = labels.compute(status.label_facts(facts, facts.detection,
                                               report.verdict == "ready"),
                            dict(config.kubernetes.labels))
    return Desired(name, wanted, condition)


def apply(host: Host, config: AgentConfig, want: Desired, api: NodeApi | None = None,
          now: str | None = None) -> Outcome:
    k = config.kubernetes
    api = api or NodeApi(read_kubeconfig(host, k.kubeconfig), k.request_timeout)
    deadline = time.monotonic() + k.wait_seconds
    node = with_retries(lambda: api.get_node(want.node), f"get node {want.node}", deadline)
    metadata = node.get("metadata", {})
    patch = labels.label_patch(metadata.get("labels") or {}, metadata.get("annotations") or {},
                               want.labels)
    if patch is not None:
        api.patch_node(want.node, patch)
    conditions = (node.get("status") or {}).get("conditions") or []
    stamp = now or records.utc_timestamp()
    status_patch = labels.condition_patch(conditions, want.condition, stamp)
    if status_patch is not None:
        api.patch_status(want.node, status_patch)
    return Outcome(want.node, patch is not None, status_patch is not None, tuple(api.calls))


__all__ = ["ApiError", "Desired", "Outcome", "apply", "desired", "node_name"]
