"""Real containerd driven through the Kubernetes CRI, as the kubelet drives it, for tests.

    with cri_node(workdir, "nc4as-t4-v3", containerd_binary) as node:  # booted, CRI ready
        pod = node.cri.run_pod("gpu", runtime_handler="nvidia", log_directory=node.logs)
        ran = node.cri.run(pod, "probe", "ls -l /dev/nvidia0",
                           cdi_devices=["nvidia.com/gpu=0"])
        ran.exit_code, ran.output, node.runtime_calls()

`cri_node` boots a fixture GPU node (driver loaded, nothing configured) in the real-systemd
namespace as tests/integration/test_boot_systemd.py does (gpunode.service, Flatcar's
containerd.service, a stand-in kubelet; gpunode_testing.boot_harness), imports the image and
connects a `CriClient` (gRPC) to containerd's socket through the namespace's root
(/proc/PID/root/run/containerd/containerd.sock), so the client runs in the test's process.

The client is generated at test time from the CRI's own api.proto (gpunode_testing.cri_api);
the image is built here (gpunode_testing.cri_image) and imported with `ctr`. What the tests add
around a node that gpunode configures (`node_lines`), each for a reason of this machine:

  * The chosen containerd binary (1.7, 2.1 from the test cache) bind-mounted over
    /usr/bin/containerd, where Flatcar's containerd.service runs it.
  * Three keys in Flatcar's base config (/usr/share/containerd/config.toml, which gpunode copies
    to /etc and edits; `adapt_config`): the sandbox image is the local busybox image (no registry
    can be reached), the snapshotter is "native" (overlayfs on the namespace's overlay /var/lib
    is not possible), and `runc`'s BinaryName is a stand-in (next point). Nothing gpunode
    decides is among them.
  * A stand-in OCI runtime (`standin_runtime`) as runc's BinaryName and as
    /usr/bin/nvidia-container-runtime (the BinaryName gpunode configures for `nvidia`): it
    appends its argv to a record (a JSON line per call: which stand-in, argv) and execs the real
    runc (Debian 12's 1.1.5). For `create --bundle DIR` it changes two things in
    DIR/config.json that this machine cannot apply, nothing else:
      - a negative `process.oomScoreAdj` becomes 0. CRI gives the sandbox (pause) container
        -998, and this machine's kernel refuses any process lowering its oom_score_adj
        ("failed to update /proc/self/oom_score_adj: Permission denied"), which runc reports
        as "can't get final child's PID from pipe: EOF".
      - `linux.resources` classes whose cgroup2 controller the namespace's cgroup2 lacks are
        dropped (`RESOURCE_CONTROLLERS`): this machine runs cgroup v1 with an empty cgroup2
        beside it, so the namespace's cgroup2 has no cpu controller and runc fails on
        "openat2 …/cpu.weight: no such file". The device rules stay (runc applies them as an
        eBPF program, which needs no controller).
    Device nodes, mounts and env — what CDI injected — are runc's to apply, untouched.

The shim (`containerd-shim-runc-v2`, which runs the runtime) is the machine's, from Debian 12's
containerd 1.6 package, for every daemon version: only the `containerd` binary is fetched.
Why not crun: Debian 12's crun 1.8 refuses containerd 2.1's runtime spec ("unknown version
specified").
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpunode_testing import boot_harness, cri_api, fixtures
from gpunode_testing.cri_image import IMAGE, build_image
from gpunode_testing.systemd_ns import SystemdNamespace

RUNC = "/usr/sbin/runc"
NVIDIA_RUNTIME = "/usr/bin/nvidia-container-runtime"  # the BinaryName gpunode configures
TEST_RUNC = "/usr/local/bin/gpunode-test-runc"  # the `runc` runtime's BinaryName in the test
BASE_CONFIG = "/usr/share/containerd/config.toml"  # Flatcar's, on the overlaid /usr
SOCKET = "/run/containerd/containerd.sock"
CRI_V2 = 'plugins."io.containerd.grpc.v1.cri"'
# The runtime spec's linux.resources classes and the cgroup2 controller each needs; "devices"
# is not among them (on cgroup2 runc applies it as an eBPF program, no controller needed).
RESOURCE_CONTROLLERS = {"cpu": "cpu", "memory": "memory", "pids": "pids", "blockIO": "io",
                        "hugepageLimits": "hugetlb", "rdma": "rdma"}

# Run as `python -IS` (isolated, no site): the standard library only.
STANDIN = '''\
#!{python} -IS
"""Stand-in OCI runtime {name!r} (gpunode_testing.cri): records its argv, then is runc."""
import json, os, sys
args = sys.argv[1:]
line = json.dumps({{"runtime": {name!r}, "argv": args}}) + "\\n"
fd = os.open({record!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(fd, line.encode())  # one write of O_APPEND: whole lines, whoever calls at once
os.close(fd)
if "--bundle" in args:
    # What this machine cannot apply (gpunode_testing.cri's docstring says why).
    path = os.path.join(args[args.index("--bundle") + 1], "config.json")
    with open(path) as f:
        spec = json.load(f)
    process = spec.get("process", {{}})
    if process.get("oomScoreAdj", 0) < 0:
        process["oomScoreAdj"] = 0
    try:
        with open("/sys/fs/cgroup/cgroup.controllers") as f:
            controllers = set(f.read().split())
    except OSError:
        controllers = set()
    resources = spec.get("linux", {{}}).get("resources", {{}})
    for key, controller in {controllers!r}.items():
        if key in resources and controller not in controllers:
            del resources[key]
    with open(path + ".standin", "w") as f:
        json.dump(spec, f)
    os.replace(path + ".standin", path)
os.execv({runc!r}, [{runc!r}, *args])
'''


class CriError(RuntimeError):
    """A CRI call failed or a container did not finish; the message says which and why."""


def standin_runtime(name: str, record: Path, runc: str = RUNC) -> str:
    """The stand-in runtime's script (see the module docstring)."""
    return STANDIN.format(python=sys.executable, name=name, record=str(record), runc=runc,
                          controllers=RESOURCE_CONTROLLERS)


