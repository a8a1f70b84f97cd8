"""Containers get their GPUs from what `gpunode boot` configured, through real containerd's CRI.

A fixture node with its driver loaded and nothing else configured (T4; the 8-GPU ND96) boots in
the real-systemd namespace: gpunode.service takes it to ready, then Flatcar's containerd.service
starts (containerd 2.1 or 1.7 from the test cache, bind-mounted over /usr/bin/containerd). The
test then makes the kubelet's calls over containerd's CRI socket — RunPodSandbox with a runtime
handler, CreateContainer with CDI devices (the CRI `CDIDevices` field, or a `cdi.k8s.io/`
annotation) — with a client generated from the CRI's api.proto, and looks inside each container
from its log. Real: containerd, its CRI plugin and CDI library, the shim, runc, systemd, the CRI
API, gpunode's config and CDI spec. Not real: the GPU (the fixture's device numbers have no
driver behind them; libraries and nvidia-smi are small stand-ins) and, for this machine, two
numbers of the runtime spec (gpunode_testing.cri says which and why). One boot per (machine,
containerd version); the tests of one node share it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode_testing import cri, cri_image, fixtures
from gpunode_testing.cri import CriNode, Pod
from gpunode_testing.systemd_ns import MACHINE_PATHS
from real.containerd_bins import ensure_binary

pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS, str(cri_image.BUSYBOX))

T4, ND96 = "nc4as-t4-v3", "nd96amsr-a100-v4"
CONTAINERD_2 = pytest.param("2", id="containerd-2.1")
CONTAINERD_17 = pytest.param("1.7", id="containerd-1.7")
GPU0 = "nvidia.com/gpu=0"
NVIDIA_MAJOR = 195  # the driver's fixed major: nvidiaN is 195:N, nvidiactl 195:255
CONTROL_NODES = {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}


def boot(request: pytest.FixtureRequest, machine: str) -> Iterator[CriNode]:
    binary = ensure_binary(request.param)
    workdir = cri.work_directory("cri")
    try:
        with cri.cri_node(workdir, machine, binary.path) as node:
            yield node
    finally:
        cri.remove_work_directory(workdir)


@pytest.fixture(scope="module")
def t4(request: pytest.FixtureRequest) -> Iterator[CriNode]:
    """The T4 node booted once per containerd version (indirect parameter)."""
    yield from boot(request, T4)


@pytest.fixture(scope="module")
def nd96(request: pytest.FixtureRequest) -> Iterator[CriNode]:
    yield from boot(request, ND96)


def gpu_pod(node: CriNode, name: str = "gpu", handler: str = "nvidia") -> Pod:
    return node.cri.run_pod(name, runtime_handler=handler, log_directory=node.logs / name)


def declared(spec: dict[str, Any], device: str) -> dict[str, list[Any]]:
    """What the spec gives a container asking for `device`: its own edits and the common ones."""
    (own,) = [d["containerEdits"] for d in spec["devices"] if d["name"] == device]
    edits: dict[str, list[Any]] = defaultdict(list)
    for part in (spec.get("containerEdits", {}), own):
        for key, values in part.items():
            edits[key] += values
    return edits


def probe_script(edits: dict[str, list[Any]]) -> str:
    """Shell run in the container: its NVIDIA nodes with type and numbers, each mount of the
    spec (present, and the same file as every other path mounted from the same host file),
    its env, and nvidia-smi found on PATH and run."""
    by_host: dict[str, list[str]] = defaultdict(list)
    for mount in edits.get("mounts", []):
        by_host[mount["hostPath"]].append(mount["containerPath"])
    lines = ["for f in /dev/nvidia* /dev/nvidia-caps/*; do",
             "  [ -e \"$f\" ] && stat -c 'node %n %F %t %T' \"$f\"; done"]
    for paths in by_host.values():
        first = shlex.quote(paths[0])
        for path in map(shlex.quote, paths):
            lines.append(f"[ -e {path} ] && [ {path} -ef {first} ] && echo mounted {path}")
    lines += ["env | sed 's/^/env /'", "echo which $(which nvidia-smi)",
              "nvidia-smi && echo nvidia-smi ran", "ls -l /dev/nvidia0 || :"]
    return "\n".join(lines)


def parse(output: str) -> tuple[dict[str, tuple[str, int, int]], set[str], set[str], str]:
    """(device node → (type, major, minor), mounted paths, env entries, other lines)."""
    nodes, mounts, env, rest = {}, set(), set(), []
    for line in output.splitlines():
        kind, _, value = line.partition(" ")
        if kind == "node":
            path, *kind_words, major, minor = value.split(" ")
            nodes[path] = (" ".join(kind_words), int(major, 16), int(minor, 16))
        elif kind == "mounted":
            mounts.add(value)
        elif kind == "env":
            env.add(value)
        else:
            rest.append(line)
    return nodes, mounts, env, "\n".join(rest)


def host_numbers(node: CriNode, path: str) -> tuple[str, int, int]:
    """A device node of the node itself (made by gpunode boot), as the container shows it."""
    rdev = os.stat(node.host_path(path)).st_rdev
    return "character special file", os.major(rdev), os.minor(rdev)


def assert_sees_exactly(node: CriNode, output: str, device: str) -> dict[str, Any]:
    """The container has the spec's nodes for `device` (numbers as on the node), no other
    NVIDIA node, every mount, the SONAME paths the same file as the versioned library, the
    spec's env, and nvidia-smi on PATH."""
    edits = declared(node.cdi_spec(), device)
    nodes, mounts, env, rest = parse(output)
    want = {d["path"]: host_numbers(node, d.get("hostPath", d["path"]))
            for d in edits["deviceNodes"]}
    assert nodes == want, output
    assert mounts == {m["containerPath"] for m in edits["mounts"]}, output
    version = re.compile(r"libcuda\.so\.\d+\.\d+")
    assert any(version.search(m) for m in mounts) and \
        "/usr/local/nvidia/lib64/libcuda.so.1" in mounts, output  # same file: -ef above
    spec_env = {f"{e}" for e in edits.get("env", [])}
    assert spec_env <= env, output
    assert "LD_LIBRARY_PATH=/usr/local/nvidia/lib64" in env, output
    assert "which /usr/local/nvidia/bin/nvidia-smi" in rest and "nvidia-smi ran" in rest, output
    return nodes


