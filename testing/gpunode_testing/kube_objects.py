"""What the test API server (gpunode_testing.kube_api) knows of Kubernetes objects and rules:
a Node as a kubeadm worker shows it, Status objects, JSON merge and strategic merge patches, the
labels a kubelet may set (NodeRestriction) and label validation. The sources each rule follows
are named in kube_api's docstring."""

from __future__ import annotations

import base64
import copy
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

# k8s.io/kubelet/pkg/apis/well_known_labels.go: labels a kubelet may set on its own Node.
KUBELET_LABELS = frozenset({
    "kubernetes.io/hostname", "topology.kubernetes.io/zone", "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/region",
    "beta.kubernetes.io/instance-type", "node.kubernetes.io/instance-type",
    "kubernetes.io/os", "kubernetes.io/arch", "beta.kubernetes.io/os", "beta.kubernetes.io/arch",
})
KUBELET_LABEL_NAMESPACES = ("kubelet.kubernetes.io", "node.kubernetes.io")
_MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type"}


def make_node(name: str, *, gpus: int = 0, labels: dict[str, str] | None = None,
              taints: list[dict[str, Any]] | None = None, ready: bool = True) -> dict[str, Any]:
    """A Node as a kubeadm cluster shows a freshly joined worker (containerd, amd64)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    resources = {"cpu": "8", "memory": "57629892Ki", "pods": "110", "hugepages-1Gi": "0",
                 "hugepages-2Mi": "0", "ephemeral-storage": "129886128Ki"}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {"type": kind, "status": status, "lastHeartbeatTime": now,
                "lastTransitionTime": now, "reason": reason, "message": message}

    if taints is None and not ready:
        taints = [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]
    spec: dict[str, Any] = {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]}
    if taints:
        spec["taints"] = taints
    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {
            "name": name, "uid": str(uuid.uuid4()), "resourceVersion": "0",
            "creationTimestamp": now,
            "labels": {"beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name,
                       "kubernetes.io/os": "linux", **(labels or {})},
            "annotations": {
                "kubeadm.alpha.kubernetes.io/cri-socket":
                    "unix:///var/run/containerd/containerd.sock",
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true"},
        },
        "spec": spec,
        "status": {
            "capacity": resources, "allocatable": dict(resources),
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory",
                          "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure",
                          "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID",
                          "kubelet has sufficient PID available"),
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status")
                if ready else condition("Ready", "False", "KubeletNotReady",
                                        "container runtime network not ready"),
            ],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.4"},
                          {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux",
                         "containerRuntimeVersion": "containerd://1.7.20",
                         "kubeletVersion": "v1.31.2", "kubeProxyVersion": "v1.31.2",
                         "osImage": "Flatcar Container Linux by Kinvolk 3975.2.2 (Oklo)"},
        },
    }


@dataclass(frozen=True)
class User:
    """Who a request is: its certificate's CN and O, a token's user, or the anonymous one."""

    name: str
    groups: tuple[str, ...]

    @property
    def node(self) -> str | None:  # pkg/auth/nodeidentifier
        if "system:nodes" in self.groups and self.name.startswith("system:node:"):
            return self.name.removeprefix("system:node:")
        return None


# --- Patches, rules, Status objects ----------------------------------------------------------

class Refused(Exception):
    def __init__(self, code: int, body: dict[str, Any] | str) -> None:
        self.code, self.body = code, body


def status_object(code: int, reason: str, message: str, name: str | None = None,
                  kind: str | None = None) -> dict[str, Any]:
    """A metav1.Status as the API server answers errors."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "message": message, "reason": reason}
    details = {key: value for key, value in (("name", name), ("kind", kind)) if value}
    if details:
        body["details"] = details
    body["code"] = code
    return body


def forbidden(name: str | None, why: str) -> Refused:
    subject = f'nodes "{name}"' if name else "nodes"
    return Refused(403, status_object(403, "Forbidden", f"{subject} is forbidden: {why}", name,
                                       "nodes"))


def bad_request(message: str) -> Refused:
    return Refused(400, status_object(400, "BadRequest", message))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (returns a new value; `target` is not changed)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Strategic merge patch for Node: maps merge, lists of _MERGE_KEYS merge by key (an item
    with "$patch": "delete" removes its match), other lists are replaced."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$"):
            raise bad_request(f"fake API server: strategic merge directive {key} not supported")
        here = (*path, key)
        if value is None:
            out.pop(key, None)
        elif here in _MERGE_KEYS and isinstance(value, list):
            out[key] = _merge_list(out.get(key) or [], value, _MERGE_KEYS[here], here)
        else:
            out[key] = strategic_merge_patch(out.get(key), value, here)
    return out


