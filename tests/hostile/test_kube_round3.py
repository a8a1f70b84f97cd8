"""Hostile Kubernetes API servers, round 3: one that drips its answer (each call has an overall
deadline now, where a per-read timeout never tripped), one that redirects, one that hands out
fresh continue tokens for empty pages for ever, one whose error message is kilobytes long, and a
kubeconfig whose server URL carries credentials (never logged, never sent)."""

from __future__ import annotations

import ssl
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import HostFactory
from gpunode.platform.host import Host
from gpunode_testing.kube_api import KUBELET_KUBECONFIG, FakeApiServer, join
from gpunode_testing.pki import Pki
from helpers.raw_server import drip, raw_server
from hostile.support import Cli, assert_refused, check_refusal

NODE = "nc4as-t4-v3-vmss000000"  # the fixture's hostname
integration = pytest.mark.integration
FAST = "[kubernetes]\nrequest_timeout = 1\nwait_seconds = 2\n"


def dripping(pki: Pki, head: bytes) -> AbstractContextManager[str]:
    """A TLS server (the test API server's certificate) that reads a request, sends `head`,
    then one byte every 0.3 s for hours (longer than any test waits); its URL."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    return raw_server(drip(head, b"x" * 100000, 0.3), tls=context)


def point(path: Path, server: str) -> None:
    doc = yaml.safe_load(path.read_text())
    doc["clusters"][0]["cluster"]["server"] = server
    path.write_text(yaml.safe_dump(doc))


@pytest.fixture
def registered(make_host: HostFactory, api: FakeApiServer, pki: Pki) -> Host:
    host = make_host("nc4as-t4-v3", "ready", extra={"/etc/gpunode/config.toml": FAST})
    join(host.root, api, pki)
    return host


DRIPS = {  # what the server sends before it drips: a header line, the body
    "header": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: ",
    "body": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 99999\r\n"
            b"\r\n{",
}


@integration
@pytest.mark.parametrize("drip", DRIPS, ids=DRIPS.keys())
def test_label_against_a_dripping_server_ends_within_its_deadlines(
        registered: Host, pki: Pki, cli: Cli, drip: str) -> None:
    """Each call ends after kubernetes.request_timeout, the retries after wait_seconds: it
    used to hold the node as long as the server kept dripping."""
    with dripping(pki, DRIPS[drip]) as url:
        point(registered.root / KUBELET_KUBECONFIG.lstrip("/"), url)
        started = time.monotonic()
        check_refusal(cli, registered.root, ["--root", str(registered.root), "label"], 1,
                      rf"get node {NODE}: no answer: {url}: no whole answer within 1 s "
                      r"\(kubernetes\.request_timeout")
    assert time.monotonic() - started < 6


@integration
def test_nodes_against_a_dripping_server_ends_at_the_request_timeout(
        api: FakeApiServer, pki: Pki, tmp_path: Path, cli: Cli) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.conf", pki.kubelet_client_current,
                                      pki.kubelet_client_current)
    config = tmp_path / "gpunode.toml"
    config.write_text(FAST)
    with dripping(pki, DRIPS["body"]) as url:
        point(kubeconfig, url)
        started = time.monotonic()
        result = check_refusal(cli, tmp_path, ["--config", str(config), "nodes",
                                               "--kubeconfig", str(kubeconfig)], 1,
                               r"list nodes: no answer: .*no whole answer within 1 s")
    assert time.monotonic() - started < 4
    assert result.out == ""


@integration
@pytest.mark.parametrize("status", [301, 302, 307])
def test_a_redirect_from_the_api_server_is_named_not_taken_for_json(
        registered: Host, api: FakeApiServer, cli: Cli, status: int) -> None:
    """It used to be 'HTTP 200 … is not JSON'."""
    api.queue_failures(f"/api/v1/nodes/{NODE}", [
        (status, "", {"Location": "https://login.example/sso?next=/api"})])
    check_refusal(cli, registered.root, ["--root", str(registered.root), "label"], 1,
                  rf"get node {NODE}: HTTP {status}: a redirect to https://login\.example/"
                  r"sso\?next=/api, which gpunode does not follow.*the API server itself")
    assert len(api.requests) == 1  # not retried


@integration
def test_nodes_gives_up_on_empty_pages_that_never_end(
        registered: Host, api: FakeApiServer, pki: Pki, tmp_path: Path, cli: Cli) -> None:
    """Each page empty with a fresh continue token: the cap used to count nodes only."""
    from gpunode.kube import nodes

    kubeconfig = tmp_path / "admin.conf"
    api.write_kubeconfig(kubeconfig, pki.kubelet_client_current, pki.kubelet_client_current)
    api.node_readers = frozenset({f"system:node:{pki.node_name}"})
    pages = nodes.max_pages(nodes.PAGE)
    api.queue_failures("/api/v1/nodes", [
        (200, {"kind": "NodeList", "metadata": {"continue": f"token-{i}"}, "items": []})
        for i in range(pages + 5)])
    result = check_refusal(cli, tmp_path, ["nodes", "--kubeconfig", str(kubeconfig)], 1,
                           rf"list nodes: .*still has a next page after {pages} pages "
                           r"\(0 nodes\): the listing would never end")
    assert result.out == ""
    assert len(api.requests) == pages


@integration
def test_a_long_server_message_is_cut_to_what_a_terminal_shows(
        registered: Host, api: FakeApiServer, cli: Cli) -> None:
    message = "Node \"x\" is invalid: " + "{\"metadata\": " * 600 + "\x1b[2J"
    api.queue_failures(f"/api/v1/nodes/{NODE}", [
        (422, {"kind": "Status", "code": 422, "reason": "Invalid", "message": message})])
    result = check_refusal(cli, registered.root, ["--root", str(registered.root), "label"], 1,
                           r"HTTP 422: Node \"x\" is invalid: .*… \(\d+ characters, cut\)")
    error: Any = result.errors[0]["error"]
    assert len(error) < 500 and "\x1b" not in error


@integration
@pytest.mark.parametrize("command", ["label", "nodes"])
def test_credentials_in_the_server_url_are_refused_and_never_shown(
        registered: Host, api: FakeApiServer, pki: Pki, tmp_path: Path, cli: Cli,
        command: str) -> None:
    """They used to be written to the log in step.done."""
    kubeconfig = registered.root / KUBELET_KUBECONFIG.lstrip("/")
    if command == "nodes":
        kubeconfig = api.write_kubeconfig(tmp_path / "admin.conf", pki.kubelet_client_current,
                                          pki.kubelet_client_current)
    point(kubeconfig, api.url.replace("https://", "https://admin:hunter2@"))
    argv = ["--root", str(registered.root), "label"] if command == "label" else \
        ["nodes", "--kubeconfig", str(kubeconfig)]
    result = check_refusal(cli, registered.root if command == "label" else tmp_path, argv,
                           1 if command == "label" else 2,
                           r"server 'https://\*\*\*@127\.0\.0\.1:\d+' is not a usable URL: it "
                           r"holds a user or password, which gpunode never sends")
    assert "hunter2" not in result.err + result.out
    assert api.requests == []


# -- what gpunode says about what a real kube-apiserver answers ------------------------------

@integration
def test_a_certificate_of_another_ca_is_401_at_once_with_both_causes_named(
        registered: Host, api: FakeApiServer, pki: Pki, cli: Cli) -> None:
    """The real server answers 401 (the test server used to abort the handshake, which
    gpunode retried as 'unreachable' for wait_seconds); the hint used to ask only about
    expiry."""
    client = registered.root / "var/lib/kubelet/pki/kubelet-client-current.pem"
    client.write_bytes(pki.untrusted_client_cert.read_bytes()
                       + pki.untrusted_client_key.read_bytes())
    check_refusal(cli, registered.root, ["--root", str(registered.root), "label"], 1,
                  rf"get node {NODE}: HTTP 401: Unauthorized .*expired, or signed by another "
                  r"CA than the cluster's")
    assert [r.status for r in api.requests] == [401]  # not retried


@integration
def test_another_nodes_object_is_the_node_authorizers_refusal(
        make_host: HostFactory, api: FakeApiServer, pki: Pki, cli: Cli) -> None:
    """The first GET is refused by the Node authorizer, never reaching NodeRestriction."""
    from gpunode_testing.kube_objects import make_node

    api.set_node(make_node("other-node", gpus=1))
    host = make_host("nc4as-t4-v3", "ready", extra={
        "/etc/gpunode/config.toml": FAST + 'node_name = "other-node"\n'})
    join(host.root, api, pki)
    result = check_refusal(cli, host.root, ["--root", str(host.root), "label"], 1,
                           r"get node other-node: HTTP 403: .*cannot read 'other-node'.*"
                           r"Node authorizer refused it: a kubelet may read only its own Node")
    assert "NodeRestriction" not in str(result.errors[0]["hint"])


@integration
@pytest.mark.parametrize("also", ["nothing-else", "gone-from-the-driver"])
def test_a_gpu_that_fell_off_the_bus_stays_the_headline_when_label_runs_later(
        registered: Host, api: FakeApiServer, tmp_path: Path, pki: Pki, cli: Cli,
        also: str) -> None:
    """watch --once sets GPUReady=False GPUFellOffBus; a later `gpunode label` (the unit
    restarted, the node rebooted into the same boot's state) used to replace the reason with
    the first failing check (ContainerdRuntimeNotReady), the Xid only in the message.
    gone-from-the-driver: the GPU has left /proc/driver/nvidia/gpus too, so driver_gpus and
    cdi_spec fail before the watch's check in status's order."""
    import json
    import shutil

    (registered.root / "dev/kmsg").write_text(
        "6,1,100,-;Linux version 6.6.95-flatcar\n"
        "4,2,6000000,-;NVRM: Xid (PCI:0001:00:00): 79, pid=1122, GPU has fallen off the bus.\n")
    if also == "gone-from-the-driver":
        shutil.rmtree(registered.root / "proc/driver/nvidia/gpus/0001:00:00.0")
    assert cli("--root", str(registered.root), "watch", "--once").code == 0
    result = cli("--root", str(registered.root), "label")
    assert result.code == 0, result.err
    ready = {c["type"]: c for c in api.node(NODE)["status"]["conditions"]}["GPUReady"]
    assert (ready["status"], ready["reason"]) == ("False", "GPUFellOffBus")
    assert ready["message"].startswith("gpunode: watch: fatal Xid this boot: Xid 79 on GPU "
                                       "0001:00:00.0")
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.conf", pki.kubelet_client_current,
                                      pki.kubelet_client_current)
    api.node_readers = frozenset({f"system:node:{pki.node_name}"})
    listed = cli("nodes", "--kubeconfig", str(kubeconfig), "--json")
    assert listed.code == 1, listed.err
    [row] = json.loads(listed.out)["nodes"]
    assert row["gpu_ready"]["reason"] == "GPUFellOffBus"
    assert row["problem"].startswith("GPUReady=False (GPUFellOffBus): gpunode: watch: fatal Xid")


@integration
def test_an_event_the_api_server_refuses_for_its_namespace_is_one_error(
        registered: Host, api: FakeApiServer, cli: Cli) -> None:
    """A cluster without the default namespace answers the watch's Event with 404, as the
    real server does: one error naming it, exit 1, and the finding reported again later."""
    (registered.root / "dev/kmsg").write_text(
        "6,1,100,-;Linux version 6.6.95-flatcar\n"
        "4,2,5000000,-;NVRM: Xid (PCI:0001:00:00): 94, pid=9, name=a.out, Contained ECC error.\n")
    api.namespaces.discard("default")
    result = cli("--root", str(registered.root), "watch", "--once")
    assert_refused(result, 1, r"create an Event in namespace default: HTTP 404: namespaces "
                   r"\"default\" not found")
    assert not (registered.root / "run/gpunode/watch.json").exists()
    api.namespaces.add("default")
    assert cli("--root", str(registered.root), "watch", "--once").code == 0
    assert [e["reason"] for e in api.events] == ["GPUXid"]
    assert result.out == ""
