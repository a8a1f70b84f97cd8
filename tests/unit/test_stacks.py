"""kubernetes.stack: the labels a node gets under gpunode's own stack and beside the GPU
Operator (exact sets), GFD's hardware labels from their tables, and deploy/'s manifests by stack."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import REPO, HostFactory
from gpunode import __version__
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.kube import gfd, labels, registration
from gpunode.kube.label import for_host as desired
from gpunode_testing import fixtures
from hostile.support import Cli

DEPLOY = REPO / "deploy"
VERSION = {"gpunode.io/version": __version__}  # on every node gpunode labels
DRIVER_550 = {"nvidia.com/cuda.driver-version.full": "550.127.08",
              "nvidia.com/cuda.driver-version.major": "550",
              "nvidia.com/cuda.driver-version.minor": "127",
              "nvidia.com/cuda.driver-version.revision": "08",
              "nvidia.com/cuda.runtime-version.major": "12",
              "nvidia.com/cuda.runtime-version.minor": "4",
              "nvidia.com/cuda.runtime-version.full": "12.4"}


def on(stack: str) -> AgentConfig:
    return AgentConfig(kubernetes=KubernetesConfig(stack=stack))


def test_t4_node_labels_in_the_gpunode_stack(make_host: HostFactory) -> None:
    want = desired(make_host("nc4as-t4-v3", "ready"), on("gpunode"))
    assert want.node == "nc4as-t4-v3-vmss000000"
    assert want.labels == {
        "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.family": "turing",
        "nvidia.com/gpu.memory": "15360", "nvidia.com/gpu.machine": "Virtual-Machine",
        "nvidia.com/gpu.compute.major": "7", "nvidia.com/gpu.compute.minor": "5",
        "nvidia.com/gpu.mode": "compute", "nvidia.com/mig.capable": "false",
        "nvidia.com/vgpu.present": "false", **DRIVER_550,
        "gpunode.io/driver-flavour": "proprietary", "gpunode.io/ready": "true", **VERSION}
    assert want.condition == labels.Condition(
        "True", "GPUReady", "gpunode: the GPUs, driver, device nodes and container runtime are "
        "ready")


def test_nd96_node_labels_in_the_gpunode_stack(make_host: HostFactory) -> None:
    want = desired(make_host("nd96amsr-a100-v4", "ready"), on("gpunode"))
    assert want.labels == {
        "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.family": "ampere",
        "nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.machine": "Virtual-Machine",
        "nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.mode": "compute", "nvidia.com/mig.capable": "true",
        "nvidia.com/vgpu.present": "false", **DRIVER_550,
        "gpunode.io/driver-flavour": "open", "gpunode.io/ready": "true", **VERSION}
    assert want.condition.status == "True"


@pytest.mark.parametrize(("machine", "flavour"), [("nc4as-t4-v3", "proprietary"),
                                                  ("nd96amsr-a100-v4", "open")])
def test_beside_the_gpu_operator_gpunode_sets_only_its_own_labels_and_gpuready(
        make_host: HostFactory, machine: str, flavour: str) -> None:
    host = make_host(machine, "ready")
    want = desired(host, on("gpu-operator"))
    assert want.labels == {"gpunode.io/driver-flavour": flavour, "gpunode.io/ready": "true",
                           **VERSION}
    assert want.condition == desired(host, on("gpunode")).condition


def test_label_dry_run_json_on_the_nd96_beside_the_operator_shows_only_gpunodes_labels(
        make_host: HostFactory, cli: Cli) -> None:
    host = make_host("nd96amsr-a100-v4", "ready")
    config = host.root / "etc/gpunode/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[kubernetes]\nstack = "gpu-operator"\n')
    result = cli("--root", str(host.root), "label", "--dry-run", "--json")
    assert result.code == 0, result.err
    document = json.loads(result.out)
    assert (document["gpu"], document["labels"]) == (True, {
        "gpunode.io/driver-flavour": "open", "gpunode.io/ready": "true", **VERSION})
    assert document["condition"]["status"] == "True"


def test_user_labels_stay_beside_the_gpu_operator(make_host: HostFactory) -> None:
    config = AgentConfig(kubernetes=KubernetesConfig(stack="gpu-operator",
                                                     labels={"example.com/pool": "t4"}))
    assert desired(make_host("nc4as-t4-v3", "ready"), config).labels == {
        "gpunode.io/driver-flavour": "proprietary", "gpunode.io/ready": "true", **VERSION,
        "example.com/pool": "t4"}


def test_the_a10_vgpu_partition_says_vgpu_present(make_host: HostFactory) -> None:
    want = desired(make_host("nvads-a10-v5", "ready"), on("gpunode"))
    assert {k: want.labels[k] for k in ("nvidia.com/vgpu.present", "nvidia.com/gpu.compute.major",
                                        "nvidia.com/gpu.compute.minor",
                                        "nvidia.com/mig.capable")} == {
        "nvidia.com/vgpu.present": "true", "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "6", "nvidia.com/mig.capable": "false"}


UNKNOWN = fixtures.Machine("unknown-gpu", "a GPU no table names (10de:2b85)",
                           (fixtures.AZURE_NIC, fixtures.gpu("0001:00:00.0", "2b85", iommu=1)))


def test_an_unknown_gpu_gets_no_compute_memory_or_mig_label(make_host: HostFactory) -> None:
    want = desired(make_host(UNKNOWN, "ready"), on("gpunode"))
    assert not {k for k in want.labels if k.startswith(("nvidia.com/gpu.compute.",
                                                        "nvidia.com/mig."))}
    assert "nvidia.com/gpu.memory" not in want.labels
    assert want.labels["nvidia.com/gpu.mode"] == "compute"  # the PCI class says that much
    assert want.labels["nvidia.com/gpu.count"] == "1"


def test_config_space_a_non_root_reader_gets_leaves_vgpu_present_out(
        make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    config = host.root / "sys/devices/pci0001:00/0001:00:00.0/config"
    config.write_bytes(config.read_bytes()[:64])  # what sysfs gives a reader without root
    assert "nvidia.com/vgpu.present" not in desired(host, on("gpunode")).labels


@pytest.mark.parametrize(("driver", "cuda"), [
    ("535.216.03", (12, 2)), ("550.54.15", (12, 4)), ("570.195.03", (12, 8)),
    ("580.65.06", (13, 0)), ("470.256.02", (11, 4)),
    ("565.57.01", None),  # no CUDA toolkit release names R565
    ("999.1", None), ("x.1", None),
])
def test_cuda_runtime_version_by_driver_branch(driver: str, cuda: tuple[int, int] | None) -> None:
    assert gfd.cuda_version(driver) == cuda


@pytest.mark.parametrize(("classes", "mode"), [
    (["030200", "030200"], "compute"), (["030000"], "graphics"),
    (["030000", "030200"], "unknown"), (["038000"], "unknown"), ([], "unknown"),
])
def test_gpu_mode_follows_gfds_rule_for_pci_classes(classes: list[str | None], mode: str) -> None:
    assert gfd.gpu_mode(classes) == mode


@pytest.mark.parametrize(("ids", "capable"), [
    (["20b2", "1eb8"], True), (["1eb8"], False), (["1eb8", "2b85"], None), (["2b85", "2330"], True),
])
def test_mig_capable_when_any_gpu_is_and_unknown_leaves_it_open(
        ids: list[str | None], capable: bool | None) -> None:
    assert gfd.mig_capable(ids) is capable


def _config(chain: list[tuple[int, int, bytes]], status: int = 0x10) -> bytes:
    """256 bytes with the capabilities `chain` as (position, next, body after id/next)."""
    data = bytearray(256)
    data[0x06] = status
    data[0x34] = chain[0][0] if chain else 0
    for position, following, body in chain:
        data[position:position + 2 + len(body)] = bytes([0x09 if body else 0x05, following]) + body
    return bytes(data)


@pytest.mark.parametrize(("config", "vgpu"), [
    (_config([(0x60, 0, bytes([27]) + b"VF")]), True),
    (_config([(0x40, 0x60, b""), (0x60, 0, bytes([27]) + b"VF")]), True),
    (_config([(0x60, 0, bytes([20, 0, 0]))]), False),  # passthrough: no signature
    (_config([(0x60, 0x60, b"")]), False),  # a chain that loops ends
    (_config([(0x60, 0, bytes([27]) + b"VF")], status=0), False),  # no capability list
    (bytes(64), None), (None, None),
], ids=["vgpu", "vgpu-second", "passthrough", "loop", "no-list", "short", "missing"])
def test_the_vgpu_signature_is_read_as_gfd_reads_it(config: bytes | None,
                                                     vgpu: bool | None) -> None:
    assert gfd.is_vgpu(config) is vgpu


def test_beside_the_operator_labels_gpunode_set_before_are_left_to_it() -> None:
    current = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "1",
               "gpunode.io/driver-strategy": "prebuilt", "gpunode.io/ready": "true"}
    annotations = {labels.MANAGED_ANNOTATION: ",".join(sorted(current))}
    wanted = {"gpunode.io/ready": "true"}
    assert labels.label_patch(current, annotations, wanted,
                              labels.handed_over("gpu-operator")) == {"metadata": {
        "labels": {"gpunode.io/driver-strategy": None},
        "annotations": {labels.MANAGED_ANNOTATION: "gpunode.io/ready"}}}
    removed = labels.label_patch(current, annotations, wanted, labels.handed_over("gpunode"))
    assert set(removed["metadata"]["labels"]) == set(current) - set(wanted)  # type: ignore[index]


# -- deploy/: which stack each manifest belongs to ----------------------------------------------

_STACK_LINE = re.compile(r"# Stack: (gpunode|gpu-operator|both) ")


def deploy_stacks() -> dict[str, str]:
    found = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        match = _STACK_LINE.match(path.read_text().splitlines()[0])
        assert match, f"deploy/{path.name}: the first line must say '# Stack: ...'"
        found[path.name] = match.group(1)
    return found


def manifests(stack: str) -> list[tuple[str, dict[str, object]]]:
    """The documents of deploy/ a cluster of `stack` applies."""
    return [(name, doc) for name, owner in deploy_stacks().items() if owner in (stack, "both")
            for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def _runs_gpunodes_cluster_side(doc: dict[str, object]) -> bool:
    """A RuntimeClass, or values of NVIDIA's device plugin chart."""
    return doc.get("kind") == "RuntimeClass" or bool(
        {"runtimeClassName", "deviceListStrategy", "gfd", "nfd"} & set(doc) and "kind" not in doc)