def _merge_list(items: list[Any], patch: list[Any], merge_key: str,
                path: tuple[str, ...]) -> list[Any]:
    out = list(items)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise bad_request(f"{'.'.join(path)}: item {item!r} lacks merge key {merge_key!r}")
        where = [i for i, old in enumerate(out) if old.get(merge_key) == item[merge_key]]
        directive = item.get("$patch")
        if directive == "delete":
            out = [old for old in out if old.get(merge_key) != item[merge_key]]
        elif directive is not None:
            raise bad_request(f"fake API server: $patch: {directive} not supported in lists")
        elif where:
            out[where[0]] = strategic_merge_patch(out[where[0]], item, path)
        else:
            out.append(strategic_merge_patch({}, item, path))
    return out


def _namespace(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def _in(namespace: str, domain: str) -> bool:
    return namespace == domain or namespace.endswith("." + domain)


def forbidden_labels(new: dict[str, str], old: dict[str, str]) -> list[str]:
    """NodeRestriction's getForbiddenLabels(getModifiedLabels(new, old)), sorted."""
    modified = {k for k in new.keys() | old.keys() if new.get(k) != old.get(k)}
    forbidden = set()
    for key in modified:
        namespace = _namespace(key)
        kubelet_label = key in KUBELET_LABELS or any(
            _in(namespace, allowed) for allowed in KUBELET_LABEL_NAMESPACES)
        if _in(namespace, "node-restriction.kubernetes.io") or (
                (_in(namespace, "kubernetes.io") or _in(namespace, "k8s.io"))
                and not kubelet_label):
            forbidden.add(key)
    return sorted(forbidden)


_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_VALUE_FMT = f"({_NAME_FMT})?"
_DNS1123_FMT = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_ALNUM = ("consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
          "alphanumeric character")
_NAME_MSG = (f"must {_ALNUM} (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for "
             f"validation is '{_NAME_FMT}')")
_VALUE_MSG = (f"a valid label must be an empty string or {_ALNUM} (e.g. 'MyValue',  or "
              f"'my_value',  or '12345', regex used for validation is '{_VALUE_FMT}')")
_PREFIX_MSG = (f"a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
               f"characters, '-' or '.', and must start and end with an alphanumeric character "
               f"(e.g. 'example.com', regex used for validation is '{_DNS1123_FMT}')")


def _key_problems(key: str) -> list[str]:
    """apimachinery's IsQualifiedName."""
    parts = key.split("/")
    if len(parts) > 2:
        return [f"a qualified name {_NAME_MSG} with an optional DNS subdomain prefix and '/' "
                "(e.g. 'example.com/MyName')"]
    problems = []
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            problems.append("prefix part must be non-empty")
        elif len(prefix) > 253:
            problems.append("prefix part must be no more than 253 characters")
        elif not re.fullmatch(_DNS1123_FMT, prefix):
            problems.append(f"prefix part {_PREFIX_MSG}")
    name = parts[-1]
    if not name:
        problems.append("name part must be non-empty")
    elif len(name) > 63:
        problems.append("name part must be no more than 63 characters")
    elif not re.fullmatch(_NAME_FMT, name):
        problems.append(f"name part {_NAME_MSG}")
    return problems


def label_errors(labels: dict[str, str]) -> list[str]:
    """apimachinery's ValidateLabels, as field errors of metadata.labels."""
    errors = []
    for key, value in sorted(labels.items()):
        errors += [f'metadata.labels: Invalid value: "{key}": {p}' for p in _key_problems(key)]
        if len(value) > 63:
            errors.append(f'metadata.labels: Invalid value: "{value}": '
                          "must be no more than 63 characters")
        if not re.fullmatch(_VALUE_FMT, value):
            errors.append(f'metadata.labels: Invalid value: "{value}": {_VALUE_MSG}')
    return errors


def string_map_problem(meta: dict[str, Any], field_name: str) -> str | None:
    """Why metadata.<field_name> does not decode into a map of strings (as Go's json says
    it), or None."""
    values = meta.get(field_name)
    if values is None:
        return None
    if not isinstance(values, dict):
        return (f"json: cannot unmarshal into Go struct field ObjectMeta.metadata.{field_name} "
                "of type map[string]string")
    for value in values.values():
        if not isinstance(value, str):
            kind = {bool: "bool", dict: "object", list: "array"}.get(type(value), "number")
            return (f"json: cannot unmarshal {kind} into Go struct field ObjectMeta.metadata."
                    f"{field_name} of type string")
    return None


def check_decodes(node: dict[str, Any], merge: bool) -> None:
    """A patched Node's labels and annotations decode as maps of strings, else the real
    server's refusal: for a JSON merge patch 422 quoting the whole patched object
    (apiserver's patch handler, `field.Invalid(field.NewPath("patch"), …)`), else 400."""
    for field_name in ("labels", "annotations"):
        problem = string_map_problem(node["metadata"], field_name)
        if problem and merge:
            quoted = json.dumps(json.dumps(node, separators=(",", ":")))
            raise Refused(422, status_object(422, "Invalid", f'"" is invalid: patch: Invalid '
                                             f"value: {quoted}: {problem}"))
        if problem:
            raise bad_request(problem)


NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


def taint_not_ready(node: dict[str, Any]) -> None:
    """TaintNodesByCondition (plugin/pkg/admission/nodetaint): a new Node is tainted not-ready
    until the node lifecycle controller sees it Ready; one created Ready has been seen."""
    conditions = (node.get("status") or {}).get("conditions") or []
    if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
           if isinstance(c, dict)):
        return
    taints = node.setdefault("spec", {}).setdefault("taints", [])
    if not any(t.get("key") == NOT_READY_TAINT["key"] for t in taints if isinstance(t, dict)):
        taints.append(dict(NOT_READY_TAINT))


