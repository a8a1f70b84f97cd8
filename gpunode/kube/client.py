"""The Kubernetes API boundary: GET/PATCH of one Node, and a paged LIST of Nodes.

No client library: gpunode needs four calls (GET a node, PATCH it, PATCH its status, and for
`gpunode nodes` LIST them), and http.client + ssl do them with the kubeconfig's client
certificate or bearer token (kube/kubeconfig.py reads it), where the official client takes
about a second to import and lightkube pulls in httpx. Credentials are never logged: only the
server URL and the paths of the files that hold them.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from gpunode import log
from gpunode.errors import ApiError, KubeconfigError, ReplyError
from gpunode.kube.kubeconfig import Kubeconfig, kind_of, read_kubeconfig
from gpunode.platform import records
from gpunode.platform.deadline import Connection, Deadline

__all__ = ["Kubeconfig", "NodeApi", "parse_node", "parse_node_list", "read_kubeconfig",
           "with_retries"]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"  # merges conditions by type


class NodeApi:
    """GET, PATCH and LIST of Node objects over one TLS connection per call."""

    def __init__(self, config: Kubeconfig, timeout: float = 10.0) -> None:
        self.config = config
        self.timeout = timeout
        url = urllib.parse.urlsplit(config.server)  # checked by read_kubeconfig
        self.host = url.hostname or ""
        self.port = url.port or 443
        self.base = url.path.rstrip("/")
        context = ssl.create_default_context()
        if config.ca_pem is not None:
            try:
                context.load_verify_locations(cadata=config.ca_pem.decode("ascii"))
            except (ssl.SSLError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
                raise KubeconfigError(config.path, f"{config.ca_source}: not a PEM "
                                      f"certificate ({exc})") from exc
        if config.client_pem is not None:
            _load_client(context, config)
        self.context = context
        self.calls: list[str] = []  # "GET path", "PATCH path": what was asked, for `status`

    def get_node(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/api/v1/nodes/{name}", None, None, f"get node {name}",
                             hint=_get_hint)

    def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("PATCH", f"/api/v1/nodes/{name}", body, MERGE_PATCH,
                             f"label node {name}")

    def patch_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("PATCH", f"/api/v1/nodes/{name}/status", body, STRATEGIC_PATCH,
                             f"set the GPUReady condition of node {name}")

    def list_nodes(self, selector: str, limit: int, token: str | None) -> dict[str, Any]:
        """One page of the Nodes `selector` matches: a NodeList whose items are checked as
        get_node checks a Node, and whose metadata.continue (if any) names the next page."""
        query = {"labelSelector": selector, "limit": str(limit)}
        if token:
            query["continue"] = token
        path = "/api/v1/nodes?" + urllib.parse.urlencode(query)
        return self._request("GET", path, None, None, "list nodes", parse_node_list,
                             _list_hint)
    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a core/v1 Event (`gpunode watch`); the reply is checked as an object."""
        return self._request("POST", f"/api/v1/namespaces/{namespace}/events", body,
                             "application/json", f"create an Event in namespace {namespace}")

    def _request(self, method: str, path: str, body: dict[str, Any] | None,
                 content_type: str | None, what: str,
                 parse: Callable[[bytes, str, str, str], dict[str, Any]] | None = None,
                 hint: Callable[[int], str] | None = None) -> dict[str, Any]:
        self.calls.append(f"{method} {path}")
        headers = {"Accept": "application/json", "User-Agent": "gpunode"}
        if self.config.token is not None:
            headers["Authorization"] = f"Bearer {self.config.token}"
        payload = None
        if body is not None and content_type is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        # One deadline for all of it (connect, TLS, request, the whole reply): a server that
        # drips its answer never trips a socket timeout (platform/deadline.py).
        with Deadline(self.timeout) as deadline:
            connection = Connection(self.host, self.port, timeout=self.timeout,
                                    deadline=deadline, context=self.context)
            try:
                connection.request(method, self.base + path, body=payload, headers=headers)
                response = connection.getresponse()
                data = response.read(MAX_REPLY + 1)
            except (OSError, http.client.HTTPException) as exc:
                if deadline.expired or isinstance(exc, TimeoutError):  # one limit, one message
                    raise ApiError(what, None, self._late()) from None
                raise ApiError(what, None, f"{self.config.server}: "
                               f"{exc or type(exc).__name__}") from exc
            finally:
                connection.close()
            if deadline.expired:  # the reply ended where the deadline shut the socket down
                raise ApiError(what, None, self._late())
        if 300 <= response.status < 400:  # a proxy or load balancer in front, most likely
            location = _terminal(response.getheader("Location") or "", 200)
            raise ApiError(what, response.status, f"a redirect to {location or 'nowhere'}, "
                           "which gpunode does not follow", "point the kubeconfig's server at "
                           "the API server itself (an API server never redirects these calls)")
        if response.status >= 400:
            raise ApiError(what, response.status, _status_message(data),
                           (hint or _hint)(response.status))
        url = self.config.server.rstrip("/") + path
        if len(data) > MAX_REPLY:
            raise ReplyError(what, url, f"is larger than {MAX_REPLY >> 20} MiB")
        return (parse or parse_node)(data, what, url,
                                     response.getheader("Content-Type") or "no content type")


    def _late(self) -> str:
        return (f"{self.config.server}: no whole answer within {self.timeout:g} s "
                "(kubernetes.request_timeout: the deadline of each call, connection and "
                "reply included)")


