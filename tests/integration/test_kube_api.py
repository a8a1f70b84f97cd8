"""`gpunode label` against a local HTTPS API server with a real CA and client-certificate TLS
(gpunode_testing.kube_api: no real API server can run here; it checks method, path, content type,
body and identity, and applies NodeRestriction's rules)."""

from __future__ import annotations

import json

import pytest

from conftest import HostFactory
from gpunode.cli.main import main
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.kube import label as step
from gpunode.kube.client import ApiError
from gpunode.platform.host import Host
from gpunode_testing.kube_api import DROP, KUBELET_CLIENT, KUBELET_KUBECONFIG, FakeApiServer, join
from gpunode_testing.kube_objects import make_node
from gpunode_testing.pki import Pki

NODE = "nc4as-t4-v3-vmss000000"  # the fixture's hostname
KUBECONFIG, CLIENT = KUBELET_KUBECONFIG, KUBELET_CLIENT


@pytest.fixture
def node(make_host: HostFactory, api: FakeApiServer, pki: Pki) -> Host:
    """A ready T4 node whose kubelet joined: its kubeconfig and rotated client credential."""
    host = make_host("nc4as-t4-v3", "ready")
    join(host.root, api, pki)
    return host


def config(**kube: object) -> AgentConfig:
    return AgentConfig(kubernetes=KubernetesConfig(**{"wait_seconds": 5, **kube}))  # type: ignore[arg-type]


def label(host: Host, cfg: AgentConfig | None = None) -> step.Outcome:
    cfg = cfg or config()
    return step.apply(host, cfg, step.for_host(host, cfg), now="2026-11-29T08:00:00Z")


def test_first_run_gets_then_patches_labels_and_status(node: Host, api: FakeApiServer) -> None:
    outcome = label(node)
    assert (outcome.labels_changed, outcome.condition_changed) == (True, True)
    methods = [(r.method, r.path, r.headers.get("content-type")) for r in api.requests]
    assert methods == [
        ("GET", f"/api/v1/nodes/{NODE}", None),
        ("PATCH", f"/api/v1/nodes/{NODE}", "application/merge-patch+json"),
        ("PATCH", f"/api/v1/nodes/{NODE}/status", "application/strategic-merge-patch+json")]
    assert {r.client_cn for r in api.requests} == {f"system:node:{NODE}"}
    stored = api.node(NODE)
    assert stored is not None
    assert stored["metadata"]["labels"]["nvidia.com/gpu.product"] == "Tesla-T4"
    assert stored["metadata"]["labels"]["kubernetes.io/hostname"] == NODE  # untouched
    conditions = {c["type"]: c for c in stored["status"]["conditions"]}
    assert conditions["GPUReady"]["status"] == "True"
    assert conditions["Ready"]["status"] == "True"  # the kubelet's condition stays


def test_second_run_with_nothing_to_change_is_one_get_and_no_patch(
    node: Host, api: FakeApiServer
) -> None:
    label(node)
    api.requests.clear()
    outcome = label(node)
    assert (outcome.labels_changed, outcome.condition_changed) == (False, False)
    assert [(r.method, r.path) for r in api.requests] == [("GET", f"/api/v1/nodes/{NODE}")]


def test_labels_gpunode_no_longer_wants_are_removed_and_others_kept(
    node: Host, api: FakeApiServer
) -> None:
    label(node, config(labels={"example.com/pool": "t4"}))
    stored = api.node(NODE)
    assert stored is not None
    stored["metadata"]["labels"]["team"] = "ml"  # someone else's label
    api.set_node(stored)
    label(node)  # the configured label is gone from the config
    labels = api.node(NODE)["metadata"]["labels"]  # type: ignore[index]
    assert "example.com/pool" not in labels
    assert labels["team"] == "ml"


def test_condition_transition_time_is_kept_while_the_status_holds(
    node: Host, api: FakeApiServer
) -> None:
    label(node)
    first = {c["type"]: c for c in api.node(NODE)["status"]["conditions"]}  # type: ignore[index]
    (node.root / "dev/nvidia-uvm").unlink()  # now not ready: status flips
    step.apply(node, config(), step.for_host(node, config()), now="2026-11-29T09:00:00Z")
    flipped = {c["type"]: c for c in api.node(NODE)["status"]["conditions"]}  # type: ignore[index]
    assert flipped["GPUReady"]["status"] == "False"
    assert flipped["GPUReady"]["reason"] == "DeviceNodesNotReady"
    assert flipped["GPUReady"]["lastTransitionTime"] == "2026-11-29T09:00:00Z"
    assert first["GPUReady"]["lastTransitionTime"] == "2026-11-29T08:00:00Z"