def run_probe(node: CriNode, pod: Pod, name: str, device: str, **request: Any) -> str:
    ran = node.cri.run(pod, name, probe_script(declared(node.cdi_spec(), device)), **request)
    assert ran.exit_code == 0, ran.output
    return ran.output


def creates(node: CriNode, container: str) -> list[str]:
    """Which stand-in runtimes ran `create` for this sandbox or container."""
    return [c["runtime"] for c in node.runtime_calls()
            if "create" in c["argv"] and c["argv"][-1] == container]


def gpunode_status(node: CriNode) -> dict[str, Any]:
    done = node.ns.run(["/usr/bin/gpunode", "--log-format", "json", "status", "--json"],
                       check=False)
    return dict(json.loads(done.stdout))


def assert_containerd_started_once(node: CriNode) -> None:
    props = node.ns.unit_properties("containerd.service", "NRestarts", "ActiveState")
    started = [e for e in node.ns.journal("containerd.service")
               if str(e.get("MESSAGE", "")).startswith("Started ")]
    assert (props["ActiveState"], props["NRestarts"], len(started)) == ("active", "0", 1)


@pytest.mark.parametrize("t4", [CONTAINERD_2, CONTAINERD_17], indirect=True)
def test_boot_takes_the_bare_t4_node_to_ready_with_containerd_started_once(
        t4: CriNode, request: pytest.FixtureRequest) -> None:
    status = gpunode_status(t4)
    failed = [c for c in status["checks"] if c["state"] not in ("ok", "skip")]
    assert (status["verdict"], status["ready"]) == ("ready", True), failed
    assert_containerd_started_once(t4)
    runtime, version = t4.cri.version()  # the daemon answering is the binary under test
    assert runtime == "containerd"
    assert version.startswith(request.node.callspec.params["t4"] + "."), version


@pytest.mark.parametrize("t4", [CONTAINERD_2, CONTAINERD_17], indirect=True)
def test_a_pod_with_runtime_handler_nvidia_runs_through_nvidia_container_runtime(
        t4: CriNode) -> None:
    pod = gpu_pod(t4, "handler")
    status = t4.cri.pod_status(pod)
    assert (status.state, status.runtime_handler) == ("SANDBOX_READY", "nvidia")
    info = status.info["info"]
    assert info["runtimeType"] == "io.containerd.runc.v2"
    assert info["runtimeOptions"]["binary_name"] == cri.NVIDIA_RUNTIME
    assert creates(t4, pod.id) == ["nvidia-container-runtime"]  # the stand-in's own record
    ran = t4.cri.run(pod, "plain", "ls /dev | grep nvidia || echo no-nvidia-nodes; "
                     "[ -e /usr/local/nvidia ] || echo no-driver-files")
    assert ran.exit_code == 0, ran.output
    assert creates(t4, ran.container_id) == ["nvidia-container-runtime"]
    # The handler alone injects nothing here (CDI does, below): no GPU without asking for one.
    assert ran.output == "no-nvidia-nodes\nno-driver-files\n", ran.output
    assert_containerd_started_once(t4)


@pytest.mark.parametrize("t4", [CONTAINERD_2, CONTAINERD_17], indirect=True)
def test_a_container_sees_exactly_the_gpu_it_asks_for_by_cdi_devices_and_by_annotation(
        t4: CriNode) -> None:
    pod = gpu_pod(t4, "cdi")
    for name, request in (("by-field", {"cdi_devices": [GPU0]}),
                          ("by-annotation",
                           {"annotations": {"cdi.k8s.io/nvidia-device-plugin_0": GPU0}})):
        output = run_probe(t4, pod, name, "0", **request)
        nodes = assert_sees_exactly(t4, output, "0")
        assert nodes["/dev/nvidia0"] == ("character special file", NVIDIA_MAJOR, 0), output
        assert set(nodes) == {"/dev/nvidia0", "/dev/nvidia-modeset"} | CONTROL_NODES, output
        assert re.search(r"^crw\S* .* 195, +0 .*/dev/nvidia0$", output, re.M), output
    assert_containerd_started_once(t4)


