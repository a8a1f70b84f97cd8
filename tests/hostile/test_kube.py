"""Hostile Kubernetes inputs: the kubelet's kubeconfig, kubeadm-flags.env and the API server's
replies. Each is one clear refusal naming the file or URL and what is wrong, exit 1, no
traceback, nothing written."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest
import yaml

from conftest import HostFactory
from gpunode.platform.host import Host
from gpunode_testing.kube_api import KUBELET_CLIENT, KUBELET_KUBECONFIG, FakeApiServer, join
from gpunode_testing.pki import Pki
from hostile.support import Cli, check_refusal

NODE = "nc4as-t4-v3-vmss000000"  # the fixture's hostname
KUBECONFIG, CLIENT = KUBELET_KUBECONFIG, KUBELET_CLIENT
PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BASE: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Config", "current-context": "kubelet",
    "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443",
                                             "certificate-authority-data": b64(PEM)}}],
    "contexts": [{"name": "kubelet", "context": {"cluster": "k", "user": "u"}}],
    "users": [{"name": "u", "user": {"client-certificate": CLIENT, "client-key": CLIENT}}],
}


def cluster(**values: object) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["clusters"][0]["cluster"].update(values)
    return doc


def user(**values: object) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["users"][0]["user"] = values
    return doc


def replace(**values: object) -> dict[str, Any]:
    return {**copy.deepcopy(BASE), **values}


# kubeconfig text → the refusal (read before any connection is made)
KUBECONFIGS: dict[str, tuple[str, str]] = {
    "ca-data-not-base64": (yaml.safe_dump(cluster(**{"certificate-authority-data": "%%%="})),
                           r"kubelet\.conf: certificate-authority-data is not valid base64"),
    "ca-data-not-pem": (yaml.safe_dump(cluster(**{"certificate-authority-data": b64(b"hi")})),
                        r"certificate-authority-data does not hold PEM"),
    "ca-data-a-number": (yaml.safe_dump(cluster(**{"certificate-authority-data": 12})),
                         r"certificate-authority-data is a number, not a base64 string"),
    "ca-data-bad-pem": (yaml.safe_dump(cluster(**{"certificate-authority-data": b64(
        b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n")})),
        r"certificate-authority-data in \S+kubelet\.conf: not a PEM certificate"),
    "cert-data-not-base64": (yaml.safe_dump(user(**{"client-certificate-data": "@@"})),
                             r"client-certificate-data is not valid base64"),
    "key-data-not-pem": (yaml.safe_dump(user(**{"client-certificate-data": b64(PEM),
                                                "client-key-data": b64(b"\x00\x01")})),
                         r"client-key-data does not hold PEM"),
    "port-not-a-number": (yaml.safe_dump(cluster(server="https://127.0.0.1:abc")),
                          r"server 'https://127\.0\.0\.1:abc' is not a usable URL: Port could "
                          r"not be cast"),
    "port-out-of-range": (yaml.safe_dump(cluster(server="https://127.0.0.1:99999")),
                          r"is not a usable URL: Port out of range"),
    "bad-ipv6": (yaml.safe_dump(cluster(server="https://[::1/api")),
                 r"is not a usable URL: Invalid IPv6 URL"),
    "plain-http": (yaml.safe_dump(cluster(server="http://127.0.0.1:8080")),
                   r"over https only"),
    "space-in-server": (yaml.safe_dump(cluster(server="https://api.example.com/a b")),
                        r"whitespace or control characters"),
    "no-server": (yaml.safe_dump(cluster(server=None)),
                  r"the cluster's server is missing, not a URL"),
    "not-yaml": ("clusters: [\n", r"kubelet\.conf: not valid YAML"),
    "a-list": ("- 1\n- 2\n", r"the document is a list, not a map"),
    "contexts-a-map": (yaml.safe_dump(replace(contexts={"a": 1})),
                       r"'contexts' is a map, not a list"),
    "no-such-context": (yaml.safe_dump(replace(**{"current-context": "other"})),
                        r"current-context names context 'other', which 'contexts' does not"),
    "cluster-a-string": (yaml.safe_dump(replace(clusters=[{"name": "k", "cluster": "x"}])),
                         r"cluster 'k': 'cluster' is a string, not a map"),
    "no-client-cert": (yaml.safe_dump(user(token="abc")),
                       r"the user has no client-certificate or client-certificate-data"),
    "client-cert-missing-file": (yaml.safe_dump(user(**{"client-certificate": "/nope.pem"})),
                                 r"kubelet\.conf: client-certificate \S*/nope\.pem cannot be "
                                 r"read: No such file"),
}


@pytest.fixture
def joined(make_host: HostFactory) -> Host:
    """A ready T4 node whose kubelet joined: kubeconfig and (placeholder) client credential."""
    host = make_host("nc4as-t4-v3", "ready")
    client = host.root / CLIENT.lstrip("/")
    client.parent.mkdir(parents=True)
    client.write_bytes(PEM)
    (host.root / KUBECONFIG.lstrip("/")).parent.mkdir(parents=True)
    return host


@pytest.mark.parametrize("case", list(KUBECONFIGS))
def test_a_broken_kubeconfig_is_one_refusal_naming_it(joined: Host, cli: Cli, case: str) -> None:
    text, pattern = KUBECONFIGS[case]
    (joined.root / KUBECONFIG.lstrip("/")).write_text(text)
    check_refusal(cli, joined.root, ["--root", str(joined.root), "label"], 1, pattern)


@pytest.mark.parametrize(("case", "phrase"), [
    ("port-not-a-number", "Port could not be cast to integer value as 'abc'"),
    ("ca-data-not-base64", "certificate-authority-data is not valid base64"),
    ("a-list", "the document is a list, not a map")])
def test_status_with_a_broken_kubeconfig_warns_on_the_node_check(
    joined: Host, cli: Cli, case: str, phrase: str
) -> None:
    (joined.root / KUBECONFIG.lstrip("/")).write_text(KUBECONFIGS[case][0])
    result = cli("--root", str(joined.root), "status", "--json")
    node = next(c for c in json.loads(result.out)["checks"] if c["name"] == "node")
    assert (result.code, node["state"]) == (0, "warn")
    assert node["detail"].startswith(f"node {NODE}: {joined.root}{KUBECONFIG}: ")
    assert phrase in node["detail"]


FLAGS = {
    "unbalanced-double-quote": 'KUBELET_KUBEADM_ARGS="--node-ip=\'10.0.0.4 --hostname-override=x"',
    "dangling-backslash": "KUBELET_KUBEADM_ARGS=--hostname-override=x \\",
}


@pytest.mark.parametrize("case", list(FLAGS))
def test_a_kubeadm_flags_file_with_broken_quoting_is_refused_with_its_line(
    joined: Host, cli: Cli, case: str
) -> None:
    flags = joined.root / "var/lib/kubelet/kubeadm-flags.env"
    flags.write_text(f"# written by kubeadm\n{FLAGS[case]}\n")
    check_refusal(cli, joined.root, ["--root", str(joined.root), "label"], 1,
                  r"kubeadm-flags\.env:2: KUBELET_KUBEADM_ARGS: cannot split the kubelet's "
                  r"flags .* set kubernetes\.node_name")


# -- replies of a real TLS API server (gpunode_testing.kube_api) --------------------------------

REPLIES: dict[str, tuple[object, str]] = {
    "html-page": ("<html><body>Sign in</body></html>", r"is not JSON \(text/plain"),
    "empty-body": ("", r"is not JSON"),
    "a-list": ([{"metadata": {}}], r"is a list, not a Node object"),
    "no-metadata": ({"kind": "Node"}, r"has metadata that is missing, not a map"),
    "labels-a-list": ({"metadata": {"labels": ["a=b"]}},
                      r"has metadata\.labels that is a list, not a map"),
    "label-value-a-number": ({"metadata": {"labels": {"a": 1}}},
                             r"has metadata\.labels\.a that is a number, not a string"),
    "annotations-a-string": ({"metadata": {"annotations": "x"}},
                             r"has metadata\.annotations that is a string, not a map"),
    "conditions-a-map": ({"metadata": {}, "status": {"conditions": {"type": "Ready"}}},
                         r"has status\.conditions that is a map, not a list"),
    "condition-a-string": ({"metadata": {}, "status": {"conditions": ["Ready"]}},
                           r"has status\.conditions entries that are not objects"),
    "status-a-list": ({"metadata": {}, "status": []}, r"has status that is a list, not a map"),
}

integration = pytest.mark.integration


@pytest.fixture
def registered(make_host: HostFactory, api: FakeApiServer, pki: Pki) -> Host:
    host = make_host("nc4as-t4-v3", "ready")
    join(host.root, api, pki)
    return host


@integration
@pytest.mark.parametrize("case", list(REPLIES))
def test_an_api_reply_of_the_wrong_shape_is_refused_naming_the_url(
    registered: Host, api: FakeApiServer, cli: Cli, case: str
) -> None:
    body, pattern = REPLIES[case]
    api.queue_failures(f"/api/v1/nodes/{NODE}", [(200, body)])
    check_refusal(cli, registered.root, ["--root", str(registered.root), "label"], 1,
                  rf"get node {NODE}: HTTP 200: the reply from {api.url}/api/v1/nodes/{NODE} "
                  rf"{pattern}.* the API server itself")
    assert len(api.requests) == 1  # not retried: it will not get better


@integration
def test_client_key_data_that_is_not_the_certificate_s_key_is_refused(
    registered: Host, api: FakeApiServer, pki: Pki, cli: Cli
) -> None:
    path = registered.root / KUBECONFIG.lstrip("/")
    doc = yaml.safe_load(path.read_text())
    doc["users"][0]["user"] = {
        "client-certificate-data": b64(pki.client_cert.read_bytes()),
        "client-key-data": b64(pki.untrusted_client_key.read_bytes())}
    path.write_text(yaml.safe_dump(doc))
    check_refusal(cli, registered.root, ["--root", str(registered.root), "label"], 1,
                  r"kubelet\.conf: client-certificate-data in \S+ and client-key-data in \S+: "
                  r"cannot load the client certificate and key")
    assert api.requests == []


@integration
def test_inline_client_certificate_data_is_used(
    registered: Host, api: FakeApiServer, pki: Pki, cli: Cli
) -> None:
    """kubeadm's first kubelet.conf embeds the certificate: label works with it too."""
    path = registered.root / KUBECONFIG.lstrip("/")
    doc = yaml.safe_load(path.read_text())
    doc["users"][0]["user"] = {"client-certificate-data": b64(pki.client_cert.read_bytes()),
                               "client-key-data": b64(pki.client_key.read_bytes())}
    path.write_text(yaml.safe_dump(doc))
    result = cli("--root", str(registered.root), "label")
    assert result.code == 0, result.err
    assert {r.client_cn for r in api.requests} == {f"system:node:{NODE}"}


