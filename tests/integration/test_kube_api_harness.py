"""The fake Kubernetes API server (gpunode_testing.kube_api) behaves as kube-apiserver does for a
kubelet's credentials. Only http.client + ssl talk to it here, so these tests check the harness,
not gpunode. Integration: make_pki runs openssl."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gpunode_testing.kube_api import DROP, MERGE_PATCH, STRATEGIC_PATCH, FakeApiServer
from gpunode_testing.kube_objects import make_node
from gpunode_testing.pki import Pki, issue_client_cert, make_pki

NODE = "/api/v1/nodes/gpu-node-1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> FakeApiServer:
    with FakeApiServer(pki, [make_node("gpu-node-1", gpus=4), make_node("other")]) as server:
        yield server


def call(api: FakeApiServer, method: str, path: str, body: Any = None,
         content_type: str = MERGE_PATCH, context: ssl.SSLContext | None = None
         ) -> tuple[int, Any]:
    connection = http.client.HTTPSConnection("127.0.0.1", api.port, timeout=5,
                                             context=context or api.pki.client_context())
    try:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
            body = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    is_json = response.getheader("Content-Type") == "application/json" and data
    return response.status, json.loads(data) if is_json else data.decode()


def labels(api: FakeApiServer) -> dict[str, str]:
    return api.node("gpu-node-1")["metadata"]["labels"]


def test_pki_has_kubelet_style_credentials(pki: Pki) -> None:
    combined = pki.kubelet_client_current.read_text()
    assert combined.startswith("-----BEGIN CERTIFICATE-----")
    assert "-----BEGIN EC PRIVATE KEY-----" in combined
    subject = subprocess.run(["openssl", "x509", "-noout", "-subject", "-in",
                              str(pki.kubelet_client_current)], capture_output=True, text=True,
                             check=True).stdout
    assert subject.strip() == "subject=O = system:nodes, CN = system:node:gpu-node-1"
    san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
                          str(pki.server_cert)], capture_output=True, text=True, check=True)
    assert "IP Address:127.0.0.1, DNS:localhost" in san.stdout
    assert pki.kubelet_client_current.stat().st_mode & 0o077 == 0


def test_get_own_node(api: FakeApiServer) -> None:
    status, node = call(api, "GET", NODE)
    assert status == 200
    assert node["kind"] == "Node" and node["metadata"]["name"] == "gpu-node-1"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "gpu-node-1"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "4"
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "True" and ready[0]["reason"] == "KubeletReady"
    assert int(node["metadata"]["resourceVersion"]) > 0 and node["metadata"]["uid"]


def test_missing_node_is_404(api: FakeApiServer) -> None:
    api.delete_node("gpu-node-1")
    for method, body in (("GET", None), ("PATCH", {"metadata": {"labels": {"a": "b"}}})):
        status, answer = call(api, method, NODE, body)
        assert status == 404
        assert answer == {"kind": "Status", "apiVersion": "v1", "metadata": {},
                          "status": "Failure", "message": 'nodes "gpu-node-1" not found',
                          "reason": "NotFound",
                          "details": {"name": "gpu-node-1", "kind": "nodes"}, "code": 404}


def test_merge_patch_adds_and_removes_labels_and_bumps_resource_version(
        api: FakeApiServer) -> None:
    version = int(api.node("gpu-node-1")["metadata"]["resourceVersion"])
    status, node = call(api, "PATCH", NODE, {"metadata": {
        "labels": {"nvidia.com/gpu.present": "true", "gpunode.io/flavour": "open"},
        "annotations": {"gpunode.io/managed-labels": "a,b"}}})
    assert status == 200
    assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    assert labels(api)["gpunode.io/flavour"] == "open"
    assert labels(api)["kubernetes.io/hostname"] == "gpu-node-1"  # merged, not replaced
    after_add = int(node["metadata"]["resourceVersion"])
    assert after_add > version

    status, node = call(api, "PATCH", NODE, {"metadata": {"labels": {"gpunode.io/flavour": None}}})
    assert status == 200 and "gpunode.io/flavour" not in labels(api)
    assert int(node["metadata"]["resourceVersion"]) > after_add

    same = node["metadata"]["resourceVersion"]
    status, node = call(api, "PATCH", NODE, {"metadata": {"labels": {"nvidia.com/gpu.present":
                                                                     "true"}}})
    assert status == 200 and node["metadata"]["resourceVersion"] == same  # no change, no write


def test_node_patch_ignores_status_and_status_patch_ignores_spec(api: FakeApiServer) -> None:
    before = api.node("gpu-node-1")
    status, node = call(api, "PATCH", NODE, {"status": {"capacity": {"nvidia.com/gpu": "8"}},
                                             "spec": {"unschedulable": True}})
    assert status == 200
    assert node["status"] == before["status"] and node["spec"]["unschedulable"] is True
    status, node = call(api, "PATCH", NODE + "/status", {"spec": {"unschedulable": False},
                                                         "status": {"capacity": {"x": "1"}}})
    assert status == 200
    assert node["spec"]["unschedulable"] is True and node["status"]["capacity"]["x"] == "1"


def test_strategic_merge_on_status_merges_conditions_by_type(api: FakeApiServer) -> None:
    condition = {"type": "GPUReady", "status": "False", "reason": "DriverMissing",
                 "message": "no driver", "lastTransitionTime": "2024-01-01T00:00:00Z"}
    status, node = call(api, "PATCH", NODE + "/status", {"status": {"conditions": [condition]}},
                        STRATEGIC_PATCH)
    assert status == 200
    kinds = [c["type"] for c in node["status"]["conditions"]]
    assert kinds == ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready", "GPUReady"]

    status, node = call(api, "PATCH", NODE + "/status", {"status": {
        "$setElementOrder/conditions": [{"type": "GPUReady"}],
        "conditions": [{"type": "GPUReady", "status": "True", "reason": "DriverLoaded"}]}},
        STRATEGIC_PATCH)
    assert status == 200
    gpu = [c for c in node["status"]["conditions"] if c["type"] == "GPUReady"]
    assert len(gpu) == 1 and gpu[0]["status"] == "True" and gpu[0]["message"] == "no driver"
    assert len(node["status"]["conditions"]) == 5

    # A JSON merge patch replaces the list: the kubelet's conditions would be lost.
    status, node = call(api, "PATCH", NODE + "/status", {"status": {"conditions": [condition]}})
    assert status == 200 and [c["type"] for c in node["status"]["conditions"]] == ["GPUReady"]


def test_patching_another_node_is_forbidden(api: FakeApiServer) -> None:
    for path in ("/api/v1/nodes/other", "/api/v1/nodes/other/status"):
        status, answer = call(api, "PATCH", path, {"metadata": {"labels": {"a": "b"}}})
        assert status == 403 and answer["reason"] == "Forbidden"
        assert answer["message"] == ('nodes "other" is forbidden: node "gpu-node-1" is not '
                                     'allowed to modify node "other"')
    status, answer = call(api, "GET", "/api/v1/nodes/other")
    assert status == 403
    assert answer["message"] == (
        'nodes "other" is forbidden: User "system:node:gpu-node-1" cannot get resource "nodes" '
        "in API group \"\" at the cluster scope: node 'gpu-node-1' cannot read 'other', only "
        "its own Node object")
    assert "a" not in api.node("other")["metadata"]["labels"]


@pytest.mark.parametrize("key", ["node-role.kubernetes.io/gpu", "node-restriction.kubernetes.io/x",
                                 "kubernetes.io/gpu", "feature.k8s.io/x", "x.kubernetes.io/y"])
def test_restricted_labels_are_forbidden(api: FakeApiServer, key: str) -> None:
    status, answer = call(api, "PATCH", NODE, {"metadata": {"labels": {key: "true"}}})
    assert status == 403
    assert answer["message"] == f'nodes "gpu-node-1" is forbidden: is not allowed to modify ' \
        f"labels: {key}"
    assert key not in labels(api)


def test_label_rules_allow_the_kubelet_list_and_check_removals(api: FakeApiServer) -> None:
    allowed = {"node.kubernetes.io/instance-type": "g5", "topology.kubernetes.io/zone": "z1",
               "kubelet.kubernetes.io/x": "1", "gpu.node.kubernetes.io/y": "2",
               "nvidia.com/gpu.present": "true", "example.com/kubernetes.io": "3"}
    assert call(api, "PATCH", NODE, {"metadata": {"labels": allowed}})[0] == 200
    node = make_node("gpu-node-1", labels={"node-role.kubernetes.io/worker": ""})
    api.set_node(node)
    status, answer = call(api, "PATCH", NODE, {"metadata": {"labels": {
        "node-role.kubernetes.io/worker": None, "k8s.io/a": "1", "b.k8s.io/b": "2"}}})
    assert status == 403
    assert answer["message"].endswith(
        "is not allowed to modify labels: b.k8s.io/b, k8s.io/a, node-role.kubernetes.io/worker")


def test_taint_change_is_forbidden(api: FakeApiServer) -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    status, answer = call(api, "PATCH", NODE, {"spec": {"taints": [taint]}})
    assert status == 403
    assert answer["message"] == ('nodes "gpu-node-1" is forbidden: node "gpu-node-1" is not '
                                 "allowed to modify taints")
    assert "taints" not in api.node("gpu-node-1")["spec"]
    api.set_node(make_node("gpu-node-1", taints=[taint]))
    assert call(api, "PATCH", NODE, {"spec": {"taints": None}})[0] == 403
    assert call(api, "PATCH", NODE, {"spec": {"taints": [taint]}})[0] == 200  # unchanged: fine


def test_an_admin_may_do_what_a_node_may_not(api: FakeApiServer) -> None:
    cert, key = issue_client_cert(api.pki, "admin", "/O=system:masters/CN=kubernetes-admin")
    admin = api.pki.client_context(cert, key)
    body = {"metadata": {"labels": {"node-role.kubernetes.io/gpu": ""}}}
    assert call(api, "PATCH", "/api/v1/nodes/other", body, context=admin)[0] == 200
    assert call(api, "GET", "/api/v1/nodes", context=admin)[1]["kind"] == "NodeList"
    nobody_cert, nobody_key = issue_client_cert(api.pki, "nobody", "/CN=system:node:gpu-node-1")
    status, answer = call(api, "GET", NODE, context=api.pki.client_context(nobody_cert,
                                                                           nobody_key))
    assert status == 403  # the CN alone is not a node: O=system:nodes is missing
    assert answer["message"].endswith('cannot get resource "nodes" in API group "" at the '
                                      "cluster scope")


@pytest.mark.parametrize("content_type", ["application/json", "application/json-patch+json",
                                          "text/plain"])
def test_other_content_types_are_415(api: FakeApiServer, content_type: str) -> None:
    status, answer = call(api, "PATCH", NODE, {"metadata": {"labels": {"a": "b"}}}, content_type)
    assert status == 415 and answer["reason"] == "UnsupportedMediaType"
    assert "a" not in labels(api)


def test_invalid_label_value_is_422(api: FakeApiServer) -> None:
    status, answer = call(api, "PATCH", NODE, {"metadata": {"labels": {
        "nvidia.com/gpu.product": "NVIDIA A100 80GB"}}})
    assert status == 422 and answer["reason"] == "Invalid"
    assert answer["message"].startswith('Node "gpu-node-1" is invalid: metadata.labels: Invalid '
                                        'value: "NVIDIA A100 80GB": a valid label must be an '
                                        "empty string or consist of alphanumeric characters")
    # A value that does not decode: the real server quotes the whole patched Node.
    status, answer = call(api, "PATCH", NODE, {"metadata": {"labels": {"a": 1}}})
    assert status == 422 and answer["reason"] == "Invalid"
    assert answer["message"].startswith('"" is invalid: patch: Invalid value: "{')
    assert answer["message"].endswith("json: cannot unmarshal number into Go struct field "
                                      "ObjectMeta.metadata.labels of type string")
    assert '\\"name\\":\\"gpu-node-1\\"' in answer["message"]
    assert len(answer["message"]) > 2000


def test_stale_resource_version_is_409(api: FakeApiServer) -> None:
    version = api.node("gpu-node-1")["metadata"]["resourceVersion"]
    assert call(api, "PATCH", NODE, {"metadata": {"labels": {"a": "1"}}})[0] == 200
    status, answer = call(api, "PATCH", NODE, {"metadata": {"resourceVersion": version,
                                                            "labels": {"a": "2"}}})
    assert status == 409 and answer["reason"] == "Conflict"


def test_a_client_certificate_of_another_ca_is_401_as_the_real_server_answers(
        api: FakeApiServer) -> None:
    """kube-apiserver completes the handshake and its x509 authenticator refuses the
    certificate: 401, not a TLS abort (which a client takes for an unreachable server)."""
    rogue = ssl.create_default_context(cadata=api.pki.ca_pem.decode())
    rogue.load_cert_chain(api.pki.untrusted_client_cert, api.pki.untrusted_client_key)
    status, answer = call(api, "GET", NODE, context=rogue)
    assert (status, answer["reason"]) == (401, "Unauthorized")
    assert api.handshake_errors == []


def test_a_node_created_without_ready_gets_the_not_ready_taint(api: FakeApiServer) -> None:
    """TaintNodesByCondition; one created Ready has been seen by the lifecycle controller."""
    api.set_node(make_node("new-node", ready=True, taints=[]))
    fresh = make_node("fresh-node", taints=[])
    fresh["status"]["conditions"] = [c for c in fresh["status"]["conditions"]
                                     if c["type"] != "Ready"]
    api.set_node(fresh)
    assert api.node("fresh-node")["spec"]["taints"] == [
        {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]
    assert "taints" not in api.node("new-node")["spec"]


def _event(namespace: str | None = None) -> dict[str, Any]:
    involved: dict[str, Any] = {"kind": "Node", "name": "gpu-node-1"}
    if namespace is not None:
        involved["namespace"] = namespace
    return {"kind": "Event", "apiVersion": "v1", "metadata": {"generateName": "gpu-node-1."},
            "involvedObject": involved, "reason": "GPUFellOffBus", "type": "Warning"}


def test_events_in_a_missing_or_mismatched_namespace_are_404_and_422(
        api: FakeApiServer) -> None:
    assert call(api, "POST", "/api/v1/namespaces/default/events", _event(),
                "application/json")[0] == 201
    status, answer = call(api, "POST", "/api/v1/namespaces/gpus/events", _event(),
                          "application/json")
    assert (status, answer["message"]) == (404, 'namespaces "gpus" not found')
    for namespace, event in (("kube-system", _event()), ("default", _event("kube-system"))):
        status, answer = call(api, "POST", f"/api/v1/namespaces/{namespace}/events", event,
                              "application/json")
        assert (status, answer["reason"]) == (422, "Invalid")
        assert "involvedObject.namespace: Invalid value" in answer["message"]


def test_no_certificate_is_the_anonymous_user_whom_rbac_refuses(api: FakeApiServer) -> None:
    anonymous = ssl.create_default_context(cadata=api.pki.ca_pem.decode())
    status, answer = call(api, "GET", NODE, context=anonymous)
    assert (status, answer["reason"]) == (403, "Forbidden")
    assert 'User "system:anonymous" cannot get resource "nodes"' in answer["message"]


def test_injected_failures_come_first(api: FakeApiServer) -> None:
    api.queue_failures(NODE, [(503, None), (500, {"kind": "Status", "code": 500}),
                              (429, None, {"Retry-After": "1"}), DROP])
    assert call(api, "GET", NODE) == (503, "")
    assert call(api, "GET", NODE) == (500, {"kind": "Status", "code": 500})
    connection = http.client.HTTPSConnection("127.0.0.1", api.port,
                                             context=api.pki.client_context(), timeout=5)
    connection.request("GET", NODE)
    response = connection.getresponse()
    assert response.status == 429 and response.getheader("Retry-After") == "1"
    connection.close()
    with pytest.raises(http.client.RemoteDisconnected):
        call(api, "GET", NODE)
    assert call(api, "GET", "/api/v1/nodes/other")[0] == 403  # another prefix: not affected
    assert call(api, "GET", NODE)[0] == 200
    assert [r.injected for r in api.requests] == [True, True, True, True, False, False]
    assert [r.status for r in api.requests] == [503, 500, 429, None, 403, 200]


def test_requests_are_recorded_with_the_client_identity(api: FakeApiServer) -> None:
    call(api, "GET", NODE + "?resourceVersion=0")
    call(api, "PATCH", NODE, {"metadata": {"labels": {"a": "b"}}})
    get, patch = api.requests
    assert (get.method, get.path, get.query, get.body, get.json) == (
        "GET", NODE, "resourceVersion=0", b"", None)
    assert patch.method == "PATCH" and patch.headers["content-type"] == MERGE_PATCH
    assert patch.json == {"metadata": {"labels": {"a": "b"}}}
    assert json.loads(patch.body) == patch.json
    assert {r.client_cn for r in api.requests} == {"system:node:gpu-node-1"}
    assert get.client_groups == ("system:nodes",) and (get.status, patch.status) == (200, 200)


def test_kubeconfig_is_a_kubeadm_kubelet_conf(api: FakeApiServer, tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    pem = "/var/lib/kubelet/pki/kubelet-client-current.pem"
    doc = yaml.safe_load(api.write_kubeconfig(tmp_path / "kubelet.conf", pem, pem).read_text())
    context = doc["contexts"][0]
    assert doc["current-context"] == context["name"] == "system:node:gpu-node-1@kubernetes"
    cluster = doc["clusters"][0]["cluster"]
    assert cluster["server"] == api.url
    assert base64.b64decode(cluster["certificate-authority-data"]) == api.pki.ca_pem
    assert doc["users"][0]["user"] == {"client-certificate": pem, "client-key": pem}
    doc = yaml.safe_load(api.write_kubeconfig(tmp_path / "k2", "c", "k", embed_ca=False)
                         .read_text())
    assert doc["clusters"][0]["cluster"]["certificate-authority"] == str(api.pki.ca_cert)


def test_shutdown_is_prompt_with_a_kept_alive_connection(pki: Pki) -> None:
    with FakeApiServer(pki) as server:
        connection = http.client.HTTPSConnection("127.0.0.1", server.port,
                                                 context=pki.client_context(), timeout=5)
        connection.request("GET", NODE)
        assert connection.getresponse().read()
        start = time.monotonic()
    assert time.monotonic() - start < 2
    connection.close()


def admin_context(pki: Pki) -> ssl.SSLContext:
    cert, key = issue_client_cert(pki, "harness-admin", "/O=system:masters/CN=admin")
    return pki.client_context(cert, key)


def test_a_chunked_list_pages_in_name_order_with_the_selector(pki: Pki) -> None:
    nodes = [make_node(f"n{i}", labels={"gpu": "yes"} if i % 2 else {}) for i in range(7)]
    with FakeApiServer(pki, nodes) as api:
        context = admin_context(pki)
        names, token, pages = [], "", 0
        while True:
            query = "labelSelector=gpu%3Dyes&limit=2" + (f"&continue={token}" if token else "")
            status, page = call(api, "GET", f"/api/v1/nodes?{query}", context=context)
            assert status == 200, page
            names += [n["metadata"]["name"] for n in page["items"]]
            pages += 1
            assert "remainingItemCount" not in page["metadata"]  # not with a selector
            token = page["metadata"].get("continue", "")
            if not token:
                break
        assert (names, pages) == (["n1", "n3", "n5"], 2)
        status, page = call(api, "GET", "/api/v1/nodes?limit=5", context=context)
        assert page["metadata"]["remainingItemCount"] == 2
        assert call(api, "GET", "/api/v1/nodes?labelSelector=!gpu", context=context)[1][
            "items"][0]["metadata"]["name"] == "n0"


def test_a_continue_token_from_before_compaction_is_410_and_garbage_is_400(pki: Pki) -> None:
    with FakeApiServer(pki, [make_node("a"), make_node("b")]) as api:
        context = admin_context(pki)
        token = call(api, "GET", "/api/v1/nodes?limit=1", context=context)[1]["metadata"][
            "continue"]
        api.compact()
        status, answer = call(api, "GET", f"/api/v1/nodes?limit=1&continue={token}",
                              context=context)
        assert (status, answer["reason"]) == (410, "Expired")
        assert call(api, "GET", "/api/v1/nodes?continue=%%%", context=context)[0] == 400
        assert call(api, "GET", "/api/v1/nodes?labelSelector=a+in+(b)", context=context)[0] \
            == 400


def test_a_bearer_token_is_its_user_and_node_readers_may_list(pki: Pki) -> None:
    with FakeApiServer(pki, [make_node("a")], tokens={"t": ("alice", ("devs",)),
                                                      "u": ("bob", ())},
                       node_readers=("devs",)) as api:
        anonymous = ssl.create_default_context(cadata=pki.ca_pem.decode())

        def listed(token: str) -> int:
            connection = http.client.HTTPSConnection("127.0.0.1", api.port, timeout=5,
                                                     context=anonymous)
            connection.request("GET", "/api/v1/nodes", headers={
                "Authorization": f"Bearer {token}"})
            status = connection.getresponse().status
            connection.close()
            return status

        assert [listed("t"), listed("u"), listed("nope")] == [200, 403, 401]
        assert [r.client_cn for r in api.requests] == ["alice", "bob", None]
