"""The labels and the GPUReady condition a GPU node gives itself: pure functions of host facts.

Names and formats follow NVIDIA's GPU feature discovery (GFD), so the device plugin chart and
existing node selectors keep working: `nvidia.com/gpu.present`, `gpu.count`, `gpu.product`
(spaces → '-'), `gpu.family`, `gpu.memory` (MiB), `gpu.machine`, `gpu.compute.{major,minor}`,
`gpu.mode`, `mig.capable`, `vgpu.present`, `cuda.driver-version.{major,minor,revision,full}`,
`cuda.runtime-version.{major,minor,full}` (the tables behind them: kube/gfd.py). gpunode's own
labels live under PREFIX. In the `gpu-operator` stack (kubernetes.stack) the Operator's GFD
and its own logic own every `nvidia.com/` label: gpunode then sets only its own
(docs/stacks.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpunode import __version__
from gpunode.driver.flavour import architecture
from gpunode.gpu.detect import Detection, PciFunction
from gpunode.kube import gfd

PREFIX = "gpunode.io/"
NVIDIA = "nvidia.com/"
MANAGED_ANNOTATION = f"{PREFIX}managed-labels"  # the label keys gpunode set last time
VERSION_LABEL = f"{PREFIX}version"  # the gpunode that labelled the node (`gpunode nodes`)

# Memory as NVML reports it (MiB) for the GPUs of DESIGN.md §4; others get no memory label.
MEMORY_MIB = {
    "1db4": 16384, "1eb8": 15360, "20b0": 40960, "20b2": 81920, "20b5": 81920, "2236": 23028,
    "2237": 23028, "27b8": 23034, "26b9": 46068, "2321": 95830, "2330": 81559, "2331": 81559,
    "2335": 143771, "2901": 183359,
}

_VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NAME_RE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_PREFIX_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

# NodeRestriction: a kubelet may set its own labels except these (kubernetes/plugin/pkg/admission/
# noderestriction), apart from the allow-list below.
KUBELET_ALLOWED_LABELS = frozenset({
    "kubernetes.io/hostname", "kubernetes.io/arch", "kubernetes.io/os",
    "beta.kubernetes.io/instance-type", "node.kubernetes.io/instance-type",
    "failure-domain.beta.kubernetes.io/region", "failure-domain.beta.kubernetes.io/zone",
    "topology.kubernetes.io/region", "topology.kubernetes.io/zone",
    "beta.kubernetes.io/arch", "beta.kubernetes.io/os",
})
KUBELET_ALLOWED_PREFIXES = ("kubelet.kubernetes.io/", "node.kubernetes.io/")


@dataclass(frozen=True)
class LabelFacts:
    """What the labels are computed from; gathered by the caller from the host."""

    detection: Detection
    models: dict[str, str]  # GPU address → the driver's model name (/proc/driver/nvidia)
    driver_version: str | None
    flavour: str | None
    strategy: str | None
    ready: bool
    machine: str | None  # DMI product name
    stack: str = "gpunode"  # kubernetes.stack: who sets the nvidia.com/ labels
    vgpu: bool | None = None  # a vGPU among the NVIDIA functions (gfd.vgpu_present); None: unread


@dataclass(frozen=True)
class Condition:
    """The GPUReady condition of the Node, as `gpunode label` or the watch sets it."""

    status: str  # "True" or "False"
    reason: str
    message: str


def label_problem(key: str, value: str) -> str | None:
    """Why `key=value` is not a valid Kubernetes label, or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _PREFIX_RE.fullmatch(prefix)):
        return f"the prefix of '{key}' must be a DNS subdomain (lowercase, at most 253 chars)"
    if len(name) > 63 or not _NAME_RE.fullmatch(name):
        return (f"the name of '{key}' must be 1-63 letters, digits, '-', '_' or '.', starting "
                "and ending with a letter or digit")
    if len(value) > 63 or not _VALUE_RE.fullmatch(value):
        return (f"the value {value!r} of '{key}' must be at most 63 letters, digits, '-', '_' "
                "or '.', starting and ending with a letter or digit")
    return None


