"""The labels and GPUReady condition a node gives itself, from fixture hosts: exact sets."""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO, HostFactory
from gpunode import __version__
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.kube import labels, registration
from gpunode.kube.label import for_host as desired
from gpunode.kube.nodename import node_name
from gpunode.platform.host import Host

DEPLOY = REPO / "deploy"
DRIVER = {"nvidia.com/cuda.driver-version.full": "550.127.08",
          "nvidia.com/cuda.driver-version.major": "550",
          "nvidia.com/cuda.driver-version.minor": "127",
          "nvidia.com/cuda.driver-version.revision": "08"}


def test_nd96_counts_eight_gpus_and_not_the_nvswitches(make_host: HostFactory) -> None:
    want = desired(make_host("nd96amsr-a100-v4", "ready"), AgentConfig())
    assert {k: want.labels[k] for k in ("nvidia.com/gpu.count", "nvidia.com/gpu.product",
                                        "nvidia.com/gpu.family", "nvidia.com/gpu.memory")} == {
        "nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.family": "ampere", "nvidia.com/gpu.memory": "81920"}
    assert want.labels["gpunode.io/driver-flavour"] == "open"


def test_a10_node_labels(make_host: HostFactory) -> None:
    want = desired(make_host("nvads-a10-v5", "ready"), AgentConfig())
    assert want.labels["nvidia.com/gpu.product"] == "NVIDIA-A10"
    assert want.labels["nvidia.com/gpu.memory"] == "23028"


def test_cpu_node_gets_only_the_configured_labels(make_host: HostFactory) -> None:
    config = AgentConfig(kubernetes=KubernetesConfig(labels={"team": "ml"}))
    assert desired(make_host("azure-d4s-v5", "bare"), config).labels == {"team": "ml"}


def test_failed_driver_node_says_not_ready_and_why(make_host: HostFactory) -> None:
    want = desired(make_host("nc4as-t4-v3", "bare"), AgentConfig())
    assert want.labels["gpunode.io/ready"] == "false"
    assert want.labels["nvidia.com/gpu.product"] == "Tesla-T4"  # from pci.ids, no driver
    assert not set(DRIVER) & set(want.labels)
    assert want.condition.status == "False"
    assert want.condition.reason == "DriverNotReady"
    assert "driver: /proc/driver/nvidia/version is missing" in want.condition.message


def test_user_labels_are_added(make_host: HostFactory) -> None:
    config = AgentConfig(kubernetes=KubernetesConfig(labels={"example.com/pool": "t4"}))
    assert desired(make_host("nc4as-t4-v3", "ready"), config).labels["example.com/pool"] == "t4"


def test_node_name_follows_the_kubelets_hostname_override(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra={
        "/var/lib/kubelet/kubeadm-flags.env":
            'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///run/containerd/'
            'containerd.sock --hostname-override=GPU-Node-7"\n'})
    assert node_name(host, None) == ("gpu-node-7", "--hostname-override in "
                                     "/var/lib/kubelet/kubeadm-flags.env")
    config = AgentConfig(kubernetes=KubernetesConfig(node_name="explicit"))
    assert node_name(host, config.kubernetes.node_name)[0] == "explicit"


# -- patches ---------------------------------------------------------------------------------


