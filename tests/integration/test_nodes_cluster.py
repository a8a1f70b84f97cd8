"""`gpunode nodes` against the local TLS API server (gpunode_testing.kube_api): a cluster of
1200 GPU nodes listed in pages, mixed ready, not ready and never labelled, as an operator's
workstation sees it (a client certificate or a bearer token, RBAC)."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode import __version__
from gpunode.kube import client
from gpunode_testing.kube_api import FakeApiServer
from gpunode_testing.kube_objects import make_node
from gpunode_testing.pki import Pki, issue_client_cert
from hostile.support import Cli

T = "2026-11-29T08:00:00Z"
GPU_LABELS = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8",
              "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
              "nvidia.com/cuda.driver-version.full": "550.127.05",
              "gpunode.io/driver-flavour": "open", "gpunode.io/ready": "true",
              "gpunode.io/version": __version__}


def gpu_node(name: str, status: str | None = "True", reason: str = "GPUReady",
             message: str = "gpunode: ready", kubelet: bool = True,
             **labels: str) -> dict[str, Any]:
    node = make_node(name, gpus=8, labels={**GPU_LABELS, **labels}, ready=kubelet)
    if status is not None:
        node["status"]["conditions"].append({
            "type": "GPUReady", "status": status, "reason": reason, "message": message,
            "lastTransitionTime": T, "lastHeartbeatTime": T})
    return node


def cluster(count: int = 1200) -> list[dict[str, Any]]:
    """`count` ready GPU nodes, three broken ones, a CPU node and an unlabelled GPU node."""
    nodes = [gpu_node(f"gpu-{i:04d}") for i in range(count)]
    nodes[7] = gpu_node("gpu-0007", "False", "DeviceNodesNotReady",
                        "gpunode: device_nodes: /dev/nvidia-uvm is missing",
                        **{"gpunode.io/ready": "false"})
    nodes[600] = gpu_node("gpu-0600", None)
    nodes[1100] = gpu_node("gpu-1100", kubelet=False)
    nodes.append(make_node("cpu-0000"))
    nodes.append(make_node("gpu-unlabelled", gpus=1, labels={"nvidia.com/gpu.present": "true"}))
    return nodes


@pytest.fixture(scope="module")
def admin(pki: Pki) -> tuple[Path, Path]:
    return issue_client_cert(pki, "admin", "/O=system:masters/CN=kubernetes-admin")


@pytest.fixture(scope="module")
def big(pki: Pki) -> Iterator[FakeApiServer]:
    with FakeApiServer(pki, nodes=cluster(), tokens={"t0ken": ("alice", ("devs",)),
                                                     "n0body": ("bob", ())},
                       node_readers=("devs",)) as server:
        yield server


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(tmp_path: Path, api: FakeApiServer, user: dict[str, Any],
               context: str = "admin@gpus") -> Path:
    """A workstation kubeconfig: two contexts, data embedded, as `kubectl config view
    --flatten` writes it."""
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": context,
           "clusters": [{"name": "gpus", "cluster": {
               "server": api.url, "certificate-authority-data": b64(api.pki.ca_cert)}},
               {"name": "other", "cluster": {"server": "https://127.0.0.1:1"}}],
           "contexts": [{"name": "admin@gpus", "context": {"cluster": "gpus", "user": "me"}},
                        {"name": "other", "context": {"cluster": "other", "user": "me"}}],
           "users": [{"name": "me", "user": user}]}
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))
    return path


def cert_user(admin: tuple[Path, Path]) -> dict[str, str]:
    return {"client-certificate-data": b64(admin[0]), "client-key-data": b64(admin[1])}


def test_a_paged_listing_shows_every_gpu_node_and_exits_1_for_the_broken(
    big: FakeApiServer, admin: tuple[Path, Path], tmp_path: Path, cli: Cli
) -> None:
    big.requests.clear()
    path = kubeconfig(tmp_path, big, cert_user(admin))
    result = cli("nodes", "--kubeconfig", str(path), "--json")
    assert result.code == 1, result.err
    document = json.loads(result.out)
    assert (document["count"], document["not_ready"], document["ready"]) == (1200, 3, False)
    names = [n["name"] for n in document["nodes"]]
    assert names == sorted(f"gpu-{i:04d}" for i in range(1200))  # no CPU node, no unlabelled
    lists = [r for r in big.requests if r.path == "/api/v1/nodes"]
    assert len(lists) == 3  # 500 + 500 + 200
    assert all("labelSelector=gpunode.io%2Fready" in r.query and "limit=500" in r.query
               for r in lists)
    assert "continue=" not in lists[0].query and all("continue=" in r.query for r in lists[1:])


def test_the_json_document_of_each_node_is_exact(
    big: FakeApiServer, admin: tuple[Path, Path], tmp_path: Path, cli: Cli
) -> None:
    path = kubeconfig(tmp_path, big, cert_user(admin))
    nodes = {n["name"]: n for n in json.loads(cli("nodes", "--kubeconfig", str(path),
                                                  "--json").out)["nodes"]}
    common = {"gpus": {"count": 8, "allocatable": 8, "product": "NVIDIA-H100-80GB-HBM3"},
              "driver": {"version": "550.127.05", "flavour": "open"},
              "gpunode_version": __version__}
    assert nodes["gpu-0000"] == {
        "name": "gpu-0000", "ready": True, "problem": None,
        "gpu_ready": {"status": "True", "reason": "GPUReady", "message": "gpunode: ready",
                      "last_transition_time": T}, "kubelet_ready": "True", **common}
    assert nodes["gpu-0007"] == {
        "name": "gpu-0007", "ready": False,
        "problem": "GPUReady=False (DeviceNodesNotReady): gpunode: device_nodes: "
                   "/dev/nvidia-uvm is missing",
        "gpu_ready": {"status": "False", "reason": "DeviceNodesNotReady",
                      "message": "gpunode: device_nodes: /dev/nvidia-uvm is missing",
                      "last_transition_time": T}, "kubelet_ready": "True", **common}
    assert nodes["gpu-0600"]["gpu_ready"] is None
    assert nodes["gpu-0600"]["problem"].startswith("no GPUReady condition: gpunode label has "
                                                   "not set it")
    assert (nodes["gpu-1100"]["kubelet_ready"], nodes["gpu-1100"]["ready"]) == ("False", False)
    assert "may be stale" in nodes["gpu-1100"]["problem"]


def test_the_console_table_is_aligned_and_says_why_nodes_are_broken(
    big: FakeApiServer, admin: tuple[Path, Path], tmp_path: Path, cli: Cli
) -> None:
    path = kubeconfig(tmp_path, big, cert_user(admin))
    lines = cli("nodes", "--kubeconfig", str(path)).out.splitlines()
    assert lines[0].split() == ["NODE", "READY", "GPUREADY", "REASON", "KUBELET", "GPUS",
                                "ALLOC", "PRODUCT", "DRIVER", "GPUNODE", "SINCE"]
    assert lines[1].split() == ["gpu-0000", "yes", "True", "GPUReady", "True", "8", "8",
                                "NVIDIA-H100-80GB-HBM3", "550.127.05", "(open)", __version__, T]
    column = lines[0].index("GPUNODE")
    assert all(line[column:].startswith(__version__) for line in lines[1:1201])  # aligned
    assert lines[8].split()[:5] == ["gpu-0007", "NO", "False", "DeviceNodesNotReady", "True"]
    assert lines[601].split()[:5] == ["gpu-0600", "NO", "missing", "-", "True"]
    assert lines[1201:] == [
        "1200 GPU node(s): 1197 ready, 3 not ready",
        "gpu-0007: GPUReady=False (DeviceNodesNotReady): gpunode: device_nodes: "
        "/dev/nvidia-uvm is missing",
        "gpu-0600: no GPUReady condition: gpunode label has not set it (is "
        "gpunode-label.service failing on the node?)",
        "gpu-1100: the kubelet's Ready is False: GPUReady=True may be stale"]


def test_all_ready_exits_0_and_an_empty_cluster_says_so(
    pki: Pki, admin: tuple[Path, Path], tmp_path: Path, cli: Cli
) -> None:
    with FakeApiServer(pki, nodes=[gpu_node("a"), gpu_node("b")]) as api:
        path = kubeconfig(tmp_path, api, cert_user(admin))
        result = cli("nodes", "--kubeconfig", str(path))
        assert (result.code, result.out.splitlines()[-1]) == (0, "2 GPU node(s): 2 ready, "
                                                                 "0 not ready")
    with FakeApiServer(pki, nodes=[make_node("cpu")]) as api:
        path = kubeconfig(tmp_path, api, cert_user(admin))
        result = cli("nodes", "--kubeconfig", str(path))
        assert (result.code, result.out) == (0, "no GPU nodes: no node has the label "
                                                "gpunode.io/ready (gpunode label sets it)\n")


def test_a_bearer_token_with_rbac_to_list_nodes_is_enough(
    big: FakeApiServer, tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path, big, {"token": "t0ken"})))
    result = cli("nodes", "--json")
    assert (result.code, json.loads(result.out)["count"]) == (1, 1200)


def test_the_context_named_on_the_command_line_is_used(
    big: FakeApiServer, admin: tuple[Path, Path], tmp_path: Path, cli: Cli
) -> None:
    path = kubeconfig(tmp_path, big, cert_user(admin), context="other")
    result = cli("nodes", "--kubeconfig", str(path), "--context", "admin@gpus", "--json")
    assert json.loads(result.out)["server"] == big.url


@pytest.mark.parametrize(("user", "status", "hint"), [
    ({"token": "n0body"}, 403, r"listing nodes needs RBAC: a ClusterRole .* a kubelet's own "
                               r"credentials cannot list nodes"),
    ({"token": "wrong"}, 401, r"does not accept this kubeconfig's credential"),
], ids=["no-rbac", "unknown-token"])
def test_a_refused_listing_says_what_rbac_it_needs(
    big: FakeApiServer, tmp_path: Path, cli: Cli, user: dict[str, str], status: int,
    hint: str
) -> None:
    import re

    result = cli("nodes", "--kubeconfig", str(kubeconfig(tmp_path, big, user)))
    assert (result.code, result.out) == (1, "")
    [error] = result.errors
    assert f"Failed to list nodes: HTTP {status}" in str(error["error"])
    assert re.search(hint, str(error["hint"])), error


def test_the_kubelet_s_own_credentials_cannot_list_nodes(
    big: FakeApiServer, pki: Pki, tmp_path: Path, cli: Cli
) -> None:
    path = kubeconfig(tmp_path, big, {"client-certificate": str(pki.kubelet_client_current),
                                      "client-key": str(pki.kubelet_client_current)})
    result = cli("nodes", "--kubeconfig", str(path))
    assert result.code == 1
    assert "only its own Node object" in str(result.errors[0]["error"])
    assert "a kubelet's own credentials cannot list nodes" in str(result.errors[0]["hint"])


def test_an_expired_continue_token_is_one_error_saying_run_it_again(
    big: FakeApiServer, admin: tuple[Path, Path], tmp_path: Path, cli: Cli,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    original = client.NodeApi.list_nodes

    def compacting(self: client.NodeApi, *args: Any) -> dict[str, Any]:
        page = original(self, *args)
        big.compact()  # etcd compacted between two pages
        return copy.deepcopy(page)

    monkeypatch.setattr(client.NodeApi, "list_nodes", compacting)
    result = cli("nodes", "--kubeconfig", str(kubeconfig(tmp_path, big, cert_user(admin))))
    assert (result.code, result.out) == (1, "")
    assert "HTTP 410" in str(result.errors[0]["error"])
    assert "run it again" in str(result.errors[0]["hint"])