def adapt_config(text: str, sandbox_image: str = IMAGE, runc_binary: str = TEST_RUNC) -> str:
    """Flatcar's base config (version 2) with the test's three keys, each in its table: put
    in after the table's header, or as the table at the end where the file has none (TOML
    allows a table after its sub-tables)."""
    mark = "  # gpunode_testing.cri: test environment"
    keys = {f"[{CRI_V2}]": f'sandbox_image = "{sandbox_image}"',
            f"[{CRI_V2}.containerd]": 'snapshotter = "native"',
            f"[{CRI_V2}.containerd.runtimes.runc.options]": f'BinaryName = "{runc_binary}"'}
    lines = text.splitlines()
    for header, key in keys.items():
        if header in lines:
            lines.insert(lines.index(header) + 1, key + mark)
        else:
            lines += ["", header, key + mark]
    return "\n".join(lines) + "\n"


def node_lines(workdir: Path, containerd: Path, base_config: str) -> list[str]:
    """Shell lines for SystemdNamespace's prepare, after boot_harness.node_prepare: the
    containerd binary, the stand-in runtimes and the adapted base config (module docstring).
    The stand-ins record into workdir/runtime-calls.jsonl (read it with `runtime_calls`)."""
    files = workdir / "cri-node"
    files.mkdir(parents=True, exist_ok=True)
    record = workdir / "runtime-calls.jsonl"
    (files / "nvidia-container-runtime").write_text(
        standin_runtime("nvidia-container-runtime", record))
    (files / "runc").write_text(standin_runtime("runc", record))
    (files / "config.toml").write_text(adapt_config(base_config))
    q = shlex.quote
    return [f"mount -n --bind {q(str(containerd))} /usr/bin/containerd",
            f"install -m 755 {q(str(files / 'nvidia-container-runtime'))} {NVIDIA_RUNTIME}",
            f"install -D -m 755 {q(str(files / 'runc'))} {TEST_RUNC}",
            f"install -m 644 {q(str(files / 'config.toml'))} {BASE_CONFIG}"]


def runtime_calls(workdir: Path) -> list[dict[str, Any]]:
    """What the stand-in runtimes recorded, oldest first: {"runtime": name, "argv": [...]}."""
    path = workdir / "runtime-calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@dataclass(frozen=True)
class Pod:
    id: str
    config: Any  # the PodSandboxConfig message it was run with
    log_directory: Path


@dataclass(frozen=True)
class PodStatus:
    state: str  # "SANDBOX_READY" / "SANDBOX_NOTREADY"
    runtime_handler: str
    info: dict[str, Any]  # verbose info: containerd's own view ("info" JSON), parsed


@dataclass(frozen=True)
class Ran:
    container_id: str
    exit_code: int
    output: str  # stdout and stderr as CRI's log file has them, in order


