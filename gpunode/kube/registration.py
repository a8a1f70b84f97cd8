"""Taints and labels a GPU node must carry from its registration on.

NodeRestriction forbids a kubelet to change its own taints once its Node exists, so the
`nvidia.com/gpu` taint has to be there at registration: in cluster-azure through the node
pool's `customNodeTaints`/`customNodeLabels`, on other kubeadm nodes through the
JoinConfiguration's `nodeRegistration` or the kubelet's `--register-with-taints` and
`--node-labels`. These functions render those forms from the agent config.
"""

from __future__ import annotations

from typing import Any

REGISTRATION_LABELS = {"nvidia.com/gpu.present": "true"}
FORMATS = ("cluster-azure", "kubeadm", "kubelet-flags")


def parse_taint(text: str) -> dict[str, str]:
    """"key=value:Effect" (value optional) → the Node API's taint object."""
    key_value, _, effect = text.rpartition(":")
    key, eq, value = key_value.partition("=")
    taint = {"key": key, "effect": effect}
    if eq:
        taint["value"] = value
    return taint


def cluster_azure(pool: str, instance_type: str, taints: tuple[str, ...],
                  labels: dict[str, str]) -> dict[str, Any]:
    """A cluster-azure node pool (`global.nodePools.<pool>`) that registers as a GPU node."""
    return {"global": {"nodePools": {pool: {
        "instanceType": instance_type,
        "customNodeLabels": [f"{k}={v}" for k, v in {**REGISTRATION_LABELS, **labels}.items()],
        "customNodeTaints": [parse_taint(t) for t in taints],
    }}}}


def kubeadm(taints: tuple[str, ...], labels: dict[str, str]) -> dict[str, Any]:
    """`joinConfiguration.nodeRegistration` for a KubeadmConfigTemplate (kubeadm v1beta3)."""
    node_labels = ",".join(f"{k}={v}" for k, v in {**REGISTRATION_LABELS, **labels}.items())
    return {"nodeRegistration": {"taints": [parse_taint(t) for t in taints],
                                 "kubeletExtraArgs": {"node-labels": node_labels}}}


def kubelet_flags(taints: tuple[str, ...], labels: dict[str, str]) -> list[str]:
    node_labels = ",".join(f"{k}={v}" for k, v in {**REGISTRATION_LABELS, **labels}.items())
    flags = [f"--node-labels={node_labels}"]
    if taints:
        flags.insert(0, f"--register-with-taints={','.join(taints)}")
    return flags
