"""A kubeconfig as gpunode reads it: the chosen context's server, CA and credential.

The kubelet's kubeconfig holds a client certificate; an operator's (`operator=True`, for
`gpunode nodes`) may hold a bearer token instead, and names its context. Exec and
auth-provider plugins are refused: gpunode runs no program to get a credential. Every value is
checked, every file read through the Host.
"""

from __future__ import annotations

import base64
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from gpunode.errors import HostError, KubeconfigError
from gpunode.platform import records
from gpunode.platform.host import Host


@dataclass(frozen=True)
class Kubeconfig:
    """One kubeconfig context, checked: the API server to ask and the credential to ask it with."""

    path: str  # as the user reads it, for messages
    server: str  # an https URL whose host and port parse
    ca_pem: bytes | None = field(repr=False)  # None: the system trust store
    ca_source: str
    client_pem: bytes | None = field(repr=False)  # certificate chain and key, PEM; or None
    client_source: str  # where they came from: file paths or "<key> in <kubeconfig>"
    token: str | None = field(default=None, repr=False)  # a bearer token (operator only)


KUBECONFIG_LIMIT = 2 << 20  # bytes: a kubeconfig of 300 clusters; parsed in about a second


def read_kubeconfig(host: Host, path: str, context: str | None = None,
                    operator: bool = False) -> Kubeconfig:
    """The server, CA and credential of `context` (None: the current-context), every value
    checked: the files it names are host paths (relative ones: to the kubeconfig's directory,
    as kubectl reads them), and read through the Host like every other file. `operator`: an
    operator's kubeconfig (a bearer token is fine, and messages speak to an operator), not the
    kubelet's."""
    shown = host.display(path)
    try:
        text = host.read_optional(path, limit=KUBECONFIG_LIMIT)
    except HostError as exc:
        raise KubeconfigError(shown, f"cannot be read: {exc.reason}",
                              "a kubeconfig is a regular file of at most 2 MiB; 'kubectl config "
                              "view --minify --flatten' writes one for the current context"
                              if operator else "") from exc
    if text is None:
        if operator:
            raise KubeconfigError(shown, "does not exist", "name the cluster's kubeconfig with "
                                  "--kubeconfig FILE or KUBECONFIG (default ~/.kube/config)")
        raise KubeconfigError(shown, "does not exist (has the kubelet joined the cluster?)",
                              "the kubelet's kubeconfig appears when the node joins ('kubeadm "
                              "join'); gpunode-label.service runs after the kubelet and is "
                              "restarted on failure. Else point kubernetes.kubeconfig at it")
    doc = _yaml(shown, text)
    if not isinstance(doc, dict):
        raise KubeconfigError(shown, f"not a kubeconfig: the document is {kind_of(doc)}, not a map")
    named_by = "--context" if context is not None else "current-context"
    if context is None:
        context = doc.get("current-context")
        # (a document without a 'contexts' list is no kubeconfig at all: _named says so)
        if (not isinstance(context, str) or not context) and "contexts" in doc:
            raise KubeconfigError(shown, f"current-context is {kind_of(context)}, not the name of "
                                  "a context", "choose one: 'kubectl config use-context NAME' "
                                  "or --context NAME" if operator else "")
    chosen = _named(shown, doc, "contexts", "context", context, named_by)
    cluster = _named(shown, doc, "clusters", "cluster", chosen.get("cluster"),
                     f"context {context!r}")
    user = _named(shown, doc, "users", "user", chosen.get("user"), f"context {context!r}")
    if cluster.get("insecure-skip-tls-verify") is True:
        raise KubeconfigError(shown, "the cluster says insecure-skip-tls-verify: gpunode always "
                              "verifies the API server's certificate",
                              "give the cluster's certificate-authority-data instead")
    for key in ("tls-server-name", "proxy-url"):
        if cluster.get(key):
            raise KubeconfigError(shown, f"the cluster sets {key}, which gpunode does not "
                                  "support", "use a kubeconfig whose server is reached directly")
    base = path.rpartition("/")[0] or "/"
    ca_pem, ca_source = None, "the system trust store"
    if cluster.get("certificate-authority-data"):
        ca_pem = _pem_data(shown, "certificate-authority-data", cluster)
        ca_source = f"certificate-authority-data in {shown}"
    elif cluster.get("certificate-authority"):
        ca_file = _file(shown, "certificate-authority", cluster, base)
        ca_pem, ca_source = _read(host, shown, "certificate-authority", ca_file, operator), \
            host.display(ca_file)
    return Kubeconfig(path=shown, server=_server(shown, cluster.get("server")), ca_pem=ca_pem,
                      ca_source=ca_source, **_client(host, shown, user, base, operator))


def _yaml(shown: str, text: str) -> Any:
    """The YAML document, with libyaml where it is there; aliases are refused (kubectl writes
    none, and a few lines of them expand into billions of nodes)."""
    import yaml  # only `label`, `status` and `nodes` need it

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent):
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise KubeconfigError(shown, f"line {line}: uses the YAML alias "
                                      f"*{event.anchor}, which gpunode refuses in a kubeconfig")
        doc = yaml.load(text, Loader=loader)  # a safe loader
    except yaml.YAMLError as exc:
        raise KubeconfigError(shown, f"not valid YAML: {' '.join(str(exc).split())}") from exc
    except RecursionError:
        raise KubeconfigError(shown, f"not valid for gpunode: {records.TOO_DEEP}") from None
    if records.too_deep(doc):
        raise KubeconfigError(shown, f"not valid for gpunode: {records.TOO_DEEP}")
    return doc