_SELECTOR_RE = re.compile(r"\s*(!?)\s*([^\s=!,()]+)\s*(?:(==|=|!=)\s*([^\s=!,()]*))?\s*")


def parse_selector(selector: str) -> list[tuple[str, str, str | None]]:
    """An equality-based label selector (apimachinery's labels.Parse) as (key, op, value):
    op "exists", "!", "=" or "!="; set-based requirements (in, notin) are refused (400)."""
    requirements: list[tuple[str, str, str | None]] = []
    for part in selector.split(",") if selector.strip() else []:
        match = _SELECTOR_RE.fullmatch(part)
        if not match or " in " in part or " notin " in part:
            raise bad_request(f"unable to parse requirement: {part!r} (fake API server: "
                              "equality-based selectors only)")
        bang, key, op, value = match.groups()
        if bang and op:
            raise bad_request(f"unable to parse requirement: {part!r}")
        requirements.append((key, "!" if bang else {"==": "=", None: "exists"}.get(op, op),
                             value))
    return requirements


def matches(requirements: list[tuple[str, str, str | None]], labels: dict[str, str]) -> bool:
    for key, op, value in requirements:
        if (op == "exists" and key not in labels) or (op == "!" and key in labels):
            return False
        if (op == "=" and labels.get(key) != value) or (op == "!=" and labels.get(key) == value):
            return False
    return True


def list_page(nodes: dict[str, dict[str, Any]], query: dict[str, list[str]], revision: int,
              epoch: int) -> dict[str, Any]:
    """One page of a chunked LIST of `nodes` (name → Node) for the parsed query string."""
    selector = query.get("labelSelector", [""])[0]
    requirements = parse_selector(selector)
    limit_text = query.get("limit", ["0"])[0]
    if not limit_text.isdigit():
        raise bad_request(f"invalid limit: {limit_text!r}")
    limit = int(limit_text)
    start = _continue_start(query["continue"][0], epoch) if "continue" in query else ""
    names = [n for n, node in sorted(nodes.items())
             if n > start and matches(requirements, node["metadata"].get("labels") or {})]
    page = names[:limit] if limit else names
    metadata: dict[str, Any] = {"resourceVersion": str(revision)}
    if len(page) < len(names):
        token = json.dumps({"v": "meta.k8s.io/v1", "rv": revision, "epoch": epoch,
                            "start": page[-1]})
        metadata["continue"] = base64.urlsafe_b64encode(token.encode()).decode()
        if not selector:
            metadata["remainingItemCount"] = len(names) - len(page)
    return {"kind": "NodeList", "apiVersion": "v1", "metadata": metadata,
            "items": [copy.deepcopy(nodes[n]) for n in page]}


def _continue_start(token: str, epoch: int) -> str:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
        start, issued = decoded["start"], decoded["epoch"]
    except (ValueError, KeyError, TypeError) as exc:
        raise bad_request(f"continue key is not valid: {exc}") from exc
    if issued != epoch:
        raise Refused(410, status_object(
            410, "Expired", "The provided continue parameter is too old to display a "
            "consistent list result. You can start a new list without the continue "
            "parameter."))
    return str(start)