class CriClient:
    """A typed client of containerd's CRI RuntimeService (runtime.v1) on a unix socket."""

    def __init__(self, socket: Path | str, *, timeout: float = 30.0) -> None:
        import grpc

        self.api = cri_api.load()
        self.pb2 = self.api.pb2
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self.runtime = self.api.grpc.RuntimeServiceStub(self._channel)

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: Any) -> Any:
        import grpc

        try:
            return getattr(self.runtime, method)(request, timeout=self.timeout)
        except grpc.RpcError as err:
            raise CriError(f"CRI {method} failed: {err.code().name}: {err.details()}") from None

    def version(self) -> tuple[str, str]:
        """(runtime name, runtime version), e.g. ("containerd", "2.1.9+ds1")."""
        answer = self._call("Version", self.pb2.VersionRequest())
        return answer.runtime_name, answer.runtime_version

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the CRI plugin answers Status with RuntimeReady (network needs no CNI here:
        pods use the node's network)."""
        import grpc

        deadline = time.monotonic() + timeout
        while True:
            try:
                status = self.runtime.Status(self.pb2.StatusRequest(), timeout=5)
                conditions = {c.type: c for c in status.status.conditions}
                ready = conditions.get("RuntimeReady")
                if ready is not None and ready.status:
                    return
                why = ready.message if ready is not None else "no RuntimeReady condition"
            except grpc.RpcError as err:
                why = f"{err.code().name}: {err.details()}"
            if time.monotonic() > deadline:
                raise CriError(f"containerd's CRI was not ready within {timeout} s: {why}")
            time.sleep(0.1)

    def run_pod(self, name: str, *, log_directory: Path, runtime_handler: str = "") -> Pod:
        """RunPodSandbox on the node's network (no CNI), logs under log_directory, in the
        cgroup the kubelet's systemd driver gives a best-effort pod (Flatcar's containerd
        config has SystemdCgroup = true, so runc wants a slice)."""
        pb2 = self.pb2
        log_directory.mkdir(parents=True, exist_ok=True)
        uid = secrets.token_hex(8)
        config = pb2.PodSandboxConfig(
            metadata=pb2.PodSandboxMetadata(name=name, uid=uid, namespace="default"),
            log_directory=str(log_directory),
            linux=pb2.LinuxPodSandboxConfig(
                cgroup_parent=f"kubepods-besteffort-pod{uid}.slice",
                security_context=pb2.LinuxSandboxSecurityContext(
                    namespace_options=pb2.NamespaceOption(network=pb2.NODE))))
        answer = self._call("RunPodSandbox", pb2.RunPodSandboxRequest(
            config=config, runtime_handler=runtime_handler))
        return Pod(answer.pod_sandbox_id, config, log_directory)

    def pod_status(self, pod: Pod) -> PodStatus:
        """PodSandboxStatus(verbose): the state, the runtime handler and containerd's info."""
        answer = self._call("PodSandboxStatus", self.pb2.PodSandboxStatusRequest(
            pod_sandbox_id=pod.id, verbose=True))
        info = {key: json.loads(value) for key, value in answer.info.items()}
        return PodStatus(self.pb2.PodSandboxState.Name(answer.status.state),
                         answer.status.runtime_handler, info)

    def run(self, pod: Pod, name: str, script: str, *, cdi_devices: Iterable[str] = (),
            annotations: Mapping[str, str] | None = None, timeout: float = 30.0,
            image: str = IMAGE) -> Ran:
        """`/bin/sh -c script` in a new container of `pod` (CDI devices through CRI's
        CDIDevices field, or `cdi.k8s.io/…` annotations): create, start, wait for its exit,
        and its log. A last line the script cannot print marks the log complete (the shim
        copies the output to the file on its own time)."""
        end = f"gpunode-cri-end-{secrets.token_hex(4)}"
        wrapped = f"( {script}\n)\ncode=$?\necho {end}\nexit $code"
        container = self.start_container(pod, name, ["/bin/sh", "-c", wrapped],
                                         cdi_devices=cdi_devices, annotations=annotations,
                                         image=image)
        code = self.wait_exited(container, timeout)
        deadline = time.monotonic() + 5
        while (end + "\n") not in (output := self.log(pod, name)):
            if time.monotonic() > deadline:
                raise CriError(f"container {name} exited ({code}) but its log has no end "
                               f"line after 5 s:\n{output}")
            time.sleep(0.05)
        return Ran(container, code, output.replace(end + "\n", ""))

    def start_container(self, pod: Pod, name: str, command: Sequence[str], *,
                        cdi_devices: Iterable[str] = (),
                        annotations: Mapping[str, str] | None = None,
                        image: str = IMAGE) -> str:
        pb2 = self.pb2
        config = pb2.ContainerConfig(
            metadata=pb2.ContainerMetadata(name=name), image=pb2.ImageSpec(image=image),
            command=list(command), log_path=f"{name}.log",
            annotations=dict(annotations or {}),
            CDI_devices=[pb2.CDIDevice(name=device) for device in cdi_devices])
        created = self._call("CreateContainer", pb2.CreateContainerRequest(
            pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config))
        self._call("StartContainer", pb2.StartContainerRequest(
            container_id=created.container_id))
        return str(created.container_id)

    def wait_exited(self, container: str, timeout: float = 30.0) -> int:
        """The container's exit code, once CRI reports it exited."""
        deadline = time.monotonic() + timeout
        while True:
            status = self._call("ContainerStatus", self.pb2.ContainerStatusRequest(
                container_id=container)).status
            if status.state == self.pb2.CONTAINER_EXITED:
                return int(status.exit_code)
            if time.monotonic() > deadline:
                state = self.pb2.ContainerState.Name(status.state)
                raise CriError(f"container {container} did not exit within {timeout} s "
                               f"({state}: {status.reason} {status.message})")
            time.sleep(0.05)

    @staticmethod
    def log(pod: Pod, name: str) -> str:
        """The container's output from its CRI log file (`<time> <stream> <P|F> <text>`
        lines; P is a partial line the next one continues)."""
        path = pod.log_directory / f"{name}.log"
        out, partial = [], ""
        for line in (path.read_text() if path.exists() else "").splitlines():
            fields = line.split(" ", 3)
            if len(fields) < 3:
                continue
            text = fields[3] if len(fields) == 4 else ""
            if fields[2] == "P":
                partial += text
            else:
                out.append(partial + text)
                partial = ""
        return "\n".join(out) + ("\n" if out else "")


@dataclass
class CriNode:
    """A booted fixture node with containerd's CRI ready (see `cri_node`)."""

    ns: SystemdNamespace
    cri: CriClient
    workdir: Path
    machine: fixtures.Machine

    @property
    def logs(self) -> Path:
        """A directory for pod logs, the same path inside the namespace and out."""
        return self.workdir / "pod-logs"

    def runtime_calls(self) -> list[dict[str, Any]]:
        return runtime_calls(self.workdir)

    def cdi_spec(self, path: str = "/var/run/cdi/nvidia.yaml") -> dict[str, Any]:
        """The CDI spec on the node (gpunode boot writes it), parsed."""
        return dict(yaml.safe_load(self.ns.run(["cat", path]).stdout))

    def host_path(self, path: str) -> Path:
        """A path of the node as the test's process reaches it (the namespace's root)."""
        return Path(f"/proc/{self.ns.pid}/root{path}")


@contextlib.contextmanager
def cri_node(workdir: Path, machine: str, containerd: Path, *, state: str = "driver",
             build: Callable[[Path, fixtures.Options], object] | None = None,
             images: Sequence[Path] = ()) -> Iterator[CriNode]:
    """Boot `machine` with `containerd` (a binary from the test cache) and yield it with CRI
    ready and the image imported; the namespace goes away on exit. workdir: a fresh
    directory outside /tmp, /var/tmp and /run (boot_harness.WORK_PARENT/…). `build` makes the
    fixture instead of fixtures.build (e.g. with the driver's real files: real_driver), given
    the directory and the options the namespace needs; `images`: more OCI image tars (under
    workdir) to import."""
    spec = fixtures.MACHINES[machine]
    fixture = workdir / "fixture"
    options = fixtures.Options(state=state, flat_sysfs=True, dev_nodes="plain")
    if build is None:
        fixtures.build(spec, fixture, options)
    else:
        build(fixture, options)
    build_image(workdir / "image.tar")
    units = {"gpunode.service": (boot_harness.UNITS / "gpunode.service").read_text(),
             "containerd.service": boot_harness.CONTAINERD_UNIT,
             "kubelet.service": boot_harness.KUBELET_UNIT}
    base = (fixture / BASE_CONFIG.lstrip("/")).read_text()
    prepare = boot_harness.node_prepare(fixture) + node_lines(workdir, containerd, base)
    with SystemdNamespace(units, workdir, overlays=("usr", "var/lib"), enable=tuple(units),
                          prepare=prepare) as ns:
        ns.wait_active("containerd.service")
        # --no-unpack: CRI unpacks into its own snapshotter ("native") when it needs the
        # image; ctr (1.6, the machine's) would unpack into overlayfs, impossible here.
        for tar in (workdir / "image.tar", *images):
            ns.run(["ctr", "-a", SOCKET, "-n", "k8s.io", "images", "import", "--no-unpack",
                    str(tar)])
        with CriClient(f"/proc/{ns.pid}/root{SOCKET}") as client:
            client.wait_ready()
            yield CriNode(ns, client, workdir, spec)


def work_directory(prefix: str) -> Path:
    """A fresh directory for `cri_node` under boot_harness.WORK_PARENT; remove it after."""
    path = boot_harness.WORK_PARENT / f"{prefix}-{secrets.token_hex(4)}"
    path.mkdir(parents=True)
    return path


def remove_work_directory(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