def _client(host: Host, shown: str, user: dict[str, Any], base: str,
            operator: bool) -> dict[str, Any]:
    """The user's certificate and key as one PEM blob (the kubelet keeps both in one file),
    and for an operator a bearer token (token or tokenFile) beside or instead of them."""
    for key, what in (("exec", "exec credential plugins"),
                      ("auth-provider", "auth-provider plugins")):
        if user.get(key):
            raise KubeconfigError(shown, f"the user gets its credential from {key} ({what}), "
                                  "which gpunode does not run", "use a kubeconfig whose user "
                                  "has a client certificate or a token (e.g. a ServiceAccount's "
                                  "from 'kubectl create token')")
    if user.get("username") or user.get("password"):
        raise KubeconfigError(shown, "the user has a username/password: basic authentication "
                              "was removed from Kubernetes in 1.19")
    token = _token(host, shown, user, base) if operator else None
    cert_file, pem, source = None, None, ""
    if user.get("client-certificate-data"):
        pem = _pem_data(shown, "client-certificate-data", user)
        source = f"client-certificate-data in {shown}"
    elif user.get("client-certificate"):
        cert_file = _file(shown, "client-certificate", user, base)
        pem = _read(host, shown, "client-certificate", cert_file, operator)
        source = host.display(cert_file)
    elif token is not None:
        return {"client_pem": None, "client_source": "a bearer token", "token": token}
    elif operator:
        raise KubeconfigError(shown, "the user has no client-certificate(-data) and no token "
                              "or tokenFile")
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
            pem += b"\n" + _read(host, shown, "client-key", key_file, operator)
            source += f" and {host.display(key_file)}"
    return {"client_pem": pem, "client_source": source, "token": token}


def _token(host: Host, shown: str, user: dict[str, Any], base: str) -> str | None:
    """token, or the first line of tokenFile: visible ASCII only (it goes into a header)."""
    if user.get("token"):
        value, where = user["token"], "token"
        if not isinstance(value, str):
            raise KubeconfigError(shown, f"token is {kind_of(value)}, not a string")
    elif user.get("tokenFile"):
        file = _file(shown, "tokenFile", user, base)
        value = _read(host, shown, "tokenFile", file, True).decode("ascii", "replace").strip()
        where = f"tokenFile {host.display(file)}"
    else:
        return None
    if not value or any(not 0x21 <= ord(c) <= 0x7E for c in value):
        raise KubeconfigError(shown, f"{where} is not a bearer token (empty, or characters "
                              "other than visible ASCII)")
    return value


def _read(host: Host, shown: str, key: str, file: str, operator: bool = False) -> bytes:
    try:
        return host.read_bytes(file, limit=KUBECONFIG_LIMIT)
    except HostError as exc:
        raise KubeconfigError(shown, f"{key} {host.display(file)} cannot be read: {exc.reason}",
                              "check the path in the kubeconfig" if operator else
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
        raise KubeconfigError(shown, f"'{kind}' is {kind_of(items)}, not a list")
    for item in items:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(inner)
            if not isinstance(value, dict):
                raise KubeconfigError(shown, f"{kind[:-1]} {name!r}: '{inner}' is "
                                      f"{kind_of(value)}, not a map")
            return value
    raise KubeconfigError(shown, f"{named_by} names {kind[:-1]} {name!r}, which '{kind}' does "
                          "not have")


def _pem_data(shown: str, key: str, table: dict[str, Any]) -> bytes:
    """A *-data value: base64 of PEM text."""
    value = table[key]
    if not isinstance(value, str):
        raise KubeconfigError(shown, f"{key} is {kind_of(value)}, not a base64 string")
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
        raise KubeconfigError(shown, f"{key} is {kind_of(value)}, not a path")
    return value if value.startswith("/") else f"{base.rstrip('/')}/{value}"


def _server(shown: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise KubeconfigError(shown, f"the cluster's server is {kind_of(value)}, not a URL")
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
        elif url.username is not None or url.password is not None:
            # Never logged or shown: basic authentication was removed in Kubernetes 1.19.
            problem = ("it holds a user or password, which gpunode never sends (basic "
                       "authentication was removed from Kubernetes in 1.19)")
        elif any(c.isspace() or not c.isprintable() or not c.isascii() for c in value):
            problem = ("it holds whitespace or control characters, or characters outside "
                       "ASCII (an international host is written in its xn-- form)")
    if problem:
        raise KubeconfigError(shown, f"server {masked(value)!r} is not a usable URL: {problem}")
    return value


def masked(url: str) -> str:
    """A URL as a message may show it: a user and password replaced by '***'."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" not in netloc:
        return url
    return f"{scheme}://***@{netloc.rpartition('@')[2]}{slash}{path}"


def _keys(doc: dict[Any, Any]) -> str:
    keys = [repr(k)[:40] for k in list(doc)[:5]]
    return f"key{'s' if len(keys) != 1 else ''} {', '.join(keys)}" if keys else "no keys"


def kind_of(value: object) -> str:
    if value is None:
        return "missing"
    return {dict: "a map", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)