@integration
def test_status_with_an_api_reply_of_the_wrong_shape_warns_on_the_node_check(
    registered: Host, api: FakeApiServer, cli: Cli
) -> None:
    api.queue_failures(f"/api/v1/nodes/{NODE}", [(200, {"metadata": {"labels": "gpu=yes"}})])
    result = cli("--root", str(registered.root), "status", "--json")
    node = next(c for c in json.loads(result.out)["checks"] if c["name"] == "node")
    assert (result.code, node["state"]) == (0, "warn")
    assert "has metadata.labels that is a string, not a map" in node["detail"]


@pytest.mark.parametrize(("flags", "expected"), [
    ('KUBELET_KUBEADM_ARGS="--hostname-override="\n', "nc4as-t4-v3-vmss000000"),
    ('KUBELET_KUBEADM_ARGS="--hostname-override=Node-1.Example"\n', "node-1.example"),
], ids=["empty-override-means-the-hostname", "uppercase-is-lowered"])
def test_the_node_name_is_the_kubelets_choice(
    make_host: HostFactory, cli: Cli, flags: str, expected: str
) -> None:
    host = make_host("nc4as-t4-v3", "ready",
                     extra={"/var/lib/kubelet/kubeadm-flags.env": flags})
    result = cli("--root", str(host.root), "label", "--dry-run", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["node"] == expected


def test_a_node_name_the_api_server_refuses_is_named(make_host: HostFactory, cli: Cli) -> None:
    flags = 'KUBELET_KUBEADM_ARGS="--hostname-override=UP_per"\n'
    host = make_host("nc4as-t4-v3", "ready", extra={"/var/lib/kubelet/kubeadm-flags.env": flags})
    check_refusal(cli, host.root, ["--root", str(host.root), "label", "--dry-run"], 1,
                  r"cannot use 'up_per' \(from --hostname-override in "
                  r"/var/lib/kubelet/kubeadm-flags.env\) as this node's name: a Node's name is")
