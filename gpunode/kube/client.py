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
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpunode import log
from gpunode.errors import GpunodeError
from gpunode.host import Host

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"  # merges conditions by type


class ApiError(GpunodeError):
    """The API answered with an error (or could not be reached)."""

    def __init__(self, what: str, status: int | None, message: str, hint: str = "") -> None:
        self.status = status
        self.message = message
        self.hint = hint
        code = "no answer" if status is None else f"HTTP {status}"
        super().__init__(f"Failed to {what}: {code}: {message}")

    @property
    def retryable(self) -> bool:
        """Worth trying again: unreachable, overloaded, or the Node not registered yet."""
        return self.status is None or self.status in (404, 409, 429) or self.status >= 500


class KubeconfigError(GpunodeError):
    def __init__(self, path: str, reason: str) -> None:
        self.hint = "point kubernetes.kubeconfig at the kubelet's kubeconfig"
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class Kubeconfig:
    server: str
    ca_pem: bytes | None  # None: the system trust store
    cert_file: str  # real paths
    key_file: str


def read_kubeconfig(host: Host, path: str) -> Kubeconfig:
    """The current context's server, CA and client certificate (files may be host paths)."""
    import yaml  # only `gpunode label` needs it

    shown = host.display(path)
    text = host.read_optional(path)
    if text is None:
        raise KubeconfigError(shown, "does not exist (has the kubelet joined the cluster?)")
    try:
        doc = yaml.safe_load(text)
        current = doc.get("current-context")
        context = _named(doc, "contexts", current)["context"]
        cluster = _named(doc, "clusters", context["cluster"])["cluster"]
        user = _named(doc, "users", context["user"])["user"]
        server = str(cluster["server"])
    except (yaml.YAMLError, AttributeError, KeyError, TypeError) as exc:
        raise KubeconfigError(shown, f"not a usable kubeconfig ({type(exc).__name__}: {exc})"
                              ) from exc
    ca: bytes | None = None
    if cluster.get("certificate-authority-data"):
        ca = base64.b64decode(cluster["certificate-authority-data"])
    elif cluster.get("certificate-authority"):
        ca = host.read_bytes(cluster["certificate-authority"])
    cert = user.get("client-certificate")
    key = user.get("client-key", cert)
    if not cert:
        raise KubeconfigError(shown, "the user has no client-certificate (gpunode uses the "
                              "kubelet's certificate, not tokens)")
    return Kubeconfig(server=server, ca_pem=ca, cert_file=str(host.path(cert)),
                      key_file=str(host.path(key)))


def _named(doc: dict[str, Any], kind: str, name: object) -> dict[str, Any]:
    for item in doc.get(kind) or []:
        if item.get("name") == name:
            return dict(item)
    raise KeyError(f"no {kind[:-1]} named {name!r}")


class NodeApi:
    """GET and PATCH of Node objects over one TLS connection per call."""

    def __init__(self, config: Kubeconfig, timeout: float = 10.0) -> None:
        self.config = config
        self.timeout = timeout
        url = urllib.parse.urlsplit(config.server)
        self.host = url.hostname or ""
        self.port = url.port or 443
        self.base = url.path.rstrip("/")
        context = ssl.create_default_context(cadata=config.ca_pem.decode()
                                             if config.ca_pem else None)
        try:
            context.load_cert_chain(config.cert_file, config.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise KubeconfigError(config.cert_file, f"cannot load the client certificate: "
                                  f"{exc}") from exc
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
        return dict(json.loads(data or b"{}"))


def _status_message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("message") or data[:200].decode(errors="replace"))
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
