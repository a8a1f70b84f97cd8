"""The own Node's name, decided as the kubelet decides it: its --hostname-override if set
(kubeadm writes it to kubeadm-flags.env; distributions to /etc/default or /etc/sysconfig), else
the hostname, trimmed and lowercased (the kubelet's GetHostname). Status, label and config's
check of kubernetes.node_name all ask here, so they cannot name different Nodes.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from gpunode.errors import FileError, GpunodeError, NodeNameError
from gpunode.platform import envfile
from gpunode.platform.host import Host

KUBELET_FLAG_FILES = ("/var/lib/kubelet/kubeadm-flags.env", "/etc/default/kubelet",
                      "/etc/sysconfig/kubelet")


def node_name(host: Host, configured: str | None) -> tuple[str, str]:
    """The Node's name and where it came from: `configured` (kubernetes.node_name, checked by
    config.py) when set, else the kubelet's choice."""
    if configured:
        return configured, "kubernetes.node_name"
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
        for number, key, value in envfile.assignments(host.read_optional(path) or ""):
            try:
                words = shlex.split(value)
            except ValueError as exc:  # "No closing quotation", "No escaped character"
                raise FileError(host.display(path), f"{key}: cannot split the "
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


@dataclass(frozen=True)
class NodeName:
    """The name and where it came from, or the error that says why it cannot be told (status
    shows it on its node check; `label` raises it)."""

    name: str | None
    source: str = ""
    error: GpunodeError | None = None

    def require(self) -> str:
        if self.error is not None:
            raise self.error
        if self.name is None:
            raise NodeNameError(f"cannot tell this node's name: {self.source}")
        return self.name


def observe(host: Host, configured: str | None) -> NodeName:
    try:
        return NodeName(*node_name(host, configured))
    except GpunodeError as exc:
        return NodeName(None, error=exc)
