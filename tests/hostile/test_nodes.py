"""Hostile inputs to `gpunode nodes`: the operator's kubeconfig (refused before any connection,
exit 2, naming the file and what is wrong) and the API server's replies (exit 1, one error
naming the URL, nothing on stdout), a server that hangs included."""

from __future__ import annotations

import base64
import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode_testing.kube_api import DROP, HANG, FakeApiServer
from gpunode_testing.pki import Pki, issue_client_cert
from hostile.support import Cli, check_refusal

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BASE: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Config", "current-context": "admin",
    "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443",
                                             "certificate-authority-data": b64(PEM)}}],
    "contexts": [{"name": "admin", "context": {"cluster": "k", "user": "u"}}],
    "users": [{"name": "u", "user": {"token": "abc"}}],
}


def with_user(**values: object) -> str:
    doc = copy.deepcopy(BASE)
    doc["users"][0]["user"] = values
    return yaml.safe_dump(doc)


def with_cluster(**values: object) -> str:
    doc = copy.deepcopy(BASE)
    doc["clusters"][0]["cluster"].update(values)
    return yaml.safe_dump(doc)


def replaced(**values: object) -> str:
    return yaml.safe_dump({**copy.deepcopy(BASE), **values})


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))

# kubeconfig text → the refusal (exit 2, before any connection)
KUBECONFIGS: dict[str, tuple[str, str]] = {
    "not-yaml": ("clusters: [\n", r"not valid YAML: while parsing .* line 2"),
    "a-list": ("- 1\n- 2\n", r"the document is a list, not a map"),
    "a-string": ("hello\n", r"the document is a string, not a map"),
    "empty": ("", r"the document is missing, not a map"),
    "no-current-context": (replaced(**{"current-context": ""}),
                           r"current-context is a string, not the name of a context.* "
                           r"--context NAME"),
    "current-context-a-number": (replaced(**{"current-context": 3}),
                                 r"current-context is a number, not the name"),
    "no-such-context": (replaced(**{"current-context": "prod"}),
                        r"current-context names context 'prod', which 'contexts' does not"),
    "contexts-a-map": (replaced(contexts={"admin": {}}), r"'contexts' is a map, not a list"),
    "no-users": (replaced(users=None), r"has no 'users' list"),
    "user-a-list": (replaced(users=[{"name": "u", "user": ["token"]}]),
                    r"user 'u': 'user' is a list, not a map"),
    "server-a-number": (with_cluster(server=6443), r"the cluster's server is a number"),
    "plain-http": (with_cluster(server="http://127.0.0.1:8080"), r"over https only"),
    "ca-data-not-base64": (with_cluster(**{"certificate-authority-data": "%%"}),
                           r"certificate-authority-data is not valid base64"),
    "insecure-skip-tls-verify": (with_cluster(**{"insecure-skip-tls-verify": True}),
                                 r"insecure-skip-tls-verify: gpunode always verifies"),
    "proxy-url": (with_cluster(**{"proxy-url": "http://proxy:3128"}),
                  r"sets proxy-url, which gpunode does not support"),
    "exec-plugin": (with_user(exec={"apiVersion": "client.authentication.k8s.io/v1",
                                    "command": "kubelogin", "args": ["get-token"]}),
                    r"from exec \(exec credential plugins\), which gpunode does not run.* "
                    r"client certificate or a token"),
    "auth-provider": (with_user(**{"auth-provider": {"name": "gcp"}}),
                      r"from auth-provider \(auth-provider plugins\)"),
    "basic-auth": (with_user(username="admin", password="secret"),
                   r"basic authentication was removed"),
    "no-credential": (with_user(), r"no client-certificate\(-data\) and no token or tokenFile"),
    "token-a-number": (with_user(token=12345), r"token is a number, not a string"),
    "token-with-newline": (with_user(token="abc\r\nX-Evil: 1"),
                           r"token is not a bearer token \(empty, or characters other than "
                           r"visible ASCII\)"),
    "token-file-missing": (with_user(tokenFile="/nope/token"),
                           r"tokenFile /nope/token cannot be read: No such file"),
    "cert-file-missing": (with_user(**{"client-certificate": "missing.crt"}),
                          r"client-certificate \S*/missing\.crt cannot be read"),
    "cert-data-not-pem": (with_user(**{"client-certificate-data": b64(b"hi")}),
                          r"client-certificate-data does not hold PEM"),
    "cert-and-key-not-a-pair": (yaml.safe_dump({**yaml.safe_load(with_user(**{
        "client-certificate-data": b64(PEM), "client-key-data": b64(PEM)})), "clusters": [
        {"name": "k", "cluster": {"server": "https://127.0.0.1:6443"}}]}),
        r"cannot load the client certificate and key"),
    "ca-not-a-certificate": (with_cluster(**{"certificate-authority-data": b64(
        b"-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n")}),
        r"not a PEM certificate"),
    "alias-bomb": (BOMB, r"line 2: uses the YAML alias \*a, which gpunode refuses"),
    "too-deep": ("a: " + "[" * 300 + "]" * 300 + "\n", r"nested too deeply|not valid"),
}