def test_node_not_registered_yet_is_retried_until_it_appears(
    node: Host, api: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gpunode.kube.client.time.sleep", lambda s: None)
    api.queue_failures(f"/api/v1/nodes/{NODE}", [(404, None), (503, None), DROP])
    outcome = label(node)
    assert outcome.labels_changed
    assert [r.status for r in api.requests[:4]] == [404, 503, None, 200]


def test_retries_stop_within_the_configured_time(
    node: Host, api: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    waited: list[float] = []
    monkeypatch.setattr("gpunode.kube.client.time.sleep", waited.append)
    api.queue_failures(f"/api/v1/nodes/{NODE}", [(503, None)] * 50)
    with pytest.raises(ApiError, match="HTTP 503"):
        label(node, config(wait_seconds=0))
    assert waited == []  # no time to wait: the first failure is the answer
    api.requests.clear()
    with pytest.raises(ApiError):
        label(node, config(wait_seconds=1))
    assert len(api.requests) <= 2


def test_node_restriction_refusal_is_reported_with_its_message(
    node: Host, api: FakeApiServer
) -> None:
    # Built directly: reading it from a config file would refuse the label before any request.
    forbidden = config(labels={"node-role.kubernetes.io/gpu": "true"})
    with pytest.raises(ApiError) as info:
        label(node, forbidden)
    assert info.value.status == 403
    assert "is not allowed to modify labels: node-role.kubernetes.io/gpu" in str(info.value)
    assert "NodeRestriction" in info.value.hint
    assert [r.status for r in api.requests] == [200, 403]  # not retried


def test_another_nodes_object_is_refused_at_the_get(node: Host, api: FakeApiServer) -> None:
    api.set_node(make_node("other-node", gpus=1))
    with pytest.raises(ApiError) as info:
        label(node, config(node_name="other-node"))
    assert info.value.status == 403
    assert "cannot read 'other-node', only its own Node object" in str(info.value)


def test_cli_label_and_credentials_never_in_the_logs(
    node: Host, api: FakeApiServer, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--root", str(node.root), "--log-format", "json", "label", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert (doc["node"], doc["labels_changed"], doc["condition_changed"]) == (NODE, True, True)
    secrets = pki.kubelet_client_current.read_text().split("-----")
    key_material = [part.strip() for part in secrets if len(part.strip()) > 40]
    assert key_material
    for blob in key_material:
        assert blob[:40] not in err and blob[:40] not in out


def test_dry_run_contacts_nothing(node: Host, api: FakeApiServer,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(node.root), "--log-format", "json", "label", "--dry-run",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["labels"]["nvidia.com/gpu.count"] == "1"
    assert api.requests == []


def test_status_node_check_reads_the_node(node: Host, api: FakeApiServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    main(["--root", str(node.root), "--log-format", "json", "status", "--json"])
    before = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "node")
    assert before["state"] == "warn"
    assert "labels not current" in before["detail"]
    label(node)
    main(["--root", str(node.root), "--log-format", "json", "status", "--json"])
    after = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "node")
    assert (after["state"], after["detail"]) == (
        "ok", f"node {NODE}: labels current; GPUReady=True; nvidia.com/gpu allocatable=1")


def test_a_node_whose_gpu_cannot_be_identified_gets_gpuready_false_and_label_exits_1(
    node: Host, api: FakeApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not left as the last run labelled it (GPUReady=True would keep GPU pods coming)."""
    label(node)
    (node.root / "sys/devices/pci0001:00/0001:00:00.0/vendor").write_text("zz\n")
    code = main(["--root", str(node.root), "--log-format", "json", "label"])
    assert code == 1, capsys.readouterr().err
    stored = api.node(NODE)
    assert stored is not None
    labels = stored["metadata"]["labels"]
    assert not [k for k in labels if k.startswith("nvidia.com/gpu.")]
    assert labels["gpunode.io/ready"] == "false"
    conditions = {c["type"]: c for c in stored["status"]["conditions"]}
    assert (conditions["GPUReady"]["status"], conditions["GPUReady"]["reason"]) == (
        "False", "GpusNotReady")