def kubelet_may_set(key: str) -> str | None:
    """None when NodeRestriction lets a kubelet set `key` on its Node, else the rule it breaks."""
    if key in KUBELET_ALLOWED_LABELS or key.startswith(KUBELET_ALLOWED_PREFIXES):
        return None
    prefix = key.rpartition("/")[0]
    if prefix == "node-restriction.kubernetes.io" or prefix.endswith(
            ".node-restriction.kubernetes.io"):
        return ("NodeRestriction: kubelets may not set labels under node-restriction."
                "kubernetes.io/ (reserved for labels an administrator sets)")
    for domain in ("kubernetes.io", "k8s.io"):
        if prefix == domain or prefix.endswith("." + domain):
            return (f"NodeRestriction: kubelets may not set labels under {domain}/ except "
                    f"{', '.join(sorted(KUBELET_ALLOWED_LABELS))} and the prefixes "
                    f"{', '.join(KUBELET_ALLOWED_PREFIXES)}")
    return None


def _dashed(text: str) -> str:
    """GFD's spelling: spaces become '-', and anything else a label value cannot hold is cut."""
    value = re.sub(r"[^-A-Za-z0-9_.]", "", text.strip().replace(" ", "-"))[:63]
    return value.strip("-_.")


def _product(gpu: PciFunction, models: dict[str, str]) -> str:
    model = models.get(gpu.address)
    if model:
        return _dashed(model)
    name = gpu.product_name or f"10de-{gpu.device_id or 'unknown'}"
    bracket = re.search(r"\[(.+)\]", name)  # pci.ids: "TU104GL [Tesla T4]"
    return _dashed(bracket.group(1) if bracket else name)


def compute(facts: LabelFacts, user: dict[str, str]) -> dict[str, str]:
    """Every label gpunode wants on the Node, user labels included."""
    gpus = facts.detection.usable_gpus
    if not gpus:
        return dict(user)
    labels = _nvidia(facts) if facts.stack == "gpunode" else {}
    if facts.flavour:
        labels[f"{PREFIX}driver-flavour"] = facts.flavour
    if facts.strategy:
        labels[f"{PREFIX}driver-strategy"] = facts.strategy
    return {**labels, **own(facts.ready), **user}


def own(ready: bool) -> dict[str, str]:
    """gpunode.io/ready and gpunode.io/version: on every node gpunode labels, in both stacks
    (`gpunode nodes` selects nodes by the first)."""
    return {f"{PREFIX}ready": "true" if ready else "false", VERSION_LABEL: _dashed(__version__)}


def _nvidia(facts: LabelFacts) -> dict[str, str]:
    """GFD's labels, each only where its fact is known (kube/gfd.py)."""
    gpus = facts.detection.usable_gpus
    first = gpus[0]
    labels = {
        f"{NVIDIA}gpu.present": "true",
        f"{NVIDIA}gpu.count": str(len(gpus)),
        f"{NVIDIA}gpu.product": _product(first, facts.models),
        f"{NVIDIA}gpu.family": architecture(first.device_id),
    }
    memory = MEMORY_MIB.get(first.device_id or "")
    if memory:
        labels[f"{NVIDIA}gpu.memory"] = str(memory)
    if facts.machine:
        labels[f"{NVIDIA}gpu.machine"] = _dashed(facts.machine)
    known = gfd.GPUS.get(first.device_id or "")
    if known is not None:
        labels[f"{NVIDIA}gpu.compute.major"] = str(known.compute[0])
        labels[f"{NVIDIA}gpu.compute.minor"] = str(known.compute[1])
    labels[f"{NVIDIA}gpu.mode"] = gfd.gpu_mode([g.class_code for g in gpus])
    mig = gfd.mig_capable([g.device_id for g in gpus])
    if mig is not None:
        labels[f"{NVIDIA}mig.capable"] = "true" if mig else "false"
    if facts.vgpu is not None:
        labels[f"{NVIDIA}vgpu.present"] = "true" if facts.vgpu else "false"
    if facts.driver_version:
        parts = [*facts.driver_version.split("."), "", "", ""][:3]
        labels[f"{NVIDIA}cuda.driver-version.full"] = facts.driver_version
        for name, part in zip(("major", "minor", "revision"), parts, strict=True):
            if part:
                labels[f"{NVIDIA}cuda.driver-version.{name}"] = part
        cuda = gfd.cuda_version(facts.driver_version)
        if cuda is not None:
            labels[f"{NVIDIA}cuda.runtime-version.major"] = str(cuda[0])
            labels[f"{NVIDIA}cuda.runtime-version.minor"] = str(cuda[1])
            labels[f"{NVIDIA}cuda.runtime-version.full"] = f"{cuda[0]}.{cuda[1]}"
    return labels


