"""The Kubernetes CRI API (runtime.v1) as Python modules, generated at test time from api.proto.

    api = load()                      # .pb2 (messages) and .grpc (stubs)
    api.pb2.RunPodSandboxRequest(...) ; api.grpc.RuntimeServiceStub(channel)

Where api.proto comes from: Debian's `golang-k8s-cri-api-dev` (sid) ships the CRI API's Go
sources and with them `k8s.io/cri-api/pkg/apis/runtime/v1/api.proto` — the file kubelet and
crictl are generated from. It is fetched like the containerd .debs (tests/real/containerd_bins.py:
`apt-get download` against a private apt state, then `dpkg -x`), and only api.proto is kept:

    $GPUNODE_TEST_CACHE/cri-api/<package version>/api.proto

`grpc_tools.protoc` (pip grpcio-tools, a test dependency) compiles it into

    $GPUNODE_TEST_CACHE/cri-api/<package version>/python-<grpcio-tools version>/

once per grpcio-tools version (generated code needs a matching protobuf runtime). The file is
compiled as `cri_runtime_v1.proto`, so the modules are `cri_runtime_v1_pb2` and `_pb2_grpc`,
not the generic `api_pb2`. An flock on `cri-api/.lock` makes concurrent pytest processes fetch
and compile once. `make fetch-cri-api` (run before the tests) calls `python -m
gpunode_testing.cri_api`, so no test pays for the download.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PACKAGE = "golang-k8s-cri-api-dev"
SUITE = "sid"
PROTO_IN_PACKAGE = "usr/share/gocode/src/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto"
MODULE = "cri_runtime_v1"
DEFAULT_CACHE = Path("/var/cache/gpunode-tests")
CHECKOUT = Path(__file__).resolve().parents[2]  # installed editable from testing/
CONTAINERD_BINS = CHECKOUT / "tests" / "real" / "containerd_bins.py"
FETCH_TIMEOUT_S = 900


@dataclass(frozen=True)
class CriApi:
    """The generated modules and where they came from."""

    pb2: ModuleType  # messages: PodSandboxConfig, ContainerConfig, CDIDevice, ...
    grpc: ModuleType  # RuntimeServiceStub, ImageServiceStub
    proto: Path
    package_version: str


def cache_dir() -> Path:
    root = Path(os.environ.get("GPUNODE_TEST_CACHE") or DEFAULT_CACHE)
    return root / "cri-api"


def load() -> CriApi:
    """The CRI API modules: fetched and compiled on first use, imported once per process."""
    proto = ensure_proto()
    generated = ensure_compiled(proto)
    if str(generated) not in sys.path:
        sys.path.insert(0, str(generated))  # the _grpc module imports its _pb2 by bare name
    pb2 = importlib.import_module(f"{MODULE}_pb2")
    stubs = importlib.import_module(f"{MODULE}_pb2_grpc")
    return CriApi(pb2, stubs, proto, proto.parent.name)


def ensure_proto() -> Path:
    """api.proto of the newest package version in the cache; fetched when there is none."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        found = _cached_protos(directory)
        if not found:
            _fetch(directory)
            found = _cached_protos(directory)
    if not found:
        raise RuntimeError(f"fetching {PACKAGE} left no api.proto under {directory}")
    return found[-1]


