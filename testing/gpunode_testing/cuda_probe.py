"""A real CUDA program and a glibc image to run it in, built here, for the CDI tests.

    probe = ensure_probe()                          # compiled once per test cache
    rootfs = make_rootfs(tmp / "rootfs", probe)     # for podman --rootfs
    build_image(tmp / "cuda.tar", rootfs)           # for `ctr -n k8s.io images import`
    run_here(probe, libcuda_dir)                    # this machine, LD_LIBRARY_PATH at libcuda

The program (SOURCE) is host code only: it asks the CUDA runtime for its own version
(cudaRuntimeGetVersion), the driver's (cudaDriverGetVersion: 0 when there is no libcuda) and the
device count (cudaGetDeviceCount, whose error says how far it got: cudaErrorInsufficientDriver
without a usable libcuda, cudaErrorNoDevice when libcuda loads but no GPU answers), and prints
one `key value` line each. What it proves in a container is that the driver's real libcuda was
mounted where the dynamic loader finds it, with everything libcuda itself loads beside it.

Where the CUDA runtime comes from: PyPI's wheels, downloaded with pip (no install) into the test
cache: `nvidia-cuda-runtime-cu12` (libcudart.so.12, cuda_runtime_api.h) and
`nvidia-cuda-nvcc-cu12` (only for the `crt/host_config.h` the runtime headers include; the wheel
has ptxas but no nvcc). gcc compiles and links the program against libcudart.so.12 with a
RUNPATH of /usr/local/cuda/lib64, where the image has libcudart (as NVIDIA's CUDA images do).

The image: glibc from this machine's Debian `libc6` package (its shared libraries, as
`dpkg -L libc6` lists them; libcuda needs libc, libm, libdl, libpthread, librt), busybox-static
for a shell, the program in /usr/local/bin and libcudart in /usr/local/cuda/lib64; its
environment is a CUDA image's (LD_LIBRARY_PATH=/usr/local/nvidia/lib64, where gpunode's
hook-free spec mounts the driver's libraries). Layout of the cache:

    $GPUNODE_TEST_CACHE/cuda/<runtime version>/       (default /var/cache/gpunode-tests)
        wheels/*.whl, runtime/ (the runtime wheel's nvidia/cuda_runtime), crt/ (include/crt of
        the nvcc wheel), cuda-probe.c, cuda-probe (the program), BUILD (JSON)

`python -m gpunode_testing.cuda_probe` fills it (make's fetch-cuda target); an flock on
cuda/.lock makes concurrent pytest processes build once.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gpunode_testing.cri_image import image_layout

RUNTIME_WHEEL = ("nvidia-cuda-runtime-cu12", "12.9.79")
NVCC_WHEEL = ("nvidia-cuda-nvcc-cu12", "12.9.86")
RUNTIME_VERSION = 12090  # what cudaRuntimeGetVersion answers for CUDA 12.9
DEFAULT_CACHE = Path("/var/cache/gpunode-tests")
BUSYBOX = Path("/bin/busybox")  # busybox-static's
# What make_rootfs reads of this machine (for the tests' allow_paths): busybox and glibc.
MACHINE_PATHS = (str(BUSYBOX), "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64",
                 "/usr/lib64")
IMAGE = "localhost/gpunode-test/cuda-probe:1"
PROBE_PATH = "/usr/local/bin/cuda-probe"
CUDART_DIR = "/usr/local/cuda/lib64"
ENV = ("PATH=/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "LD_LIBRARY_PATH=/usr/local/nvidia/lib64")
FETCH_TIMEOUT_S = 900

SOURCE = r"""
/* gpunode_testing.cuda_probe: how far the CUDA runtime gets with the driver it finds. */
#include <stdio.h>
#include <cuda_runtime_api.h>

