"""podman as a real, independent CDI consumer, for integration tests.

    rootfs = make_rootfs(tmp_path / "rootfs")            # busybox-static and its applet links
    rc, out, err = run_with_cdi(spec_dir, "nvidia.com/gpu=0", ["ls", "-l", "/dev/nvidia0"],
                                rootfs, tmp_path / "podman")

`run_with_cdi` starts `podman run --device <device> --rootfs <rootfs> <command>` with the CDI
spec files of `spec_dir` as the only specs podman sees, and returns its exit code, stdout and
stderr. Nothing of the machine changes: no image, no network, no /var/lib/containers, no
/run/libpod, no cgroup, no mount left behind. How:

  * podman runs as PID 1's child of a private PID+mount namespace (`unshare --mount
    --propagation private --pid --fork --kill-child --mount-proc`): whatever it mounts goes away
    with the namespace, and a timeout's SIGKILL of unshare takes conmon and the container along.
  * Inside, a private tmpfs on /run (podman's run and tmp dirs live there) and the spec directory
    bind-mounted on /run/cdi (= /var/run/cdi, where `gpunode boot` writes nvidia.yaml); an empty
    directory over /etc/cdi where the machine has one. Debian 12's podman 4.3.1 reads exactly
    these two directories, hard-coded by the CDI library; `[engine] cdi_spec_dirs` in
    containers.conf arrived later (containers/common #1834, honoured by podman only from 5.5,
    podman #25717) and is written too, for those.
  * `CONTAINERS_CONF` (the only containers.conf read when set) and `CONTAINERS_STORAGE_CONF` name
    files under `workdir`; every call gets a fresh storage root under `workdir` (driver vfs: no
    overlay mount, works on any file system).
  * Flags and settings, each for a reason found on this machine (Debian 12, root, in a container,
    cgroup v1 with a cgroup2 "unified" mount):
      - `default_ulimits = []`: podman's default RLIMIT_NOFILE exceeds the hard limit here;
        crun: "setrlimit `RLIMIT_NOFILE`: Operation not permitted".
      - `--runtime crun` and `--cgroups disabled`: no cgroup is made for the container (runc
        makes libpod_parent in every hierarchy of the machine and leaves it; with cgroups
        disabled podman answers "requested OCI runtime runc is not compatible with NoCgroups").
      - the cgroup2 mount at /sys/fs/cgroup/unified is unmounted inside the namespace: crun
        refuses "cgroups in hybrid mode not supported, drop all controllers from cgroupv2".
      - `--cgroup-manager cgroupfs`, `--events-backend file`: no systemd or journald is asked.
      - `--network none`: no network stack (no netavark/CNI, no slirp) is needed.
      - `--log-driver none`: the output comes through attach only, no log file or journald.
      - `--log-level debug`, only to explain "unresolvable CDI devices": the CDI library drops
        a spec it cannot load with a debug message only (e.g. `invalid CDI Spec: invalid
        version "0.6.0"` — podman 4.3.1 knows cdiVersion up to 0.5.0), so such a refusal is
        asked again at debug level and those lines are added to stderr. Not on every run: at
        debug level conmon here makes podman wait 20 s ("Exceeded conmon timeout waiting for
        container ... to exit") for a container that exited at once.

The rootfs is used in place (crun creates the mount points in it), so give each container a
fresh one: a file it created as a mount point stays behind as an empty file.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

TOOLS = {"podman": "podman", "crun": "crun", "conmon": "conmon", "unshare": "util-linux",
         "mountpoint": "util-linux"}
BUSYBOX = Path("/bin/busybox")  # busybox-static's; Debian's plain busybox is dynamically linked
ROOTFS_DIRS = ("bin", "dev", "etc", "proc", "run", "sys", "tmp")
CDI_DIR = "/run/cdi"

CONTAINERS_CONF = f"""\
# gpunode_testing.podman: podman's only containers.conf (CONTAINERS_CONF).
[containers]
default_ulimits = []