@pytest.mark.parametrize("case", list(KUBECONFIGS))
def test_a_broken_kubeconfig_is_refused_before_any_connection(
    tmp_path: Path, cli: Cli, case: str
) -> None:
    text, pattern = KUBECONFIGS[case]
    path = tmp_path / "config"
    path.write_text(text)
    result = check_refusal(cli, tmp_path, ["nodes", "--kubeconfig", str(path)], 2,
                           rf"{path}: .*{pattern}")
    assert result.out == ""


def test_a_fifo_for_a_kubeconfig_is_refused_without_blocking(tmp_path: Path, cli: Cli) -> None:
    os.mkfifo(tmp_path / "config")
    check_refusal(cli, tmp_path, ["nodes", "--kubeconfig", str(tmp_path / "config")], 2,
                  r"config: cannot be read: .*is a FIFO, not a regular file")


def test_a_huge_kubeconfig_is_refused_unread(tmp_path: Path, cli: Cli) -> None:
    with (tmp_path / "config").open("wb") as file:
        file.truncate(3 << 20)  # sparse: 3 MiB of NULs
    check_refusal(cli, tmp_path, ["nodes", "--kubeconfig", str(tmp_path / "config")], 2,
                  r"config: cannot be read: .*larger than")


@pytest.mark.parametrize(("env", "pattern"), [
    ("{d}/a:{d}/b", r"KUBECONFIG: lists 2 files, and gpunode reads one"),
    ("{d}/absent", r"absent: does not exist.* --kubeconfig FILE or KUBECONFIG"),
], ids=["two-files", "absent"])
def test_kubeconfig_from_the_environment_is_one_file_that_exists(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch, env: str, pattern: str
) -> None:
    monkeypatch.setenv("KUBECONFIG", env.format(d=tmp_path))
    check_refusal(cli, tmp_path, ["nodes"], 2, pattern)


def test_a_missing_context_named_on_the_command_line_is_refused(
    tmp_path: Path, cli: Cli
) -> None:
    (tmp_path / "config").write_text(yaml.safe_dump(BASE))
    check_refusal(cli, tmp_path, ["nodes", "--kubeconfig", str(tmp_path / "config"),
                                  "--context", "prod"], 2,
                  r"--context names context 'prod', which 'contexts' does not have")


# -- replies of a real TLS API server (gpunode_testing.kube_api) ------------------------------

integration = pytest.mark.integration
PAGE_WITH_NEXT = {"kind": "NodeList", "metadata": {"continue": "again"}, "items": []}