int main(void) {
    int runtime = 0, driver = 0, count = -1;
    cudaError_t err = cudaRuntimeGetVersion(&runtime);
    printf("runtime %d %s\n", runtime, cudaGetErrorName(err));
    err = cudaDriverGetVersion(&driver);
    printf("driver %d %s\n", driver, cudaGetErrorName(err));
    err = cudaGetDeviceCount(&count);
    printf("devices %d %s\n", err == cudaSuccess ? count : 0, cudaGetErrorName(err));
    return 0;
}
"""


@dataclass(frozen=True)
class Probe:
    """The compiled program and the runtime it links against."""

    binary: Path
    cudart: Path  # libcudart.so.12
    build: dict[str, object]


@dataclass(frozen=True)
class Answer:
    """What the program printed: each call's value and the error's name."""

    runtime: int
    runtime_error: str
    driver: int
    driver_error: str
    devices: int
    devices_error: str


def cache_dir() -> Path:
    root = Path(os.environ.get("GPUNODE_TEST_CACHE") or DEFAULT_CACHE)
    return root / "cuda" / RUNTIME_WHEEL[1]


def recipe() -> str:
    """A cached build is reused while this file is unchanged (the source, the wheels)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def ensure_probe() -> Probe:
    """The compiled program, built (wheels downloaded, gcc run) the first time."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            build = json.loads((directory / "BUILD").read_text())
        except (OSError, ValueError):
            build = {}
        if build.get("recipe") != recipe():
            build = _build(directory)
    return Probe(directory / "cuda-probe", directory / "runtime/lib/libcudart.so.12", build)


def _build(directory: Path) -> dict[str, object]:
    for stale in ("wheels", "runtime", "crt", "cuda-probe", "BUILD"):
        path = directory / stale
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    started = time.monotonic()
    wheels = directory / "wheels"
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
          "--only-binary=:all:", "--dest", str(wheels),
          *(f"{name}=={version}" for name, version in (RUNTIME_WHEEL, NVCC_WHEEL))],
         "pip download of the CUDA runtime wheels failed (PyPI reachable?)", FETCH_TIMEOUT_S)
    downloaded = time.monotonic() - started
    _unpack(wheels, "nvidia_cuda_runtime_cu12", "nvidia/cuda_runtime/", directory / "runtime")
    _unpack(wheels, "nvidia_cuda_nvcc_cu12", "nvidia/cuda_nvcc/include/crt/", directory / "crt")
    (directory / "cuda-probe.c").write_text(SOURCE)
    include = directory / "include"  # crt/host_config.h where cuda_runtime_api.h looks for it
    include.mkdir(exist_ok=True)
    if not (include / "crt").exists():
        (include / "crt").symlink_to("../crt")
    _run(["gcc", "-O2", "-Wall", "-Werror", f"-I{directory / 'runtime/include'}", f"-I{include}",
          "-o", str(directory / "cuda-probe.tmp"), str(directory / "cuda-probe.c"),
          f"-L{directory / 'runtime/lib'}", "-l:libcudart.so.12", f"-Wl,-rpath,{CUDART_DIR}"],
         "gcc could not build the CUDA probe", 300)
    (directory / "cuda-probe.tmp").replace(directory / "cuda-probe")
    build = {"runtime_wheel": "==".join(RUNTIME_WHEEL), "nvcc_wheel": "==".join(NVCC_WHEEL),
             "wheel_bytes": sum(w.stat().st_size for w in wheels.glob("*.whl")),
             "download_seconds": round(downloaded, 1),
             "build_seconds": round(time.monotonic() - started - downloaded, 1),
             "recipe": recipe()}
    (directory / "BUILD").write_text(json.dumps(build, indent=1) + "\n")
    return build


def _unpack(wheels: Path, prefix: str, member_prefix: str, target: Path) -> None:
    (wheel,) = sorted(wheels.glob(f"{prefix}-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith(member_prefix) and not member.endswith("/"):
                path = target / member[len(member_prefix):]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(archive.read(member))


# The real libcuda makes the control node /dev/nvidiactl (195:255) when it runs as root and
# finds none, as nvidia-modprobe would: as root the program runs with a /dev of its own (a
# private mount namespace), so that nothing is left in this machine's /dev.
OWN_DEV = ("mount -t tmpfs -o mode=0755 gpunode-cuda-probe /dev && mknod -m 666 /dev/null c 1 3 "
           "&& mknod -m 666 /dev/zero c 1 5 && mknod -m 666 /dev/urandom c 1 9 "
           '&& exec "$0" "$@"')


def run_here(probe: Probe, libcuda_dir: Path | None, timeout: float = 60) -> Answer:
    """Run the program on this machine with libcudart beside it and, when given, the directory
    of a driver's libcuda.so.1 on LD_LIBRARY_PATH (None: none, as a machine without a driver)."""
    dirs = [str(probe.cudart.parent)] + ([str(libcuda_dir)] if libcuda_dir else [])
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LD_LIBRARY_PATH": ":".join(dirs)}
    argv = [str(probe.binary)]
    if os.geteuid() == 0:
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", OWN_DEV, *argv]
    out = _run(argv, "the CUDA probe failed", timeout, env=env)
    return parse(out)