def test_runtimeclass_and_device_plugin_manifests_are_only_in_the_gpunode_stack() -> None:
    gpunode = [name for name, doc in manifests("gpunode") if _runs_gpunodes_cluster_side(doc)]
    assert {"runtimeclass.yaml", "runtimeclass-toolkit-modes.yaml",
            "nvidia-device-plugin-values.yaml", "nvidia-device-plugin-values-cdi.yaml"} <= \
        set(gpunode)
    assert [name for name, doc in manifests("gpu-operator")
            if _runs_gpunodes_cluster_side(doc)] == []


def test_the_operator_stacks_pod_selects_and_tolerates_gpu_nodes_itself() -> None:
    """The Operator's RuntimeClass has no scheduling block, so the pod carries it."""
    pods = [doc for _, doc in manifests("gpu-operator") if doc.get("kind") == "Pod"]
    assert len(pods) == 1
    spec = pods[0]["spec"]
    assert spec["runtimeClassName"] == "nvidia"  # type: ignore[index]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}  # type: ignore[index]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        spec["tolerations"]  # type: ignore[index]


@pytest.mark.parametrize("form", ["kubeadm", "kubelet-flags", "cluster-azure"])
def test_beside_the_operator_a_node_registers_without_nvidia_gpu_present(form: str) -> None:
    taints = ("nvidia.com/gpu=present:NoSchedule",)
    own = registration.form(form, "gpu00", "Standard_NC4as_T4_v3", taints, {}, stack="gpunode")
    operator = registration.form(form, "gpu00", "Standard_NC4as_T4_v3", taints,
                                 {"team": "ml"}, stack="gpu-operator")
    assert "nvidia.com/gpu.present=true" in json.dumps(own)
    assert "nvidia.com/gpu.present" not in json.dumps(operator)
    assert "team=ml" in json.dumps(operator)
    # The taint stays: the Operator does not set it, and it keeps other pods off the node.
    assert json.dumps(own).count("NoSchedule") == json.dumps(operator).count("NoSchedule") == 1


def test_beside_the_operator_with_no_labels_the_kubelet_gets_no_empty_node_labels_flag() -> None:
    assert registration.kubelet_flags(("a=b:NoSchedule",), {}, stack="gpu-operator") == [
        "--register-with-taints=a=b:NoSchedule"]
    assert "kubeletExtraArgs" not in registration.kubeadm((), {}, stack="gpu-operator")[
        "nodeRegistration"]