REPLIES: dict[str, tuple[list[Any], str]] = {
    "garbage": ([(200, "{\"items\": [")], r"is not JSON \(text/plain"),
    "html": ([(200, "<html>Sign in</html>")], r"is not JSON"),
    "a-list": ([(200, [])], r"is a list, not a NodeList"),
    "no-items": ([(200, {"kind": "NodeList"})], r"has items that is missing, not a list"),
    "items-a-map": ([(200, {"items": {}})], r"has items that is a map, not a list"),
    "item-a-string": ([(200, {"items": ["gpu-1"]})],
                      r"has items\[0\] that is a string, not a Node object"),
    "item-labels-a-list": ([(200, {"items": [{"metadata": {"labels": ["a"]}}]})],
                           r"has items\[0\]\.metadata\.labels that is a list, not a map"),
    "item-conditions-a-map": ([(200, {"items": [{"metadata": {}, "status": {
        "conditions": {}}}]})], r"has items\[0\]\.status\.conditions that is a map"),
    "continue-a-number": ([(200, {"metadata": {"continue": 5}, "items": []})],
                          r"has metadata\.continue that is a number, not a string"),
    "continue-forever": ([(200, PAGE_WITH_NEXT)] * 3,
                         r"repeats a continue token: the listing would never end"),
    "server-error": ([(500, {"kind": "Status", "message": "etcdserver: leader changed"})],
                     r"HTTP 500: etcdserver: leader changed"),
    "dropped": ([DROP], r"no answer: .*closed connection"),
}


@pytest.fixture
def admin_kubeconfig(pki: Pki, tmp_path: Path) -> Path:
    cert, key = issue_client_cert(pki, "admin-hostile", "/O=system:masters/CN=admin")
    doc = copy.deepcopy(BASE)
    doc["users"][0]["user"] = {"client-certificate": str(cert), "client-key": str(key)}
    doc["clusters"][0]["cluster"]["certificate-authority-data"] = b64(pki.ca_pem)
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))
    return path


def point(path: Path, api: FakeApiServer) -> None:
    doc = yaml.safe_load(path.read_text())
    doc["clusters"][0]["cluster"]["server"] = api.url
    path.write_text(yaml.safe_dump(doc))


@integration
@pytest.mark.parametrize("case", list(REPLIES))
def test_a_reply_of_the_wrong_shape_is_one_error_naming_the_url(
    api: FakeApiServer, admin_kubeconfig: Path, tmp_path: Path, cli: Cli, case: str
) -> None:
    answers, pattern = REPLIES[case]
    point(admin_kubeconfig, api)
    api.queue_failures("/api/v1/nodes", answers)
    result = check_refusal(cli, tmp_path, ["nodes", "--kubeconfig", str(admin_kubeconfig)],
                           1, rf"list nodes: .*{pattern}")
    assert result.out == ""


@integration
def test_a_server_that_hangs_is_given_up_after_the_request_timeout(
    api: FakeApiServer, admin_kubeconfig: Path, tmp_path: Path, cli: Cli
) -> None:
    point(admin_kubeconfig, api)
    config = tmp_path / "gpunode.toml"
    config.write_text("[kubernetes]\nrequest_timeout = 1\n")
    api.queue_failures("/api/v1/nodes", [HANG])
    result = check_refusal(cli, tmp_path, ["--config", str(config), "nodes", "--kubeconfig",
                                           str(admin_kubeconfig)], 1,
                           r"list nodes: no answer: .*no whole answer within 1 s")
    assert result.out == ""


@integration
def test_a_server_that_is_not_there_is_one_error(
    admin_kubeconfig: Path, tmp_path: Path, cli: Cli
) -> None:
    doc = yaml.safe_load(admin_kubeconfig.read_text())
    doc["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    admin_kubeconfig.write_text(yaml.safe_dump(doc))
    check_refusal(cli, tmp_path, ["nodes", "--kubeconfig", str(admin_kubeconfig)], 1,
                  r"list nodes: no answer: https://127\.0\.0\.1:1: .*refused")
