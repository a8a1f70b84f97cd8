"""Taints and labels a GPU node must carry from its registration on.

NodeRestriction forbids a kubelet to change its own taints once its Node exists, so the
`nvidia.com/gpu` taint has to be there at registration: in cluster-azure through the node
pool's `customNodeTaints`/`customNodeLabels`, on other kubeadm nodes through the
JoinConfiguration's `nodeRegistration` or the kubelet's `--register-with-taints` and
`--node-labels`. These functions render those forms from the agent config.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gpunode.errors import ConfigError, UsageError
from gpunode.platform.host import Host
from gpunode.platform.nodepaths import KUBELET_DROPIN
from gpunode.platform.systemd_unit import read_unit

if TYPE_CHECKING:
    from gpunode.platform.systemd import Systemd

REGISTRATION_LABELS = {"nvidia.com/gpu.present": "true"}
FORMATS = ("cluster-azure", "kubeadm", "kubelet-flags")
# "gpu00" beside the chart's own default pool "def00"; a valid cluster-azure pool name (below).
DEFAULT_POOL, DEFAULT_INSTANCE_TYPE = "gpu00", "Standard_NC4as_T4_v3"
TAINTS_KEY = "kubernetes.taints"


def parse_taint(text: str) -> dict[str, str]:
    """"key=value:Effect" (value optional) → the Node API's taint object (key, value, effect)."""
    key_value, _, effect = text.rpartition(":")
    key, eq, value = key_value.partition("=")
    return {"key": key, "value": value, "effect": effect} if eq else \
        {"key": key, "effect": effect}


# cluster-azure 8.0.0 (giantswarm/cluster-azure, helm/cluster-azure/values.schema.json at commit
# d989a53fa14ee71cdca1eb2136f6baf6cdd90c66; tests/data/cluster-azure/ holds the excerpt the
# tests validate against):
# - `global.nodePools` admits only keys matching ^[a-z0-9][-a-z0-9]{3,18}[a-z0-9]$ (5-20
#   characters; the name becomes part of the pool's Azure resource names);
# - a `customNodeTaints` item requires key, value and effect (NoSchedule, PreferNoSchedule,
#   NoExecute), all strings; `customNodeLabels` are "key=value" strings;
# - and templates/_helpers.tpl ("customNodeTaints") fails the whole rendering when any of the
#   three is empty (`or (not .key) (not .value) (not .effect)`: "" is false in a Go template),
#   so a taint without a value cannot be given to the chart at all, not even as value "".
_POOL_RE = re.compile(r"[a-z0-9][-a-z0-9]{3,18}[a-z0-9]")
MIN_POOL, MAX_POOL = 5, 20
MAX_INSTANCE_TYPE = 128