MAX_REPLY = 64 << 20  # bytes of one reply: a page of 500 Nodes is a few MiB
MAX_MESSAGE = 300  # characters of a server's error message shown (a 422 may embed a Node)


def parse_node_list(data: bytes, what: str, url: str, content_type: str = "") -> dict[str, Any]:
    """A NodeList page: items, each a Node as parse_node checks it, and metadata.continue a
    string when there is one."""
    page = _json(data, what, url, content_type)
    if not isinstance(page, dict):
        raise ReplyError(what, url, f"is {kind_of(page)}, not a NodeList")
    metadata = _field(page, "metadata", dict, what, url) or {}
    if not isinstance(metadata.get("continue", ""), str):
        raise ReplyError(what, url, f"has metadata.continue that is "
                         f"{kind_of(metadata['continue'])}, not a string")
    items = _field(page, "items", list, what, url, required=True)
    for index, item in enumerate(items):
        check_node(item, what, url, f"items[{index}]")
    return page


def parse_node(data: bytes, what: str, url: str, content_type: str = "") -> dict[str, Any]:
    """A Node object as gpunode reads it, every field it uses checked for its type: the
    metadata's labels and annotations are maps of strings, status.conditions a list of maps,
    status.allocatable a map. Anything else is a ReplyError naming the URL and the field."""
    return check_node(_json(data, what, url, content_type), what, url)


def _json(data: bytes, what: str, url: str, content_type: str) -> Any:
    snippet = data[:80].decode("utf-8", errors="replace")
    return records.loads_json(data, url, lambda _: ReplyError(
        what, url, f"is not JSON ({content_type}: {snippet!r})"))


def check_node(node: Any, what: str, url: str, where: str = "") -> dict[str, Any]:
    """`node` (the reply, or `where` in it: "items[3]") as parse_node says."""
    at = f"{where}." if where else ""
    if not isinstance(node, dict):
        raise ReplyError(what, url, f"has {where} that is {kind_of(node)}, not a Node object"
                         if where else f"is {kind_of(node)}, not a Node object")
    metadata = _field(node, "metadata", dict, what, url, required=True, prefix=at)
    for name in ("labels", "annotations"):
        values = _field(metadata, name, dict, what, url, prefix=f"{at}metadata.")
        bad = [k for k, v in (values or {}).items() if not isinstance(v, str)]
        if bad:
            raise ReplyError(what, url, f"has {at}metadata.{name}.{bad[0]} that is "
                             f"{kind_of(values[bad[0]])}, not a string")
    status = _field(node, "status", dict, what, url, prefix=at) or {}
    conditions = _field(status, "conditions", list, what, url, prefix=f"{at}status.") or []
    if not all(isinstance(c, dict) for c in conditions):
        raise ReplyError(what, url, f"has {at}status.conditions entries that are not objects")
    _field(status, "allocatable", dict, what, url, prefix=f"{at}status.")
    return node


def _field(table: dict[str, Any], name: str, kind: type, what: str, url: str,
           required: bool = False, prefix: str = "") -> Any:
    value = table.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind):
        want = "a map" if kind is dict else "a list"
        raise ReplyError(what, url, f"has {prefix}{name} that is {kind_of(value)}, not {want}")
    return value