[engine]
cdi_spec_dirs = ["{CDI_DIR}"]
"""

STORAGE_CONF = """\
# gpunode_testing.podman: podman's storage.conf (CONTAINERS_STORAGE_CONF).
[storage]
driver = "vfs"
graphroot = "{graphroot}"
runroot = "/run/gpunode-podman/runroot"
"""

# Run inside the namespace as `sh -c NAMESPACE_SCRIPT sh SPEC_DIR EMPTY_DIR podman ARGS...`.
NAMESPACE_SCRIPT = """\
set -e
spec=$1 empty=$2; shift 2
for run in /run /var/run; do
    if [ ! -L "$run" ]; then
        mount -t tmpfs -o mode=0755 gpunode-podman "$run"
        mkdir "$run/cdi" && mount --bind "$spec" "$run/cdi"
    fi
done
if [ -d /etc/cdi ]; then mount --bind "$empty" /etc/cdi; fi
if [ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ] && mountpoint -q /sys/fs/cgroup/unified; then
    umount /sys/fs/cgroup/unified
fi
exec "$@"
"""

GLOBAL_FLAGS = ("--runtime", "crun", "--cgroup-manager", "cgroupfs",
                "--events-backend", "file", "--tmpdir", "/run/gpunode-podman/tmp")
RUN_FLAGS = ("--rm", "--network", "none", "--cgroups", "disabled", "--log-driver", "none")

UNRESOLVABLE = "unresolvable CDI devices"
_LOG_LINE = re.compile(r'^time="[^"]*" level=\w+ msg="(?P<msg>.*)')
_ABOUT_CDI = re.compile(r"\bCDI\b", re.IGNORECASE)

# Runs podman's argv somewhere else than here, e.g. inside a SystemdNamespace (ns.run), given
# only the variables podman needs; answers (exit code, stdout, stderr).
Runner = Callable[[Sequence[str], Mapping[str, str], float], tuple[int, str, str]]


def missing_tools() -> list[str]:
    """What this harness needs and the machine lacks, as "program (Debian package)"."""
    missing = [f"{tool} ({package})" for tool, package in TOOLS.items() if not shutil.which(tool)]
    if not _is_static_elf(BUSYBOX):
        missing.append(f"a statically linked {BUSYBOX} (busybox-static)")
    return missing


def version() -> str:
    """podman's version line (`podman --version` reads no storage and writes nothing)."""
    return subprocess.run(["podman", "--version"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


def make_rootfs(directory: Path) -> Path:
    """A container root file system: a few directories, busybox-static and a link per applet."""
    for name in ROOTFS_DIRS:
        (directory / name).mkdir(parents=True, exist_ok=True)
    busybox = directory / "bin" / "busybox"
    shutil.copy2(BUSYBOX, busybox)
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
    for applet in applets:
        link = directory / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    return directory


def run_with_cdi(spec_dir: Path, device: str | Sequence[str], command: Sequence[str],
                 rootfs: Path, workdir: Path, *, timeout: float = 60.0,
                 runner: Runner | None = None) -> tuple[int, str, str]:
    """Run `command` in a container from `rootfs` given the CDI `device`(s) of `spec_dir`.

    Returns (exit code, stdout, stderr). Where podman finds a device in no spec it can load,
    stderr also holds the CDI library's debug lines saying why. A run past `timeout` is killed,
    namespace and all, and answered (124, stdout so far, stderr so far + a line saying so).
    `runner` runs podman elsewhere (the paths given must exist there too); by default here."""
    devices = [device] if isinstance(device, str) else list(device)
    run = runner or _run_here
    argv = command_line(spec_dir, devices, command, rootfs, workdir)
    rc, out, err = run(argv, _podman_env(workdir), timeout)
    if rc != 0 and UNRESOLVABLE in err:
        argv = command_line(spec_dir, devices, command, rootfs, workdir, debug=True)
        err += cdi_lines(run(argv, _podman_env(workdir), timeout)[2])
    return rc, out, err


def _podman_env(workdir: Path) -> dict[str, str]:
    return {"CONTAINERS_CONF": str(workdir / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(_storage_conf(workdir))}


def _run_here(argv: Sequence[str], podman_env: Mapping[str, str],
              timeout: float) -> tuple[int, str, str]:
    env = {**os.environ, **podman_env}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        return (124, _text(err.stdout),
                f"{_text(err.stderr)}\npodman ran past {timeout} s and was killed\n")
    return done.returncode, done.stdout, done.stderr


def command_line(spec_dir: Path, devices: Sequence[str], command: Sequence[str],
                 rootfs: Path, workdir: Path, *, debug: bool = False) -> list[str]:
    """The whole argv: unshare, the namespace script and podman's command line."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "containers.conf").write_text(CONTAINERS_CONF)
    empty = workdir / "empty"
    empty.mkdir(exist_ok=True)
    podman = ["podman", *(("--log-level", "debug") if debug else ()), *GLOBAL_FLAGS,
              "run", *RUN_FLAGS]
    for device in devices:
        podman += ["--device", device]
    podman += ["--rootfs", str(rootfs), *command]
    return ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
            "--mount-proc", "sh", "-c", NAMESPACE_SCRIPT, "sh", str(spec_dir), str(empty),
            *podman]


def probe(workdir: Path, rootfs: Path) -> str | None:
    """None when podman runs a plain container here; else why not, with podman's own error."""
    if os.geteuid() != 0:
        return "podman's namespace and mounts need root"
    if missing := missing_tools():
        return "missing: " + ", ".join(missing)
    spec_dir = workdir / "no-specs"
    spec_dir.mkdir(parents=True, exist_ok=True)
    rc, out, err = run_with_cdi(spec_dir, (), ["/bin/true"], rootfs, workdir)
    if rc != 0:
        argv = shlex.join(command_line(spec_dir, (), ["/bin/true"], rootfs, workdir))
        return f"podman cannot run a container here (exit {rc}): {argv}\n{out}{err}"
    return None


def cdi_lines(debug_stderr: str) -> str:
    """podman's log lines about CDI (the spec loading errors among them), one per line."""
    kept = [line for line in debug_stderr.splitlines()
            if (match := _LOG_LINE.match(line)) and _ABOUT_CDI.search(match["msg"])]
    return "".join(line.replace("\\n", " ").replace("\\t", "") + "\n" for line in kept)


def _storage_conf(workdir: Path) -> Path:
    graphroot = Path(tempfile.mkdtemp(prefix="storage-", dir=workdir))
    conf = graphroot / "storage.conf"
    conf.write_text(STORAGE_CONF.format(graphroot=graphroot / "graph"))
    return conf


def _is_static_elf(path: Path) -> bool:
    """An ELF executable without a PT_INTERP program header (no dynamic loader needed)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if data[:4] != b"\x7fELF" or data[4] != 2:  # ELF, 64-bit
        return False
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    types = (int.from_bytes(data[phoff + i * phentsize:phoff + i * phentsize + 4], "little")
             for i in range(phnum))
    return 3 not in types  # PT_INTERP


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def rerooted(document: dict[str, Any], root: Path) -> dict[str, Any]:
    """A CDI spec made for the node mounted at `root` (a fixture tree), as the machine running
    podman must read it: every host path under `root`."""
    def edits(e: dict[str, Any]) -> None:
        for node in e.get("deviceNodes", []):
            node["hostPath"] = f"{root}{node.get('hostPath', node['path'])}"
        for mount in e.get("mounts", []):
            mount["hostPath"] = f"{root}{mount['hostPath']}"
    edits(document.get("containerEdits", {}))
    for device in document.get("devices", []):
        edits(device.get("containerEdits", {}))
    return document
