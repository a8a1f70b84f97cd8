"""The Kubernetes API boundary: the kubelet's kubeconfig, and GET/PATCH of one Node.

No client library: gpunode needs three calls (GET a node, PATCH it, PATCH its status), and
http.client + ssl do them with the kubelet's client certificate at no import cost, where the
official client takes about a second to import and lightkube pulls in httpx. Credentials are
never logged: only the server URL and the paths of the files that hold them.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpunode import log, records
from gpunode.errors import ApiError, HostError, KubeconfigError, ReplyError
from gpunode.host import Host

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"  # merges conditions by type


@dataclass(frozen=True)
class Kubeconfig:
    path: str  # as the user reads it, for messages
    server: str  # an https URL whose host and port parse
    ca_pem: bytes | None = field(repr=False)  # None: the system trust store
    ca_source: str
    client_pem: bytes = field(repr=False)  # certificate chain and key, PEM
    client_source: str  # where they came from: file paths or "<key> in <kubeconfig>"


def read_kubeconfig(host: Host, path: str) -> Kubeconfig:
    """The current context's server, CA and client certificate, every value checked: the
    files it names are host paths (relative ones: to the kubeconfig's directory, as kubectl
    reads them), and read through the Host like every other file."""
    import yaml  # only `gpunode label` and `status` need it

    shown = host.display(path)
    text = host.read_optional(path)
    if text is None:
        raise KubeconfigError(shown, "does not exist (has the kubelet joined the cluster?)",
                              "the kubelet's kubeconfig appears when the node joins ('kubeadm "
                              "join'); gpunode-label.service runs after the kubelet and is "
                              "restarted on failure. Else point kubernetes.kubeconfig at it")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KubeconfigError(shown, f"not valid YAML: {exc}") from exc
    except RecursionError:
        raise KubeconfigError(shown, f"not valid for gpunode: {records.TOO_DEEP}") from None
    if records.too_deep(doc):
        raise KubeconfigError(shown, f"not valid for gpunode: {records.TOO_DEEP}")
    if not isinstance(doc, dict):
        raise KubeconfigError(shown, f"not a kubeconfig: the document is {_kind(doc)}, not a map")
    current = doc.get("current-context")
    context = _named(shown, doc, "contexts", "context", current, "current-context")
    cluster = _named(shown, doc, "clusters", "cluster", context.get("cluster"),
                     f"context {current!r}")
    user = _named(shown, doc, "users", "user", context.get("user"), f"context {current!r}")
    base = path.rpartition("/")[0] or "/"
    ca_pem, ca_source = None, "the system trust store"
    if cluster.get("certificate-authority-data"):
        ca_pem = _pem_data(shown, "certificate-authority-data", cluster)
        ca_source = f"certificate-authority-data in {shown}"
    elif cluster.get("certificate-authority"):
        ca_file = _file(shown, "certificate-authority", cluster, base)
        ca_pem, ca_source = _read(host, shown, "certificate-authority", ca_file), \
            host.display(ca_file)
    return Kubeconfig(path=shown, server=_server(shown, cluster.get("server")), ca_pem=ca_pem,
                      ca_source=ca_source, **_client(host, shown, user, base))


def _client(host: Host, shown: str, user: dict[str, Any], base: str) -> dict[str, Any]:
    """The user's certificate and key as one PEM blob (the kubelet keeps both in one file)."""
    cert_file = None
    if user.get("client-certificate-data"):
        pem = _pem_data(shown, "client-certificate-data", user)
        source = f"client-certificate-data in {shown}"
    elif user.get("client-certificate"):
        cert_file = _file(shown, "client-certificate", user, base)
        pem = _read(host, shown, "client-certificate", cert_file)
        source = host.display(cert_file)
    else:
        raise KubeconfigError(shown, "the user has no client-certificate or "
                              "client-certificate-data (gpunode uses the kubelet's "
                              "certificate, not tokens)")
    if user.get("client-key-data"):
        pem += b"\n" + _pem_data(shown, "client-key-data", user)
        source += f" and client-key-data in {shown}"
    elif user.get("client-key"):
        key_file = _file(shown, "client-key", user, base)
        if key_file != cert_file:
            pem += b"\n" + _read(host, shown, "client-key", key_file)
            source += f" and {host.display(key_file)}"
    return {"client_pem": pem, "client_source": source}


def _read(host: Host, shown: str, key: str, file: str) -> bytes:
    try:
        return host.read_bytes(file)
    except HostError as exc:
        raise KubeconfigError(shown, f"{key} {host.display(file)} cannot be read: {exc.reason}",
                              "the kubelet writes its credentials when it joins and rotates "
                              "them in /var/lib/kubelet/pki; check the path in the "
                              "kubeconfig") from exc


def _named(shown: str, doc: dict[str, Any], kind: str, inner: str, name: object,
           named_by: str) -> dict[str, Any]:
    """doc[kind] is a list of {name, <inner>: {...}}: the <inner> map of the item called name."""
    items = doc.get(kind)
    if items is None:
        raise KubeconfigError(shown, f"has no '{kind}' list: not a kubeconfig (the document "
                              f"has {_keys(doc)})")
    if not isinstance(items, list):
        raise KubeconfigError(shown, f"'{kind}' is {_kind(items)}, not a list")
    for item in items:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(inner)
            if not isinstance(value, dict):
                raise KubeconfigError(shown, f"{kind[:-1]} {name!r}: '{inner}' is "
                                      f"{_kind(value)}, not a map")
            return value
    raise KubeconfigError(shown, f"{named_by} names {kind[:-1]} {name!r}, which '{kind}' does "
                          "not have")