def shown(value: str) -> str:
    """A command-line value quoted for a message, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}... ({len(value)} characters)"


def pool_problem(pool: str) -> str | None:
    """Why `pool` cannot name a cluster-azure node pool, or None."""
    if not _POOL_RE.fullmatch(pool):
        return (f"a cluster-azure node pool name is {MIN_POOL}-{MAX_POOL} lowercase letters, "
                "digits and '-', starting and ending with a letter or digit (the chart's "
                "schema: ^[a-z0-9][-a-z0-9]{3,18}[a-z0-9]$), e.g. gpu00 or gpu-t4")
    return None


def instance_type_problem(instance_type: str) -> str | None:
    """Why `instance_type` cannot be an Azure VM size (e.g. Standard_NC4as_T4_v3), or None."""
    if not instance_type or len(instance_type) > MAX_INSTANCE_TYPE or not (
            instance_type.isascii() and instance_type.isprintable()) or any(
            c.isspace() for c in instance_type):
        return (f"an instance type is 1-{MAX_INSTANCE_TYPE} printable ASCII characters without "
                "spaces, e.g. Standard_NC4as_T4_v3")
    return None


def pool_settings(form: str | None, pool: str | None,
                  instance_type: str | None) -> tuple[str, str]:
    """--pool and --instance-type for the registration `form` (None: plain `label`), checked
    (a UsageError, exit 2): they name a cluster-azure node pool, and mean nothing to the other
    forms, so they are refused there rather than ignored."""
    given = [flag for flag, value in (("--pool", pool), ("--instance-type", instance_type))
             if value is not None]
    if form != "cluster-azure":
        if given:
            named = f"--registration {form}" if form else "label without --registration"
            raise UsageError(f"{' and '.join(given)}: only --registration cluster-azure takes "
                             f"{'it' if len(given) == 1 else 'them'}, not {named}")
        return DEFAULT_POOL, DEFAULT_INSTANCE_TYPE
    pool = DEFAULT_POOL if pool is None else pool
    instance_type = DEFAULT_INSTANCE_TYPE if instance_type is None else instance_type
    for flag, value, check in (("--pool", pool, pool_problem),
                               ("--instance-type", instance_type, instance_type_problem)):
        problem = check(value)
        if problem is not None:
            raise UsageError(f"{flag} {shown(value)}: {problem}")
    return pool, instance_type


def cluster_azure_taint(text: str, source: str) -> dict[str, str]:
    """A `customNodeTaints` item: {key, value, effect}, all three always there; a taint without
    a value (or with an empty one) is refused (ConfigError, exit 2): the chart cannot take it."""
    taint = parse_taint(text)
    if not taint.get("value"):
        raise ConfigError(source, TAINTS_KEY, f"taint {text!r} has no value, and cluster-azure's "
                          "customNodeTaints require one (the chart refuses an empty value: "
                          "'.customNodeTaints element must have [key, value, effect]'); give "
                          "it one, e.g. 'nvidia.com/gpu=present:NoSchedule'")
    return {"key": taint["key"], "value": taint["value"], "effect": taint["effect"]}


def node_labels(labels: dict[str, str], stack: str = "gpunode") -> dict[str, str]:
    """The labels a GPU node registers with: `nvidia.com/gpu.present=true` (what the device
    plugin's DaemonSet selects) and the config's own; beside the GPU Operator not the former,
    which the Operator sets from NFD's PCI labels and would otherwise be fought over."""
    return {**(REGISTRATION_LABELS if stack == "gpunode" else {}), **labels}


def cluster_azure(pool: str, instance_type: str, taints: tuple[str, ...],
                  labels: dict[str, str], source: str = "the agent config",
                  stack: str = "gpunode") -> dict[str, Any]:
    """A cluster-azure node pool (`global.nodePools.<pool>`) that registers as a GPU node, in
    the shape the chart's schema and templates accept (see above); `source` names the agent
    config the taints come from, for the refusal of one the chart cannot take."""
    return {"global": {"nodePools": {pool: {
        "instanceType": instance_type,
        "customNodeLabels": [f"{k}={v}" for k, v in node_labels(labels, stack).items()],
        "customNodeTaints": [cluster_azure_taint(t, source) for t in taints],
    }}}}


def kubeadm(taints: tuple[str, ...], labels: dict[str, str],
            stack: str = "gpunode") -> dict[str, Any]:
    """`joinConfiguration.nodeRegistration` for a KubeadmConfigTemplate (kubeadm v1beta3)."""
    joined = ",".join(f"{k}={v}" for k, v in node_labels(labels, stack).items())
    registration: dict[str, Any] = {"taints": [parse_taint(t) for t in taints]}
    if joined:
        registration["kubeletExtraArgs"] = {"node-labels": joined}
    return {"nodeRegistration": registration}


def kubelet_flags(taints: tuple[str, ...], labels: dict[str, str],
                  stack: str = "gpunode") -> list[str]:
    joined = ",".join(f"{k}={v}" for k, v in node_labels(labels, stack).items())
    flags = [f"--node-labels={joined}"] if joined else []
    if taints:
        flags.insert(0, f"--register-with-taints={','.join(taints)}")
    return flags


def form(name: str, pool: str, instance_type: str, taints: tuple[str, ...],
         labels: dict[str, str], source: str = "the agent config",
         stack: str = "gpunode") -> dict[str, Any] | list[str]:
    """The registration form `name` (one of FORMATS): a document, or kubelet-flags' flags."""
    if name == "kubelet-flags":
        return kubelet_flags(taints, labels, stack)
    if name == "cluster-azure":
        return cluster_azure(pool, instance_type, taints, labels, source, stack)
    return kubeadm(taints, labels, stack)


KUBELET_UNIT = "kubelet.service"
KUBELET_CLIENT_CERT = "/var/lib/kubelet/pki/kubelet-client-current.pem"


def kubelet_dropin(raw_exec: tuple[str, ...], flags: list[str]) -> str:
    """A drop-in that runs the kubelet's own ExecStart with the registration flags added."""
    argv = [w for w in raw_exec if not w.startswith(("--register-with-taints",
                                                        "--node-labels"))]
    return ("# Written by gpunode: register this GPU node with its taint and label (a kubelet\n"
            "# may not change its taints after registration).\n[Service]\nExecStart=\n"
            f"ExecStart={' '.join([*argv, *flags])}\n")


def plan_kubelet_dropin(host: Host, taints: tuple[str, ...], labels: dict[str, str],
                        stack: str = "gpunode") -> tuple[str | None, str]:
    """(drop-in text to write or None, why) for `register_with = "kubelet"`."""
    if host.exists(KUBELET_CLIENT_CERT):
        return None, "the kubelet has registered already; its taints can no longer change"
    unit = read_unit(host, KUBELET_UNIT)
    if unit.fragment is None or not unit.exec_start_raw:
        return None, "there is no kubelet.service with an ExecStart to extend"
    # Our own earlier drop-in may be what ExecStart comes from: kubelet_dropin() drops the
    # flags it added before adding them again, so the result is the same either way.
    text = kubelet_dropin(unit.exec_start_raw, kubelet_flags(taints, labels, stack))
    if host.read_optional(KUBELET_DROPIN) == text:
        return None, "the kubelet drop-in is already in place"
    return text, f"write {KUBELET_DROPIN}"


def write_kubelet_dropin(host: Host, text: str, systemd: Systemd) -> dict[str, str]:
    """Write the drop-in and have systemd load it; the record's note where no systemd manages
    the root."""
    host.write_atomic(KUBELET_DROPIN, text.encode(), make_parents=True)
    if systemd.available:
        systemd.daemon_reload()
        return {}
    return {"daemon_reload": f"skipped: {systemd.unavailable_reason}; the kubelet's service "
            "manager reads the drop-in when it next loads units"}


def print_form(config: Any, name: str, pool: str | None, instance_type: str | None,
               as_json: bool) -> int:
    """`gpunode label --registration NAME`: the form on stdout, YAML (the flags on one line for
    kubelet-flags), or with --json the very same document as JSON (kubelet-flags: a JSON array
    of the flags). `config` is the AgentConfig."""
    pool, instance_type = pool_settings(name, pool, instance_type)
    document = form(name, pool, instance_type, config.kubernetes.taints,
                    dict(config.kubernetes.labels), config.source, config.kubernetes.stack)
    if as_json:
        import json

        print(json.dumps(document, indent=2, sort_keys=False))
    elif isinstance(document, list):
        print(" ".join(document))
    else:
        import yaml

        print(yaml.safe_dump(document, sort_keys=False), end="")
    return 0