def parse(output: str) -> Answer:
    """The program's three lines ("runtime 12090 cudaSuccess", …) as an Answer."""
    values = {}
    for line in output.splitlines():
        key, value, error = [*line.split(), "", ""][:3]
        values[key] = (int(value or 0), error)
    missing = {"runtime", "driver", "devices"} - set(values)
    if missing:
        raise ValueError(f"the CUDA probe printed no {sorted(missing)} line:\n{output}")
    return Answer(values["runtime"][0], values["runtime"][1], values["driver"][0],
                  values["driver"][1], values["devices"][0], values["devices"][1])


# -- the image -----------------------------------------------------------------------------------


def glibc_files() -> list[Path]:
    """The shared libraries and the dynamic loader of this machine's Debian libc6 package."""
    listed = _run(["dpkg", "-L", "libc6"], "dpkg -L libc6 failed (a Debian machine?)", 60)
    files = []
    for line in listed.splitlines():
        path = Path(line)
        if (path.parts[1:2] in (("lib",), ("lib64",), ("usr",))
                and ".so" in path.name and "gconv" not in path.parts
                and (path.is_file() or path.is_symlink())):
            files.append(path)
    if not any(path.name == "libc.so.6" for path in files):
        raise RuntimeError(f"dpkg -L libc6 lists no libc.so.6:\n{listed}")
    return files


def make_rootfs(directory: Path, probe: Probe) -> Path:
    """A root file system with glibc, busybox-static (sh, env, ls) and the program."""
    for name in ("bin", "dev", "etc", "proc", "run", "sys", "tmp", "usr/local/bin", CUDART_DIR):
        (directory / name.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for path in glibc_files():
        target = directory / str(path).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            target.symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, target)
    shutil.copy2(BUSYBOX, directory / "bin/busybox")
    for applet in ("sh", "env", "ls", "cat", "true"):
        (directory / "bin" / applet).symlink_to("busybox")
    shutil.copy2(probe.binary, directory / PROBE_PATH.lstrip("/"))
    shutil.copy2(probe.cudart, directory / CUDART_DIR.lstrip("/") / "libcudart.so.12")
    return directory


def command(env: tuple[str, ...] = ENV) -> list[str]:
    """The program's argv in a container without the image's environment (podman --rootfs)."""
    return ["/bin/env", *env, PROBE_PATH]


def build_image(path: Path, rootfs: Path, name: str = IMAGE) -> str:
    """An OCI image layout tar of `rootfs` (one uncompressed layer, fixed mtimes and owners),
    importable with `ctr images import`; returns the manifest's digest."""
    return image_layout(path, _layer(rootfs), ENV, (PROBE_PATH,), name)


def _layer(rootfs: Path) -> bytes:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(rootfs.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(rootfs).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if info.isreg():
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return data.getvalue()


def _run(argv: list[str], what: str, timeout: float, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what}\n  command: {' '.join(argv)}\n  exit code: "
                           f"{done.returncode}\n  stderr:\n{done.stderr or done.stdout}")
    return done.stdout


def main() -> int:
    """Fetch the wheels and compile the program (make's fetch-cuda target)."""
    started = time.monotonic()
    probe = ensure_probe()
    print(f"{probe.binary}\t{probe.build}\t({time.monotonic() - started:.1f}s)")
    print(f"without a driver: {run_here(probe, None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
