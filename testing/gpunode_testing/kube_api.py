"""A stand-in for the Kubernetes API server's Node endpoints, over mutual TLS, for tests.

    pki = make_pki(tmp_path)                       # openssl: CA, server, kubelet client cert
    with FakeApiServer(pki) as api:                # holds make_node(pki.node_name)
        api.write_kubeconfig(tmp_path / "kubelet.conf", pki.kubelet_client_current,
                             pki.kubelet_client_current)
        ...                                        # the code under test labels its Node
        assert api.node("gpu-node-1")["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"

What it serves, as kube-apiserver does: GET /api/v1/nodes/NAME, PATCH /api/v1/nodes/NAME and
PATCH /api/v1/nodes/NAME/status with JSON merge patch (RFC 7386) or strategic merge patch (lists
merge by key where core/v1 says so: status.conditions and status.addresses by `type`). The client
is who its certificate says (CN user, O groups); the rules, from the Kubernetes sources:

  * Node authorizer (plugin/pkg/auth/authorizer/node/node_authorizer.go, AuthorizeNodeWithSelectors
    on by default since 1.32): a node reads only its own Node; patches pass to NodeRestriction.
  * NodeRestriction admission (plugin/pkg/admission/noderestriction/admission.go): a node modifies
    only its own Node, never spec.taints, and no kubernetes.io / k8s.io labels outside the kubelet
    allow-list (k8s.io/kubelet/pkg/apis/well_known_labels.go) nor node-restriction.kubernetes.io
    ones. It is a mutating plugin, so it sees the patched object before the strategy below.
  * Node strategies (pkg/registry/core/node/strategy.go): a patch of the node keeps the old
    status; a patch of /status keeps the old spec (metadata, labels included, may change there).
  * Validation: label keys and values as apimachinery checks them (422); a no-op patch leaves
    resourceVersion alone; metadata.resourceVersion / uid in a patch are preconditions (409).
  * Users in system:masters may do anything; users or groups named in `node_readers` may get
    and list nodes (a ClusterRole with those verbs bound to them); other users get RBAC's 403.
  * Authentication: a client certificate, else a bearer token from `tokens` (an unknown one:
    401), else the anonymous user (system:anonymous, whom RBAC then refuses: 403). A client
    certificate of another CA is 401, as the real x509 authenticator answers: the TLS layer
    trusts `foreign_cas` (default: the PKI's untrusted CA) beside the cluster's, so that the
    handshake completes (Python's ssl verifies any certificate it asks for).
  * TaintNodesByCondition: a Node created without Ready=True is tainted not-ready. Events:
    404 in a namespace not in `namespaces`, 422 for an involvedObject.namespace that does not
    fit. A patched Node that does not decode is 422 quoting it whole (kube_objects says how).
  * LIST /api/v1/nodes with labelSelector (equality-based: `k`, `!k`, `k=v`, `k==v`, `k!=v`,
    comma-separated; set-based ones are 400 here), limit and continue (apimachinery's chunked
    lists: items in name order, metadata.continue until the last page, remainingItemCount only
    without a selector; a token from before compact() is 410 Expired).

Not modelled: watches, the list's snapshot, PUT, DELETE and POST but of Events (405), JSON and
apply patch (415), managed fields, $setElementOrder (ignored), strategic-merge directives but
`$patch: delete` in keyed lists (400), strategic merge of metadata.finalizers / ownerReferences
(replaced). Harness bugs are answered 500 and fail __exit__ (FakeApiServer.errors).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import http.server
import json
import re
import shutil
import socket
import ssl
import threading
import time
import traceback
import urllib.parse
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpunode_testing.kube_objects import (
    Refused,
    User,
    admit_node,
    authorize,
    bad_request,
    check_decodes,
    label_errors,
    list_page,
    make_node,
    merge_patch,
    record_event,
    status_object,
    strategic_merge_patch,
    taint_not_ready,
)
from gpunode_testing.pki import Pki, ca_subject

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
DROP = "drop-connection"  # queue_failures status: close the connection without an answer
HANG = "hang"  # queue_failures status: read the request, then answer nothing until shutdown
TIMEOUT = 5.0  # seconds for any socket operation of the server


# --- The server ------------------------------------------------------------------------------

@dataclass
class Request:
    method: str
    path: str  # without the query string
    query: str
    headers: dict[str, str]  # keys lower-cased
    body: bytes
    json: Any  # the parsed body, or None
    client_cn: str | None
    client_groups: tuple[str, ...] = ()
    status: int | None = None  # the answer's status; None: connection dropped
    injected: bool = False  # answered from queue_failures


class FakeApiServer:
    """kube-apiserver's Node endpoints on https://127.0.0.1:<ephemeral port>, client certs only."""

    def __init__(self, pki: Pki, nodes: Iterable[dict[str, Any]] | None = None,
                 tokens: dict[str, tuple[str, tuple[str, ...]]] | None = None,
                 node_readers: Iterable[str] = (),
                 foreign_cas: Iterable[Path] | None = None) -> None:
        self.pki = pki
        self.namespaces = {"default", "kube-system", "kube-public", "kube-node-lease"}
        self.tokens = dict(tokens or {})  # bearer token → (user, groups)
        self.node_readers = frozenset(node_readers)
        self._epoch = 0  # continue tokens of an older epoch are expired (compact())
        self.requests: list[Request] = []
        self.handshake_errors: list[str] = []  # client certificates refused, connections dropped
        self.errors: list[str] = []  # the harness's own bugs (answered 500); fail __exit__
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []  # Events created (gpunode watch), in order
        self._revision = 1000
        self._failures: list[tuple[str, deque[tuple[Any, Any, dict[str, str]]]]] = []
        for node in [make_node(pki.node_name)] if nodes is None else nodes:
            self.set_node(node)
        self._ca_subject = ca_subject(pki.ca_cert)
        self._server = _TlsServer(self, pki.server_context(
            [pki.untrusted_ca_cert] if foreign_cas is None else foreign_cas))
        self.port: int = self._server.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._thread.join(TIMEOUT)
        if self.errors and kind is None:
            raise AssertionError("FakeApiServer failed internally:\n" + "\n".join(self.errors))

    # -- state for tests

    def set_node(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a Node (as an admin would); gives it a uid if it has none, and a new
        resourceVersion. A new Node without Ready=True gets the not-ready taint
        (TaintNodesByCondition). Returns the stored copy."""
        node = copy.deepcopy(obj)
        meta = node.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with self._lock:
            if meta.get("name") not in self._nodes:
                taint_not_ready(node)
            self._store(node)
            return copy.deepcopy(node)

    def delete_node(self, name: str) -> None:
        with self._lock:
            self._nodes.pop(name, None)

    def compact(self) -> None:
        """What etcd compaction does to a chunked list: continue tokens issued so far expire."""
        with self._lock:
            self._epoch += 1

    def node(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return copy.deepcopy(self._nodes.get(name))

    def queue_failures(self, path_prefix: str, responses: Iterable[Any]) -> None:
        """The next requests whose path starts with `path_prefix` get these answers, in order,
        before normal handling: (status, JSON body or None) or (status, body, headers); status
        DROP closes the connection without an answer."""
        queue = deque()
        for response in responses:
            status, body, *rest = (response, None) if response in (DROP, HANG) else response
            queue.append((status, body, rest[0] if rest else {}))
        with self._lock:
            self._failures.append((path_prefix, queue))

    def write_kubeconfig(self, path: Path, client_cert_path: str | Path,
                         client_key_path: str | Path, embed_ca: bool = True,
                         ca_path: str | Path | None = None) -> Path:
        """A kubeadm kubelet.conf for this server; the paths are written as given."""
        if embed_ca:
            ca = f"certificate-authority-data: {base64.b64encode(self.pki.ca_pem).decode()}"
        else:
            ca = f"certificate-authority: {json.dumps(str(ca_path or self.pki.ca_cert))}"
        user = f"system:node:{self.pki.node_name}"
        path.write_text(
            f"apiVersion: v1\nclusters:\n- cluster:\n    {ca}\n    server: {self.url}\n"
            f"  name: kubernetes\ncontexts:\n- context:\n    cluster: kubernetes\n"
            f"    user: {user}\n  name: {user}@kubernetes\n"
            f"current-context: {user}@kubernetes\nkind: Config\npreferences: {{}}\n"
            f"users:\n- name: {user}\n  user:\n"
            f"    client-certificate: {json.dumps(str(client_cert_path))}\n"
            f"    client-key: {json.dumps(str(client_key_path))}\n")
        return path

    # -- request handling (handler threads)

    def _store(self, node: dict[str, Any]) -> None:
        self._revision += 1
        node["metadata"]["resourceVersion"] = str(self._revision)
        self._nodes[node["metadata"]["name"]] = node

    def _next_failure(self, path: str) -> tuple[Any, Any, dict[str, str]] | None:
        with self._lock:
            for prefix, queue in self._failures:
                if queue and path.startswith(prefix):
                    return queue.popleft()
        return None

    def _handle(self, method: str, path: str, content_type: str, body: bytes,
                user: User, query: str = "") -> tuple[int, dict[str, Any] | str]:
        if method == "POST" and re.fullmatch(r"/api/v1/namespaces/[^/]+/events", path):
            return record_event(self.events, self._lock, user, path, content_type, body,
                                self.namespaces)
        match = re.fullmatch(r"/api/v1/nodes(?:/([^/]+)(/status)?)?", path)
        if not match:
            return 404, "404 page not found\n"
        name, subresource = match[1], "status" if match[2] else ""
        resource = "nodes/status" if subresource else "nodes"
        verb = {"GET": "get" if name else "list"}.get(method, method.lower())
        if method not in ("GET", "PATCH") or (method == "PATCH" and not name):
            return 405, status_object(405, "MethodNotAllowed", "the server does not allow this "
                                      "method on the requested resource (fake API server: "
                                      "GET and PATCH of nodes only)")
        admin = "system:masters" in user.groups
        reader = verb in ("get", "list") and resource == "nodes" and bool(
            self.node_readers & {user.name, *user.groups})
        if not admin and not reader:
            authorize(user.name, user.node, verb, name, resource)
        if verb == "list":
            with self._lock:
                return 200, list_page(self._nodes, urllib.parse.parse_qs(query),
                                      self._revision, self._epoch)
        with self._lock:
            old = self._nodes.get(name)
            if old is None:
                raise Refused(404, status_object(404, "NotFound", f'nodes "{name}" not found',
                                                  name, "nodes"))
            if method == "GET":
                return 200, copy.deepcopy(old)
            new = self._patched(old, content_type, body, name)
            if user.node is not None and not admin:
                admit_node(user.node, name, new, old)
            if subresource:
                new["spec"] = copy.deepcopy(old.get("spec", {}))
            else:
                new["status"] = copy.deepcopy(old.get("status", {}))
            errors = label_errors(new["metadata"].get("labels") or {})
            if errors:
                message = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
                raise Refused(422, status_object(422, "Invalid", f'Node "{name}" is invalid: '
                                                  f"{message}", name, kind="Node"))
            if new != old:
                self._store(new)
            return 200, copy.deepcopy(self._nodes[name])

    def _patched(self, old: dict[str, Any], content_type: str, body: bytes,
                 name: str) -> dict[str, Any]:
        if content_type not in (MERGE_PATCH, STRATEGIC_PATCH):
            raise Refused(415, status_object(
                415, "UnsupportedMediaType", "the body of the request was in an unknown format "
                f"- accepted media types include: {MERGE_PATCH}, {STRATEGIC_PATCH} (fake API "
                "server; the real one also takes json-patch and apply-patch)"))
        try:
            patch = json.loads(body)
        except ValueError as exc:
            raise bad_request(f"error decoding patch: {exc}") from exc
        if not isinstance(patch, dict):
            raise bad_request("error decoding patch: the patch is not a JSON object")
        apply = merge_patch if content_type == MERGE_PATCH else strategic_merge_patch
        new = apply(old, patch)
        meta, old_meta = new.get("metadata"), old["metadata"]
        if not isinstance(meta, dict):
            raise bad_request("fake API server: the patch removes metadata")
        wanted = (patch.get("metadata") or {}) if isinstance(patch.get("metadata"), dict) else {}
        if wanted.get("resourceVersion") not in (None, old_meta["resourceVersion"]):
            raise Refused(409, status_object(
                409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": the object '
                "has been modified; please apply your changes to the latest version and try "
                "again", name, "nodes"))
        if wanted.get("uid") not in (None, old_meta["uid"]):
            raise Refused(409, status_object(
                409, "Conflict", f"Precondition failed: UID in precondition: {wanted['uid']}, "
                f"UID in object meta: {old_meta['uid']}", name, "nodes"))
        if meta.get("name") != name:
            raise bad_request(f"the name of the object ({meta.get('name')}) does not match the "
                               f"name on the URL ({name})")
        for key in ("uid", "resourceVersion", "creationTimestamp"):
            meta[key] = old_meta[key]
        new["kind"], new["apiVersion"] = old.get("kind", "Node"), old.get("apiVersion", "v1")
        check_decodes(new, content_type == MERGE_PATCH)
        return new

class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = TIMEOUT
    disable_nagle_algorithm = True  # headers and body go out as two TLS records
    server: _TlsServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve()

    do_PATCH = do_PUT = do_POST = do_DELETE = do_GET

    def _serve(self) -> None:
        api = self.server.api
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        url = urllib.parse.urlsplit(self.path)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        cn, groups = None, []
        peer = self.connection.getpeercert() or {}
        for rdn in peer.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    cn = value
                elif key == "organizationName":
                    groups.append(value)
        authorization = self.headers.get("Authorization") or ""
        unauthorized = False
        if cn is not None and tuple(peer.get("issuer", ())) != api._ca_subject:
            cn, groups, unauthorized = None, [], True  # x509: signed by unknown authority
        elif cn is None and authorization.startswith("Bearer "):
            known = api.tokens.get(authorization.removeprefix("Bearer "))
            if known is None:
                unauthorized = True
            else:
                cn, groups = known[0], list(known[1])
        elif cn is None:
            cn, groups = "system:anonymous", ["system:unauthenticated"]
        record = Request(self.command, url.path, url.query,
                         {k.lower(): v for k, v in self.headers.items()}, body, parsed, cn,
                         tuple(groups))
        with api._lock:
            api.requests.append(record)
        failure = api._next_failure(url.path)
        if failure is None and unauthorized:
            failure = (401, status_object(401, "Unauthorized", "Unauthorized"), {})
        if failure is not None:
            record.injected = True
            status, answer, headers = failure
            if status == DROP:
                self.close_connection = True
                return
            if status == HANG:  # until the server shuts down, answering nothing
                api._closed.wait(TIMEOUT * 4)
                self.close_connection = True
                return
        else:
            headers = {}
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            try:
                status, answer = api._handle(self.command, url.path, content_type.lower(), body,
                                             User(cn or "", tuple(groups)), url.query)
            except Refused as refusal:
                status, answer = refusal.code, refusal.body
            except Exception:
                api.errors.append(traceback.format_exc())
                status, answer = 500, status_object(500, "InternalError", "fake API server bug")
        record.status = status
        self._send(status, answer, headers)

    def _send(self, status: int, answer: Any, headers: dict[str, str]) -> None:
        if answer is None:
            data, kind = b"", "application/json"
        elif isinstance(answer, (bytes, str)):
            data = answer.encode() if isinstance(answer, str) else answer
            kind = "text/plain; charset=utf-8"
        else:
            data, kind = json.dumps(answer).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)


class _TlsServer(http.server.ThreadingHTTPServer):
    """TLS handshakes in the connection's thread (a stuck client cannot block accept())."""

    daemon_threads = False
    block_on_close = True  # server_close() joins the connection threads

    def __init__(self, api: FakeApiServer, context: ssl.SSLContext) -> None:
        self.api = api
        self.context = context
        self.connections: set[ssl.SSLSocket] = set()
        self.connections_lock = threading.Lock()
        self.closing = False
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        request.settimeout(TIMEOUT)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except OSError as exc:
            self.api.handshake_errors.append(f"{type(exc).__name__}: {exc}")
            request.close()
            return
        with self.connections_lock:
            self.connections.add(tls)
        try:
            self.finish_request(tls, client_address)
        except OSError as exc:
            if not self.closing:
                self.api.handshake_errors.append(f"{type(exc).__name__}: {exc}")
        except Exception:
            self.api.errors.append(traceback.format_exc())
        finally:
            with self.connections_lock:
                self.connections.discard(tls)
            self.shutdown_request(tls)

    def close_connections(self) -> None:
        """Wake handler threads blocked reading a kept-alive connection."""
        self.closing = True
        with self.connections_lock:
            for connection in list(self.connections):
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)


# Where a kubeadm-joined kubelet keeps its kubeconfig and rotated client credential.
KUBELET_KUBECONFIG = "/etc/kubernetes/kubelet.conf"
KUBELET_CLIENT = "/var/lib/kubelet/pki/kubelet-client-current.pem"


def join(root: Path, api: FakeApiServer, pki: Pki) -> None:
    """Make the fixture tree at `root` a node whose kubelet joined `api`: its kubeconfig and
    its client credential, as kubeadm leaves them."""
    client = root / KUBELET_CLIENT.lstrip("/")
    client.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(pki.kubelet_client_current, client)
    kubeconfig = root / KUBELET_KUBECONFIG.lstrip("/")
    kubeconfig.parent.mkdir(parents=True, exist_ok=True)
    api.write_kubeconfig(kubeconfig, Path(KUBELET_CLIENT), Path(KUBELET_CLIENT))