@pytest.mark.parametrize("t4", [CONTAINERD_2, CONTAINERD_17], indirect=True)
def test_cdi_needs_no_nvidia_runtime_a_default_runc_pod_gets_the_gpu(t4: CriNode) -> None:
    # The device plugin's cdi-cri strategy: the default handler (runc), the GPU by CDI alone.
    pod = gpu_pod(t4, "cdi-runc", handler="")
    assert t4.cri.pod_status(pod).runtime_handler in ("", "runc")
    output = run_probe(t4, pod, "probe", "0", cdi_devices=[GPU0])
    assert_sees_exactly(t4, output, "0")
    assert creates(t4, pod.id) == ["runc"]


@pytest.mark.parametrize("nd96", [CONTAINERD_2], indirect=True)
def test_gpu_all_on_the_nd96_gives_eight_gpu_nodes_and_the_control_nodes(nd96: CriNode) -> None:
    status = gpunode_status(nd96)
    assert status["verdict"] == "ready", [c for c in status["checks"] if c["state"] != "ok"]
    pod = gpu_pod(nd96)
    nodes = assert_sees_exactly(nd96, run_probe(nd96, pod, "all", "all",
                                                cdi_devices=["nvidia.com/gpu=all"]), "all")
    gpus = {path: numbers for path, numbers in nodes.items()
            if re.fullmatch(r"/dev/nvidia\d+", path)}
    assert gpus == {f"/dev/nvidia{i}": ("character special file", NVIDIA_MAJOR, i)
                    for i in range(8)}
    assert set(nodes) >= CONTROL_NODES
    # One GPU by index: its node only, with the same control nodes.
    one = assert_sees_exactly(nd96, run_probe(nd96, pod, "three", "3",
                                              cdi_devices=["nvidia.com/gpu=3"]), "3")
    assert {p for p in one if re.fullmatch(r"/dev/nvidia\d+", p)} == {"/dev/nvidia3"}
    assert_containerd_started_once(nd96)


# The harness's own changes, each shown to be only what it says.

def test_the_standin_runtime_changes_only_what_this_machine_cannot_apply(tmp_path: Path) -> None:
    spec = {"ociVersion": "1.2.1", "process": {"oomScoreAdj": -998, "args": ["/pause"]},
            "linux": {"resources": {"cpu": {"shares": 2}, "devices": [
                {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rwm"}]},
                "devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]},
            "mounts": [{"destination": "/usr/local/nvidia/bin/nvidia-smi", "type": "bind"}]}
    (tmp_path / "config.json").write_text(json.dumps(spec))
    standin = tmp_path / "runtime"
    standin.write_text(cri.standin_runtime("nvidia-container-runtime", tmp_path / "calls.jsonl",
                                           runc="/bin/echo"))
    standin.chmod(0o755)
    argv = ["--root", "/run/r", "create", "--bundle", str(tmp_path), "id1"]
    done = subprocess.run([str(standin), *argv], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, " ".join(argv) + "\n")  # then it is runc
    assert [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()] \
        == [{"runtime": "nvidia-container-runtime", "argv": argv}]
    after = json.loads((tmp_path / "config.json").read_text())
    controllers = cri.RESOURCE_CONTROLLERS
    want = copy.deepcopy(spec)
    want["process"]["oomScoreAdj"] = 0
    if controllers["cpu"] not in _cgroup2_controllers():
        del want["linux"]["resources"]["cpu"]
    assert after == want  # device nodes, device rules and mounts untouched


def _cgroup2_controllers() -> set[str]:
    path = Path("/sys/fs/cgroup/cgroup.controllers")
    return set(path.read_text().split()) if path.exists() else set()


def test_the_base_config_gets_the_three_test_keys_in_either_shape_of_flatcars_file() -> None:
    fixture_shape = fixtures.FLATCAR_CONTAINERD_CONFIG
    flatcar_shape = fixture_shape.replace('[plugins."io.containerd.grpc.v1.cri".containerd]\n',
                                          '[plugins."io.containerd.grpc.v1.cri".containerd.'
                                          'runtimes.runc]\n')
    for text in (fixture_shape, flatcar_shape):
        cri_table = tomllib.loads(cri.adapt_config(text))["plugins"]["io.containerd.grpc.v1.cri"]
        before = tomllib.loads(text)["plugins"]["io.containerd.grpc.v1.cri"]
        assert cri_table["sandbox_image"] == cri_image.IMAGE
        assert cri_table["containerd"]["snapshotter"] == "native"
        options = cri_table["containerd"]["runtimes"]["runc"]["options"]
        assert options == {**before["containerd"]["runtimes"]["runc"]["options"],
                           "BinaryName": cri.TEST_RUNC}


def test_the_local_image_is_the_same_bytes_every_build(tmp_path: Path) -> None:
    first = cri_image.build_image(tmp_path / "a.tar")
    assert cri_image.build_image(tmp_path / "b.tar") == first
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