def _pem_data(shown: str, key: str, table: dict[str, Any]) -> bytes:
    """A *-data value: base64 of PEM text."""
    value = table[key]
    if not isinstance(value, str):
        raise KubeconfigError(shown, f"{key} is {_kind(value)}, not a base64 string")
    try:
        data = base64.b64decode("".join(value.split()), validate=True)
    except ValueError as exc:
        raise KubeconfigError(shown, f"{key} is not valid base64 ({exc})") from exc
    if b"-----BEGIN " not in data:
        raise KubeconfigError(shown, f"{key} does not hold PEM (no '-----BEGIN' line once "
                              "base64-decoded)")
    return data


def _file(shown: str, key: str, table: dict[str, Any], base: str) -> str:
    value = table[key]
    if not isinstance(value, str):
        raise KubeconfigError(shown, f"{key} is {_kind(value)}, not a path")
    return value if value.startswith("/") else f"{base.rstrip('/')}/{value}"


def _server(shown: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise KubeconfigError(shown, f"the cluster's server is {_kind(value)}, not a URL")
    problem = None
    try:
        url = urllib.parse.urlsplit(value)
        url.port  # noqa: B018 -- parses it: 'abc' or 99999 raise ValueError here
    except ValueError as exc:
        problem = str(exc)
    else:
        if url.scheme != "https":
            problem = "gpunode talks to the API server over https only"
        elif not url.hostname:
            problem = "it names no host"
        elif any(c.isspace() or not c.isprintable() for c in value):
            problem = "it holds whitespace or control characters"
    if problem:
        raise KubeconfigError(shown, f"server {value!r} is not a usable URL: {problem}")
    return value


def _keys(doc: dict[Any, Any]) -> str:
    keys = [repr(k)[:40] for k in list(doc)[:5]]
    return f"key{'s' if len(keys) != 1 else ''} {', '.join(keys)}" if keys else "no keys"


def _kind(value: object) -> str:
    if value is None:
        return "missing"
    return {dict: "a map", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


class NodeApi:
    """GET and PATCH of Node objects over one TLS connection per call."""

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
        _load_client(context, config)
        self.context = context
        self.calls: list[str] = []  # "GET path", "PATCH path": what was asked, for `status`

    def get_node(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/api/v1/nodes/{name}", None, None, f"get node {name}")

    def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("PATCH", f"/api/v1/nodes/{name}", body, MERGE_PATCH,
                             f"label node {name}")

    def patch_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("PATCH", f"/api/v1/nodes/{name}/status", body, STRATEGIC_PATCH,
                             f"set the GPUReady condition of node {name}")

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a core/v1 Event (`gpunode watch`); the reply is checked as an object."""
        return self._request("POST", f"/api/v1/namespaces/{namespace}/events", body,
                             "application/json", f"create an Event in namespace {namespace}")

    def _request(self, method: str, path: str, body: dict[str, Any] | None,
                 content_type: str | None, what: str) -> dict[str, Any]:
        self.calls.append(f"{method} {path}")
        headers = {"Accept": "application/json", "User-Agent": "gpunode"}
        payload = None
        if body is not None and content_type is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        connection = http.client.HTTPSConnection(self.host, self.port, context=self.context,
                                                 timeout=self.timeout)
        try:
            connection.request(method, self.base + path, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ApiError(what, None, f"{self.config.server}: {exc}") from exc
        finally:
            connection.close()
        if response.status >= 400:
            raise ApiError(what, response.status, _status_message(data), _hint(response.status))
        return parse_node(data, what, self.config.server.rstrip("/") + path,
                          response.getheader("Content-Type") or "no content type")


def parse_node(data: bytes, what: str, url: str, content_type: str = "") -> dict[str, Any]:
    """A Node object as gpunode reads it, every field it uses checked for its type: the
    metadata's labels and annotations are maps of strings, status.conditions a list of maps,
    status.allocatable a map. Anything else is a ReplyError naming the URL and the field."""
    snippet = data[:80].decode("utf-8", errors="replace")
    node = records.loads_json(data, url, lambda _: ReplyError(
        what, url, f"is not JSON ({content_type}: {snippet!r})"))
    if not isinstance(node, dict):
        raise ReplyError(what, url, f"is {_kind(node)}, not a Node object")
    metadata = _field(node, "metadata", dict, what, url, required=True)
    for name in ("labels", "annotations"):
        values = _field(metadata, name, dict, what, url, prefix="metadata.")
        bad = [k for k, v in (values or {}).items() if not isinstance(v, str)]
        if bad:
            raise ReplyError(what, url, f"has metadata.{name}.{bad[0]} that is "
                             f"{_kind(values[bad[0]])}, not a string")
    status = _field(node, "status", dict, what, url) or {}
    conditions = _field(status, "conditions", list, what, url, prefix="status.") or []
    if not all(isinstance(c, dict) for c in conditions):
        raise ReplyError(what, url, "has status.conditions entries that are not objects")
    _field(status, "allocatable", dict, what, url, prefix="status.")
    return node


def _field(table: dict[str, Any], name: str, kind: type, what: str, url: str,
           required: bool = False, prefix: str = "") -> Any:
    value = table.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind):
        want = "a map" if kind is dict else "a list"
        raise ReplyError(what, url, f"has {prefix}{name} that is {_kind(value)}, not {want}")
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
    try:
        return str(records.loads_json(data, "reply").get("message")
                   or data[:200].decode(errors="replace"))
    except (ValueError, AttributeError):
        return data[:200].decode(errors="replace")


def _hint(status: int) -> str:
    if status == 403:
        return ("the API server's NodeRestriction admission refused it: a kubelet may only "
                "label its own Node, outside kubernetes.io/ and k8s.io/")
    if status == 401:
        return "the kubelet's client certificate is not accepted: is it expired?"
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