def test_patch_adds_changes_and_removes_only_gpunodes_own_stale_labels() -> None:
    current = {"nvidia.com/gpu.count": "1", "nvidia.com/gpu.family": "volta",
               "team": "ml", "kubernetes.io/hostname": "n"}
    annotations = {labels.MANAGED_ANNOTATION: "nvidia.com/gpu.count,nvidia.com/gpu.family"}
    patch = labels.label_patch(current, annotations, {"nvidia.com/gpu.count": "2"})
    assert patch == {"metadata": {
        "labels": {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.family": None},
        "annotations": {labels.MANAGED_ANNOTATION: "nvidia.com/gpu.count"}}}


def test_no_patch_when_labels_are_current() -> None:
    wanted = {"nvidia.com/gpu.present": "true"}
    annotations = {labels.MANAGED_ANNOTATION: "nvidia.com/gpu.present"}
    assert labels.label_patch(wanted, annotations, wanted) is None


def test_condition_transition_time_moves_only_when_the_status_changes() -> None:
    ready = labels.Condition("True", "GPUReady", "ok")
    first = labels.condition_patch([], ready, "T1")
    assert first is not None
    stored = first["status"]["conditions"]  # type: ignore[index]
    assert labels.condition_patch(stored, ready, "T2") is None  # unchanged: no patch at all
    failing = labels.Condition("False", "DriverNotReady", "gone")
    changed = labels.condition_patch(stored, failing, "T3")["status"]["conditions"][0]  # type: ignore[index]
    assert changed["lastTransitionTime"] == "T3"
    reworded = labels.condition_patch([changed], labels.Condition("False", "DriverNotReady",
                                                                  "still gone"), "T4")
    assert reworded["status"]["conditions"][0]["lastTransitionTime"] == "T3"  # type: ignore[index]


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "allowed"), [
    ("nvidia.com/gpu.present", True), ("example.com/x", True), ("kubernetes.io/hostname", True),
    ("node.kubernetes.io/instance-type", True), ("kubelet.kubernetes.io/x", True),
    ("kubernetes.io/role", False), ("node-role.kubernetes.io/gpu", False),
    ("k8s.io/x", False), ("sub.k8s.io/x", False),
    ("node-restriction.kubernetes.io/pool", False),
])
def test_node_restriction_rules(key: str, allowed: bool) -> None:
    assert (labels.kubelet_may_set(key) is None) == allowed


@pytest.mark.parametrize(("key", "value", "valid"), [
    ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB", True), ("a", "", True),
    ("a", "x" * 64, False), ("a", "-x", False), ("Bad_Prefix/a", "x", False),
    ("a", "has space", False),
])
def test_label_syntax(key: str, value: str, valid: bool) -> None:
    assert (labels.label_problem(key, value) is None) == valid


# -- registration and the cluster side --------------------------------------------------------


def test_registration_forms_carry_the_taint_and_the_present_label() -> None:
    taints = ("nvidia.com/gpu=present:NoSchedule",)
    assert registration.kubelet_flags(taints, {}) == [
        "--register-with-taints=nvidia.com/gpu=present:NoSchedule",
        "--node-labels=nvidia.com/gpu.present=true"]
    assert registration.kubeadm(taints, {})["nodeRegistration"]["taints"] == [
        {"key": "nvidia.com/gpu", "effect": "NoSchedule", "value": "present"}]


def test_cluster_azure_example_is_what_gpunode_renders() -> None:
    example = yaml.safe_load((DEPLOY / "cluster-azure-gpu-pool.yaml").read_text())
    assert example == registration.cluster_azure(
        "gpu-t4", "Standard_NC4as_T4_v3", ("nvidia.com/gpu=present:NoSchedule",), {})