def ensure_compiled(proto: Path) -> Path:
    """The directory with the generated modules of `proto` for this grpcio-tools version."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as err:
        raise RuntimeError("the CRI client needs grpcio and grpcio-tools (the `test` extra: "
                           "make setup installs them)") from err
    version = getattr(grpc_tools, "__version__", None) or _dist_version("grpcio-tools")
    target = proto.parent / f"python-{version}"
    with open(proto.parent.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / f"{MODULE}_pb2_grpc.py").exists():
            return target
        with tempfile.TemporaryDirectory(dir=proto.parent, prefix="compile-") as tmp_name:
            tmp = Path(tmp_name)
            shutil.copyfile(proto, tmp / f"{MODULE}.proto")
            out = tmp / "out"
            out.mkdir()
            # protoc's own include path (google/protobuf/*.proto) comes with grpc_tools.
            include = Path(protoc.__file__).parent / "_proto"
            code = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"-I{include}",
                                f"--python_out={out}", f"--grpc_python_out={out}",
                                str(tmp / f"{MODULE}.proto")])
            if code != 0 or not (out / f"{MODULE}_pb2_grpc.py").exists():
                raise RuntimeError(f"grpc_tools.protoc could not compile {proto} (exit {code})")
            out.rename(target)  # last: a directory in place means a complete compile
    return target


def _cached_protos(directory: Path) -> list[Path]:
    """Every complete api.proto in the cache, oldest package version first."""
    return sorted(directory.glob("*/api.proto"), key=lambda p: _version_key(p.parent.name))


def _version_key(version: str) -> list[tuple[int, str]]:
    """Enough of Debian's version order for the versions one package takes over time."""
    return [(int(part), "") if part.isdigit() else (-1, part)
            for part in re.split(r"[.~+-]", version)]


def _fetch(directory: Path) -> None:
    """apt-get download the package from Debian sid (private apt state) and keep api.proto."""
    bins = _containerd_bins()
    for stale in directory.glob("fetch-*"):  # left by a killed fetch; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix="fetch-") as tmp_name:
        tmp = Path(tmp_name)
        apt = bins._private_apt(tmp, SUITE)
        try:
            bins._run([*apt, "update", "-o", "APT::Update::Error-Mode=any"],
                      f"apt-get update for Debian {SUITE} failed (network or mirror down?)",
                      timeout=FETCH_TIMEOUT_S)
            bins._run([*apt, "download", PACKAGE],
                      f"apt-get download {PACKAGE} from Debian {SUITE} failed",
                      cwd=tmp, timeout=FETCH_TIMEOUT_S)
        except FileNotFoundError as err:
            raise RuntimeError(f"fetching the CRI API needs apt-get and dpkg: {err}") from err
        debs = sorted(tmp.glob(f"{PACKAGE}_*.deb"))
        if len(debs) != 1:
            raise RuntimeError(f"expected one {PACKAGE} .deb in {tmp}, found {debs}")
        bins._run(["dpkg", "-x", debs[0], tmp / "root"], f"dpkg -x {debs[0].name} failed")
        # golang-k8s-cri-api-dev_0.36.4-1_all.deb → 0.36.4-1 (an epoch would be "N%3a")
        version = debs[0].name.split("_")[1].replace("%3a", ":").split(":")[-1]
        entry = tmp / "entry"
        entry.mkdir()
        shutil.copyfile(tmp / "root" / PROTO_IN_PACKAGE, entry / "api.proto")
        (entry / "PACKAGE").write_text(debs[0].name + "\n")
        target = directory / version
        if target.exists():  # a partial entry (no api.proto): ours replaces it
            shutil.rmtree(target)
        entry.rename(target)


def _containerd_bins() -> ModuleType:
    """tests/real/containerd_bins.py of this checkout, whose private apt state and command
    runner fetch this package the same way as the containerd .debs (one implementation)."""
    for name in ("real.containerd_bins", "gpunode_testing._containerd_bins"):
        if name in sys.modules:  # pytest's import (`pythonpath = ["tests"]`), or ours
            return sys.modules[name]
    spec = importlib.util.spec_from_file_location("gpunode_testing._containerd_bins",
                                                  CONTAINERD_BINS)
    if spec is None or spec.loader is None or not CONTAINERD_BINS.exists():
        raise RuntimeError(f"{CONTAINERD_BINS} is missing: fetching needs the checkout")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def main() -> int:
    """Fetch and compile once (make fetch-cri-api), and say what is in the cache."""
    api = load()
    print(f"CRI API runtime.v1 from {PACKAGE} {api.package_version}: {api.proto}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, subprocess.SubprocessError) as err:
        print(f"gpunode_testing.cri_api: {err}", file=sys.stderr)
        sys.exit(1)