def handed_over(stack: str) -> tuple[str, ...]:
    """The label prefixes another component owns in `stack`: gpunode never removes them, even
    the ones it set itself before the stack changed (the Operator sets them now)."""
    return (NVIDIA,) if stack == "gpu-operator" else ()


def label_patch(current: dict[str, str], annotations: dict[str, str],
                wanted: dict[str, str], keep: tuple[str, ...] = ()) -> dict[str, object] | None:
    """The merge patch that makes the Node's labels what gpunode wants; None when they are.

    Labels gpunode set before (listed in MANAGED_ANNOTATION) and no longer wants are removed,
    except under the prefixes in `keep` (handed_over); labels it never set are never touched."""
    previous = {k for k in annotations.get(MANAGED_ANNOTATION, "").split(",")
                if k and not k.startswith(keep)}
    labels: dict[str, str | None] = {k: v for k, v in wanted.items() if current.get(k) != v}
    labels |= {k: None for k in previous - set(wanted) if k in current}
    managed = ",".join(sorted(wanted))
    if not labels and annotations.get(MANAGED_ANNOTATION, "") == managed:
        return None
    return {"metadata": {"labels": labels, "annotations": {MANAGED_ANNOTATION: managed}}}


def condition_for(checks: list[tuple[str, str, str]], headline: str | None = None
                  ) -> Condition:
    """GPUReady from `gpunode status` checks (name, state, detail). A dead or lost GPU that
    `gpunode watch` found (its check failing, `headline` its reason: GPUFellOffBus,
    GPUXidFatal, GPUMissing) stays the reason, and its words come first, whatever else fails
    with it (a containerd that lost the GPU too is its consequence, not the news)."""
    failed = [(name, detail) for name, state, detail in checks if state == "fail"]
    if not failed:
        return Condition("True", "GPUReady", "gpunode: the GPUs, driver, device nodes and "
                         "container runtime are ready")
    failed.sort(key=lambda f: f[0] != "watch")  # stable: the rest keep status's order
    reason = "".join(part.capitalize() for part in failed[0][0].split("_")) + "NotReady"
    if failed[0][0] == "watch" and headline:
        reason = headline
    message = "; ".join(f"{name}: {detail}" for name, detail in failed)
    return Condition("False", reason, f"gpunode: {message}"[:1024])


def condition_patch(existing: list[dict[str, object]], condition: Condition,
                    now: str) -> dict[str, object] | None:
    """The status patch for GPUReady; lastTransitionTime moves only when the status changes."""
    old = next((c for c in existing if c.get("type") == "GPUReady"), None)
    transition = now if old is None or old.get("status") != condition.status else \
        old.get("lastTransitionTime", now)
    new = {"type": "GPUReady", "status": condition.status, "reason": condition.reason,
           "message": condition.message, "lastTransitionTime": transition,
           "lastHeartbeatTime": now}
    if old is not None and all(old.get(k) == new[k] for k in ("status", "reason", "message")):
        return None
    return {"status": {"conditions": [new]}}