def authorize(user: str, node: str | None, verb: str, name: str | None,
              resource: str) -> None:
    """The Node authorizer, then RBAC with no bindings but the server's node_readers (checked
    before this): users other than nodes may do nothing."""
    denied = f'User "{user}" cannot {verb} resource "{resource}" in API group "" at ' \
        "the cluster scope"
    if node is None or (verb != "patch" and resource != "nodes"):
        raise forbidden(name, denied)
    if verb == "list":
        raise forbidden(name, f"{denied}: node '{node}' cannot read all nodes, only "
                         "its own Node object")
    if verb == "get" and name != node:
        raise forbidden(name, f"{denied}: node '{node}' cannot read '{name}', only its "
                         "own Node object")


def admit_node(node: str, name: str, new: dict[str, Any], old: dict[str, Any]) -> None:
    """NodeRestriction's admitNode for an update."""
    if name != node:
        raise forbidden(name, f'node "{node}" is not allowed to modify node "{name}"')
    old_taints = (old.get("spec") or {}).get("taints") or []
    if ((new.get("spec") or {}).get("taints") or []) != old_taints:
        raise forbidden(name, f'node "{node}" is not allowed to modify taints')
    labels = forbidden_labels(new["metadata"].get("labels") or {},
                              old["metadata"].get("labels") or {})
    if labels:
        raise forbidden(name, f"is not allowed to modify labels: {', '.join(labels)}")

def record_event(events: list[dict[str, Any]], lock: Any, user: Any, path: str,
                 content_type: str, body: bytes,
                 namespaces: set[str] | frozenset[str] = frozenset({"default"})
                 ) -> tuple[int, dict[str, Any]]:
    """A POST to /api/v1/namespaces/<ns>/events: the Event checked (checked_event), named,
    kept in `events` (under `lock`) and answered 201. The system:node role lets a kubelet
    create Events; a namespace that does not exist is 404."""
    allowed = user.node is not None or "system:masters" in user.groups
    namespace = path.split("/")[4]
    if allowed and namespace not in namespaces:
        raise Refused(404, status_object(404, "NotFound", f'namespaces "{namespace}" not found',
                                         namespace, "namespaces"))
    event = checked_event(allowed, user.name, namespace, content_type, body, len(events))
    with lock:
        events.append(copy.deepcopy(event))
    return 201, event

def checked_event(allowed: bool, user: str, namespace: str, content_type: str,
                  body: bytes, number: int) -> dict[str, Any]:
    """The Event a POST to namespaces/<namespace>/events creates (the `number`th), checked as
    the API server does for what gpunode sends: a user allowed to create Events, JSON, an Event
    of that namespace about some object. Refused otherwise."""
    if not allowed:
        raise Refused(403, status_object(403, "Forbidden", f'events is forbidden: User "{user}" '
                                         'cannot create resource "events" in API group ""'))
    if content_type != "application/json":
        raise Refused(415, status_object(415, "UnsupportedMediaType", "fake API server: an "
                                         "Event is created from application/json"))
    try:
        event = json.loads(body)
    except ValueError as exc:
        raise bad_request(f"error decoding the Event: {exc}") from exc
    meta = event.get("metadata") if isinstance(event, dict) else None
    if not isinstance(meta, dict) or event.get("kind") != "Event" or not isinstance(
            event.get("involvedObject"), dict):
        raise bad_request("fake API server: not an Event with metadata and involvedObject")
    if meta.get("namespace", namespace) != namespace:
        raise bad_request("the namespace of the provided object does not match the namespace "
                          "sent on the request")
    # pkg/apis/core/validation/events.go (legacyValidateEvent): an Event about an object of no
    # namespace (a Node) lives in default; one about a namespaced object, in its namespace.
    involved = event["involvedObject"].get("namespace") or ""
    if (involved == "" and namespace != "default") or (involved and involved != namespace):
        raise Refused(422, status_object(
            422, "Invalid", f'Event "{meta.get("name") or meta.get("generateName") or ""}" is '
            f'invalid: involvedObject.namespace: Invalid value: "{involved}": does not match '
            "event.namespace", meta.get("name"), "Event"))
    meta["name"] = meta.get("name") or f"{meta.get('generateName', '')}{number:x}"
    meta.update(namespace=namespace, uid=str(uuid.uuid4()))
    return event