def _load_client(context: ssl.SSLContext, config: Kubeconfig) -> None:
    """The client certificate and key, from memory: ssl only loads from a path, so they go to
    an anonymous memory file (never onto a disk, and already read through the Host)."""
    fd = os.memfd_create("gpunode-client-cert", os.MFD_CLOEXEC)
    try:
        os.write(fd, config.client_pem)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    except (OSError, ssl.SSLError) as exc:
        raise KubeconfigError(config.path, f"{config.client_source}: cannot load the client "
                              f"certificate and key ({exc})",
                              "the kubelet keeps them in one PEM file (kubelet-client-current."
                              "pem); check it holds a CERTIFICATE and its PRIVATE KEY") from exc
    finally:
        os.close(fd)


def _status_message(data: bytes) -> str:
    """The Status object's message (or the body's start), as a terminal can show it."""
    try:
        message = records.loads_json(data, "reply").get("message")
    except (ValueError, AttributeError):
        message = None
    text = message if isinstance(message, str) and message else \
        data[:MAX_MESSAGE * 4].decode(errors="replace")
    return _terminal(text, MAX_MESSAGE)


def _terminal(text: str, limit: int) -> str:
    """One line: control characters escaped, runs of white space one space, cut at `limit`
    characters saying how long it was (a 422 for a label embeds the whole Node: kilobytes)."""
    line = " ".join("".join(c if c.isprintable() or c.isspace() else repr(c)[1:-1]
                            for c in text).split())
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… ({len(line)} characters, cut)"


def _hint(status: int) -> str:
    if status == 403:
        return ("the API server's NodeRestriction admission refused it: a kubelet may only "
                "label its own Node, outside kubernetes.io/ and k8s.io/")
    if status == 401:
        return _UNAUTHORIZED
    return ""


# kubernetes.io/docs/reference/access-authn-authz/authentication/#x509-client-certificates:
# a certificate the API server's --client-ca-file did not sign is no identity (401).
_UNAUTHORIZED = ("the API server does not accept the kubelet's client certificate: is it "
                 "expired, or signed by another CA than the cluster's (a kubeconfig or "
                 "certificate of another cluster, or a cluster whose CA was rotated)?")


def _get_hint(status: int) -> str:
    # plugin/pkg/auth/authorizer/node/node_authorizer.go: with AuthorizeNodeWithSelectors (on
    # by default since 1.32) a node may get only its own Node; NodeRestriction is admission,
    # which a GET never reaches.
    if status == 403:
        return ("the API server's Node authorizer refused it: a kubelet may read only its own "
                "Node. Is this node's name right (kubernetes.node_name, else the kubelet's "
                "--hostname-override, else the hostname), as the kubelet registered it?")
    return _hint(status)


def _list_hint(status: int) -> str:
    # kubernetes.io/docs/reference/access-authn-authz/node/: "Kubelets are limited to reading
    # their own Node objects" (AuthorizeNodeWithSelectors, on by default since 1.32).
    if status == 403:
        return ("listing nodes needs RBAC: a ClusterRole that may get and list nodes, bound to "
                "this user or a group of it ('kubectl create clusterrole gpunode-nodes "
                "--verb=get,list --resource=nodes' and 'kubectl create clusterrolebinding "
                "gpunode-nodes --clusterrole=gpunode-nodes --user=NAME'); a kubelet's own "
                "credentials cannot list nodes (the Node authorizer lets a node read only its "
                "own Node)")
    if status == 401:
        return ("the API server does not accept this kubeconfig's credential: an expired "
                "certificate or token, or one of another cluster (a certificate signed by "
                "another CA than the cluster's)?")
    if status == 410:
        return ("the listing took longer than the API server keeps a continue token; run it "
                "again")
    return ""


def with_retries(call: Callable[[], dict[str, Any]], what: str, deadline: float,
                 sleep: Callable[[float], None] | None = None) -> dict[str, Any]:
    """`call()`, tried again with backoff (1 s, doubling, at most 10 s) while the error is
    retryable and `deadline` (monotonic seconds) has not passed."""
    delay = 1.0
    attempt = 1
    while True:
        try:
            return call()
        except ApiError as exc:
            if not exc.retryable or time.monotonic() + delay > deadline:
                raise
            log.get().info("kube.retry", what=what, attempt=attempt, status=exc.status,
                           error=exc.message, wait_s=delay)
        (sleep or time.sleep)(delay)
        delay = min(delay * 2, 10.0)
        attempt += 1
