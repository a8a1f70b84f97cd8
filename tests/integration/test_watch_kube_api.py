"""`gpunode watch --once` against the local TLS API server (gpunode_testing.kube_api) with the
kubelet's client certificate: an Xid 79 becomes one GPUReady PATCH, a non-fatal Xid one Event,
a rerun nothing, and NodeRestriction's refusal one error with its hint."""

from __future__ import annotations

import json

import pytest

from conftest import KUBE_NODE, HostFactory
from gpunode.platform.host import Host
from gpunode_testing.kube_api import FakeApiServer, join
from gpunode_testing.kube_objects import status_object
from gpunode_testing.pki import Pki
from hostile.support import Cli

T4 = "0001:00:00.0"  # the nc4as-t4-v3 fixture's GPU


@pytest.fixture
def node(make_host: HostFactory, api: FakeApiServer, pki: Pki) -> Host:
    host = make_host("nc4as-t4-v3", "ready")
    join(host.root, api, pki)
    (host.root / "dev/kmsg").write_text(
        "6,1,100,-;Linux version 6.6.95-flatcar\n"
        "4,2,5000000,-;NVRM: Xid (PCI:0001:00:00): 94, pid=9, name=a.out, Contained ECC error.\n"
        "4,3,6000000,-;NVRM: Xid (PCI:0001:00:00): 79, pid=1122, GPU has fallen off the bus.\n")
    return host


def test_xid_79_is_one_status_patch_and_the_non_fatal_xid_one_event(
        cli: Cli, node: Host, api: FakeApiServer) -> None:
    result = cli("--root", str(node.root), "watch", "--once")
    assert result.code == 0, result.err
    assert [(r.method, r.path, r.headers.get("content-type")) for r in api.requests] == [
        ("GET", f"/api/v1/nodes/{KUBE_NODE}", None),
        ("PATCH", f"/api/v1/nodes/{KUBE_NODE}/status", "application/strategic-merge-patch+json"),
        ("POST", "/api/v1/namespaces/default/events", "application/json")]
    assert {r.client_cn for r in api.requests} == {f"system:node:{KUBE_NODE}"}
    stored = api.node(KUBE_NODE)
    assert stored is not None
    ready = {c["type"]: c for c in stored["status"]["conditions"]}["GPUReady"]
    assert (ready["status"], ready["reason"]) == ("False", "GPUFellOffBus")
    assert T4 in ready["message"] and "GPU-" in ready["message"]
    [event] = api.events
    assert (event["type"], event["reason"], event["involvedObject"]["name"]) == \
        ("Warning", "GPUXid", KUBE_NODE)
    assert event["message"].startswith(f"gpunode watch: Xid 94 on GPU {T4} (GPU-")


def test_a_rerun_sends_nothing(cli: Cli, node: Host, api: FakeApiServer) -> None:
    assert cli("--root", str(node.root), "watch", "--once").code == 0
    sent = len(api.requests)
    assert cli("--root", str(node.root), "watch", "--once").code == 0
    assert len(api.requests) == sent


def test_a_refused_patch_is_one_error_with_the_hint_and_is_reported_again_later(
        cli: Cli, node: Host, api: FakeApiServer) -> None:
    api.queue_failures(f"/api/v1/nodes/{KUBE_NODE}/status", [
        (403, status_object(403, "Forbidden", "node is not allowed to modify status"), {})])
    result = cli("--root", str(node.root), "watch", "--once")
    assert result.code == 1
    errors = [json.loads(line) for line in result.err.splitlines()
              if json.loads(line)["level"] == "error"]
    assert len(errors) == 1 and "NodeRestriction" in errors[0]["hint"]
    assert not (node.root / "run/gpunode/watch.json").exists()
    assert cli("--root", str(node.root), "watch", "--once").code == 0
    assert [r.status for r in api.requests if r.method == "PATCH"] == [403, 200]