def test_deploy_manifests_have_what_the_device_plugin_needs() -> None:
    runtime_class = yaml.safe_load((DEPLOY / "runtimeclass.yaml").read_text())
    assert (runtime_class["kind"], runtime_class["handler"]) == ("RuntimeClass", "nvidia")
    assert runtime_class["scheduling"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    values = yaml.safe_load((DEPLOY / "nvidia-device-plugin-values.yaml").read_text())
    assert values["runtimeClassName"] == "nvidia"
    term = values["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.present"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        values["tolerations"]
    pod = yaml.safe_load((DEPLOY / "gpu-pod.yaml").read_text())
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}


KUBEADM_DROPIN = """[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap.conf \\
--kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
ExecStart=
ExecStart=/opt/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS
"""


def kubeadm_node(make_host: HostFactory) -> Host:
    return make_host("nc4as-t4-v3", "ready", extra={
        "/etc/systemd/system/kubelet.service": "[Service]\nExecStart=/opt/bin/kubelet\n",
        "/etc/systemd/system/kubelet.service.d/10-kubeadm.conf": KUBEADM_DROPIN})


def test_kubelet_registration_dropin_extends_the_kubelets_own_command(
    make_host: HostFactory,
) -> None:
    from gpunode.pipeline import boot
    from gpunode.platform.systemd import NoSystemd
    from gpunode.platform.systemd_unit import read_unit

    host = kubeadm_node(make_host)
    config = AgentConfig(kubernetes=KubernetesConfig(register_with="kubelet"))
    adapters = boot.Adapters(systemd=NoSystemd(), kmod=None)  # type: ignore[arg-type]
    boot.boot(host, config, adapters)
    unit = read_unit(host, "kubelet.service")
    assert unit.exec_start_raw == (
        "/opt/bin/kubelet", "$KUBELET_KUBECONFIG_ARGS", "$KUBELET_CONFIG_ARGS",
        "$KUBELET_KUBEADM_ARGS", "--register-with-taints=nvidia.com/gpu=present:NoSchedule",
        "--node-labels=nvidia.com/gpu.present=true")
    text, why = registration.plan_kubelet_dropin(host, config.kubernetes.taints, {})
    assert (text, why) == (None, "the kubelet drop-in is already in place")


def test_plan_names_the_kubelet_registration_drop_in_boot_would_write(
    make_host: HostFactory,
) -> None:
    from gpunode.pipeline import boot
    from gpunode.platform.systemd import NoSystemd

    host = kubeadm_node(make_host)
    config = AgentConfig(kubernetes=KubernetesConfig(register_with="kubelet"))
    adapters = boot.Adapters(systemd=NoSystemd(), kmod=None)  # type: ignore[arg-type]
    actions = [(a.step, a.description) for a in boot.plan(host, config, adapters).actions]
    assert actions == [("registration", f"write {registration.KUBELET_DROPIN}: the kubelet "
                        "registers with the GPU taint and labels")]
    boot.boot(host, config, adapters)
    assert boot.plan(host, config, adapters).actions == []


def test_no_kubelet_dropin_once_the_kubelet_has_registered(make_host: HostFactory) -> None:
    host = kubeadm_node(make_host)
    cert = host.root / "var/lib/kubelet/pki/kubelet-client-current.pem"
    cert.parent.mkdir(parents=True)
    cert.write_text("cert\n")
    text, why = registration.plan_kubelet_dropin(host, ("nvidia.com/gpu=present:NoSchedule",),
                                                 {})
    assert text is None
    assert "registered already" in why


def test_a_user_label_named_like_gfds_does_not_make_a_cpu_node_a_gpu_node(
        make_host: HostFactory) -> None:
    """Whether there is a GPU to label comes from detection, not from the labels' names."""
    config = AgentConfig(kubernetes=KubernetesConfig(labels={"nvidia.com/gpu.present": "true"}))
    want = desired(make_host("azure-d4s-v5", "bare"), config)
    assert (want.gpu, want.usable_gpus) == (False, 0)


def test_status_wants_on_an_undecided_node_exactly_the_labels_label_sets(
        make_host: HostFactory) -> None:
    """A GPU node with another NVIDIA function nobody can identify: status's node check calls
    the labels `gpunode label` sets current, instead of asking for labels label never sets."""
    from dataclasses import replace

    from gpunode import status
    from gpunode.kube import label

    facts = status.observe(make_host("nc4as-t4-v3", "ready"), AgentConfig(), contact_api=False)
    assert facts.detection is not None
    facts = replace(facts, detection=replace(facts.detection, undecided=("0002:00:00.0",)))
    want = label.desired(facts, status.evaluate(facts))
    assert want.labels == {"gpunode.io/ready": "false", "gpunode.io/version": __version__}
    node = {"metadata": {"labels": want.labels},
            "status": {"conditions": [{"type": "GPUReady", "status": "False"}],
                       "allocatable": {"nvidia.com/gpu": "1"}}}
    facts = replace(facts, node=status.NodeFacts(want.node, "/etc/kubernetes/kubelet.conf",
                                                 obj=node))
    check = next(c for c in status.evaluate(facts).checks if c.name == "node")
    assert check.detail.startswith(f"node {want.node}: labels current"), check
