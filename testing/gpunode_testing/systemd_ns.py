"""A real systemd as PID 1 of a private PID+mount namespace, for integration tests.

    units = {"containerd.service": TEXT}
    with SystemdNamespace(units, workdir, enable=["containerd.service"]) as ns:
        ns.wait_active("containerd.service")
        ns.run([sys.executable, "-c", "..."])   # pystemd in there talks to *this* systemd

How: `unshare --pid --fork --mount --propagation private --mount-proc` (plus private UTS, IPC,
network and cgroup namespaces) runs a generated shell script as PID 1 of the new namespaces; the
script makes the machine safe for a boot and then execs /lib/systemd/systemd --system with
container=docker. Commands reach the inside with `nsenter -t PID -m -p -u -i -n`; close() SIGKILLs
the namespace's PID 1, which takes everything inside with it.

Why the script is careful: the namespace shares the machine's file systems and kernel. A stock boot
runs `systemd-tmpfiles --remove --boot` (empties the machine's /tmp, where a CI checkout may
live), applies sysctls to the machine's kernel and starts every enabled service of the machine
(PostgreSQL, timers, ...). So the script, before systemd runs:

  * mounts private tmpfs on /run, /tmp, /var/tmp, /var/log and /var/lib/systemd (with
    `mount -n`, so not even util-linux's /run/mount/utab of the machine is written);
  * puts copy-on-write overlays (upper layers on a private tmpfs) on /etc, so whatever runs inside
    may "change" /etc, and on /dev, where socket units link /dev/log and /dev/initctl (the
    machine's /dev is one devtmpfs for everybody); then a private /dev/shm, a new devpts instance,
    and a file of the work directory over /dev/console;
  * makes /proc/sys and /sys read-only (sysctls, core_pattern, uevents stay the machine's), and
    mounts a fresh cgroup2 of its own cgroup namespace on /sys/fs/cgroup, rooted at a cgroup made
    for this namespace under the caller's (removed again by close());
  * masks, in /run/systemd/system, the units of MASKED and every unit the machine enables
    (/etc/systemd/system/*.wants|requires|upholds/, SysV scripts of /etc/init.d) except the few
    of KEEP (D-Bus, journald, logind) and the test's own units;
  * writes the test's units to /run/systemd/system (and removes same-named units and drop-ins from
    the overlaid /etc/systemd/system, so /etc cannot shadow them);
  * configures journald volatile, without /dev/kmsg, and logind without VTs.

Files a test needs inside must live outside /tmp, /var/tmp and /run, or be named in `binds` (the
python running the tests and this checkout are added automatically when they live there). The
work directory must be outside them: /var/lib/gpunode-tests/<something> is a good place.

Every start() puts a canary file in the machine's /tmp and /var/tmp and close() checks it is still
there; if it is gone close() raises HostDamaged: stop and find out why.

This module is longer than 450 lines because a fifth of it is the explanation above, and the
rest is one lifecycle (prepare, start, run, stop, check the machine is untouched) whose parts
only make sense together.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")

# Units that stay: the system bus, the journal and logind.
KEEP = frozenset(
    {
        "dbus.service",
        "dbus.socket",
        "systemd-journald.service",
        "systemd-journald.socket",
        "systemd-journald-dev-log.socket",
        "systemd-logind.service",
        "systemd-user-sessions.service",
    }
)

# Units masked on every boot, whatever the machine enables.
MASKED = (
    # tmpfiles --remove --boot empties /tmp: never.
    "systemd-tmpfiles-setup.service",
    "systemd-tmpfiles-setup-dev.service",
    "systemd-tmpfiles-setup-dev-early.service",
    "systemd-tmpfiles-clean.service",
    "systemd-tmpfiles-clean.timer",
    # Kernel-wide settings and mounts of the machine.
    "systemd-sysctl.service",
    "systemd-modules-load.service",
    "modprobe@.service",  # logind wants modprobe@drm.service: loads into the machine's kernel
    "kmod-static-nodes.service",
    "systemd-remount-fs.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    "dev-hugepages.mount",
    "dev-mqueue.mount",
    "sys-kernel-config.mount",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-fs-fuse-connections.mount",
    "systemd-fsck-root.service",
    "systemd-repart.service",
    "systemd-pcrphase.service",
    "systemd-pcrphase-sysinit.service",
    "systemd-pcrphase-initrd.service",
    # udev would replay uevents of the machine's devices.
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    "systemd-hwdb-update.service",
    # State the machine keeps in /etc and /var.
    "systemd-sysusers.service",
    "systemd-firstboot.service",
    "systemd-machine-id-commit.service",
    "systemd-random-seed.service",
    "systemd-pstore.service",
    "systemd-update-utmp.service",
    "systemd-update-utmp-runlevel.service",
    "systemd-update-done.service",
    "systemd-journal-catalog-update.service",
    "systemd-journal-flush.service",
    "systemd-journald-audit.socket",
    "ldconfig.service",
    # Clock, network and consoles of the machine.
    "systemd-timesyncd.service",
    "systemd-networkd.service",
    "systemd-networkd.socket",
    "systemd-resolved.service",
    "getty.target",
    "getty@.service",
    "serial-getty@.service",
    "console-getty.service",
    "container-getty@.service",
    "systemd-ask-password-console.path",
    "systemd-ask-password-wall.path",
    # Periodic jobs.
    "cron.service",
    "anacron.service",
    "anacron.timer",
)

JOURNALD_CONF = """\
[Journal]
Storage=volatile
ReadKMsg=no
ForwardToKMsg=no
ForwardToConsole=no
ForwardToWall=no
"""

LOGIND_CONF = """\
[Login]
NAutoVTs=0
ReserveVT=0
"""

SYSTEMD_BINARIES = (Path("/lib/systemd/systemd"), Path("/usr/lib/systemd/systemd"))
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Directories the namespace gets private copies of: host paths below them are invisible inside.
HIDDEN = (Path("/tmp"), Path("/var/tmp"), Path("/run"))
BOOTED = ("running", "degraded")
# What the harness itself reads and writes of the machine, for the test boundary guard
# (gpunode_testing.boundary): the process table and cgroups, the services it masks, the
# canaries it plants in the machine's /tmp and /var/tmp.
MACHINE_PATHS = ("/proc", "/sys/fs/cgroup", "/etc/systemd/system", "/etc/init.d",
                 "/tmp/gpunode-ns-canary-*", "/var/tmp/gpunode-ns-canary-*")


class HarnessError(RuntimeError):
    """The namespace could not be started or used; the message says why."""


class HostDamaged(HarnessError):
    """Something of the machine that the namespace must never touch was changed."""


class CommandFailed(subprocess.CalledProcessError):
    """A command inside the namespace failed; str() shows its output."""

    def __str__(self) -> str:
        argv = [a if len(a) < 200 else a[:60] + "...(cut)" for a in map(str, self.cmd)]
        return (
            f"{shlex.join(argv)} exited with status {self.returncode} inside the namespace"
            f"\n--- stdout ---\n{self.stdout or ''}\n--- stderr ---\n{self.stderr or ''}"
        )


def _under(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _hidden(path: Path) -> bool:
    return any(_under(path, hidden) for hidden in HIDDEN)


def _unified_cgroup() -> Path:
    """The directory of the caller's cgroup in the cgroup2 hierarchy."""
    own = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            own = line[3:]
    if own is None:
        raise HarnessError("no cgroup2 (unified) hierarchy in /proc/self/cgroup")
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, super_fields = line.partition(" - ")
        fields_list = fields.split()
        if super_fields.split()[0] == "cgroup2":
            mounts.append((fields_list[3], Path(fields_list[4])))
    if not mounts:
        raise HarnessError("cgroup2 is not mounted (looked for it in /proc/self/mountinfo)")
    mounts.sort(key=lambda m: m[1] not in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")))
    root, mountpoint = mounts[0]
    if root != "/" and (own == root or own.startswith(root.rstrip("/") + "/")):
        own = own[len(root) :]
    return mountpoint / own.lstrip("/")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


class SystemdNamespace:
    """systemd as PID 1 of private namespaces, booted with `units` in /run/systemd/system.

    units: file name → contents, e.g. {"containerd.service": "[Unit]..."}; written as given.
    workdir: a directory outside /tmp, /var/tmp and /run for the harness's files (under
        workdir/systemd-ns) and the test's own; the caller creates and removes it.
    enable: names of `units` to start at boot (linked into multi-user.target.wants).
    binds: host paths under /tmp, /var/tmp or /run to keep visible inside.
    overlays: further directories to make copy-on-write inside, e.g. ("usr", "var/lib").
    prepare: shell lines run inside just before systemd starts.
    quiet_boot: seconds after systemd starts in which the harness asks it nothing (its checks
        are an nsenter and a systemctl each, a few ms of CPU and of PID 1's: a benchmark's
        boots, shorter than this, then run beside nothing of the harness's).
    """

    def __init__(
        self,
        units: Mapping[str, str],
        workdir: Path,
        *,
        enable: Iterable[str] = (),
        binds: Iterable[Path] = (),
        overlays: Iterable[str] = (),
        prepare: Sequence[str] = (),
        boot_timeout: float = 60.0,
        command_timeout: float = 60.0,
        quiet_boot: float = 0.0,
    ) -> None:
        self.units = dict(units)
        self.workdir = Path(workdir).resolve()
        self.enable = list(enable)
        self.binds = [Path(p).resolve() for p in binds]
        # More top-level directories made copy-on-write like /etc ("usr", "var/lib"): a test
        # may then write /usr/share/... or /var/lib/... inside without touching the machine.
        self.overlays = [d.strip("/") for d in overlays]
        # Shell lines run inside, after every mount above and before systemd starts: e.g.
        # bind mounts of a fixture over /sys or /proc paths, files on the overlaid /usr.
        self.prepare = list(prepare)
        self.boot_timeout = boot_timeout
        self.quiet_boot = quiet_boot
        self.command_timeout = command_timeout
        self.token = secrets.token_hex(8)
        self.dir = self.workdir / "systemd-ns"
        self.boot_log = self.dir / "boot.log"
        self.console_log = self.dir / "console.log"
        self.masked: list[str] = []
        self.pid: int | None = None  # the namespace's PID 1, as the machine numbers it
        self.state: str | None = None  # what is-system-running said when the boot was done
        self.boot_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._cgroup: Path | None = None
        self._canaries: list[Path] = []
        unknown = [name for name in self.enable if name not in self.units]
        if unknown:
            raise ValueError(f"enable names units that are not given: {unknown}")
        if any(_under(self.workdir, Path("/") / d) for d in self.overlays):
            raise ValueError(f"workdir {self.workdir} is under an overlay {self.overlays}: "
                             "what the test writes there would be invisible outside")
        if _hidden(self.workdir):
            raise ValueError(f"workdir {self.workdir} is under {'/'.join(map(str, HIDDEN))}")

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> SystemdNamespace:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Boot; return once is-system-running says running or degraded. Cleans up on failure."""
        if self._proc is not None:
            raise HarnessError("already started")
        try:
            self._preflight()
            self._plant_canaries()
            self._write_files()
            self._start_process()
            self._wait_booted()
        except BaseException:
            self._close_after_failure()
            raise

    def _close_after_failure(self) -> None:
        try:
            self.close()
        except HostDamaged:
            raise  # louder than whatever made the start fail (which it chains)
        except Exception:
            return  # the start's own failure says more

    def close(self) -> None:
        """SIGKILL the namespace's PID 1 (and so everything inside), wait, remove its cgroup.

        Safe to call more than once and after a failed start. Raises HostDamaged if a canary of
        the machine's /tmp or /var/tmp is gone, HarnessError if processes or cgroups stay behind.
        """
        problems: list[str] = []
        proc, self._proc = self._proc, None
        pid, self.pid = self.pid, None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc is not None:
            # unshare reaps PID 1; PID 1's death (zap_pid_ns_processes) waits for all inside.
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    problems.append(f"unshare (pid {proc.pid}) did not exit after SIGKILL")
        if self._cgroup is not None and self._populated(self._cgroup):
            # Last resort: whatever is still in the namespace's cgroup.
            with contextlib.suppress(OSError):
                (self._cgroup / "cgroup.kill").write_text("1")
        if pid is not None:
            deadline = time.monotonic() + 5
            while self._comm(pid) == "systemd" and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._comm(pid) == "systemd":
                problems.append(f"the namespace's PID 1 (pid {pid}) is still there")
        if self._cgroup is not None:
            error = self._remove_cgroup(self._cgroup)
            if error:
                problems.append(error)
            else:
                self._cgroup = None
        gone = [str(c) for c in self._canaries if not c.exists()]
        for canary in self._canaries:
            with contextlib.suppress(FileNotFoundError):
                canary.unlink()
        self._canaries = []
        if gone:
            raise HostDamaged(
                f"canary file(s) {gone} in the machine's /tmp or /var/tmp are GONE after the "
                "systemd namespace ran: something inside emptied the machine's temp directories."
                " Stop using this harness until this is understood."
            )
        if problems:
            raise HarnessError("; ".join(problems))

    # -- inside the namespace ----------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str | os.PathLike[str]],
        check: bool = True,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside the namespace (nsenter), with a clean environment and a timeout."""
        if self.pid is None:
            raise HarnessError("the namespace is not running")
        cmd = [
            "nsenter",
            f"--target={self.pid}",
            "--mount",
            "--pid",
            "--uts",
            "--ipc",
            "--net",
            "--wd=/",
            "--",
            *map(str, argv),
        ]
        environ = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root", "TERM": "dumb"}
        environ |= {"SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        environ |= dict(env or {})
        try:
            result = subprocess.run(
                cmd,
                env=environ,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout or self.command_timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise HarnessError(
                f"{shlex.join(map(str, argv))} did not finish within {e.timeout} s inside the "
                f"namespace\n--- stdout ---\n{e.stdout or ''}\n--- stderr ---\n{e.stderr or ''}"
            ) from None
        if check and result.returncode != 0:
            raise CommandFailed(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", "--no-pager", "--no-legend", *args], check=check)

    def unit_property(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", unit).stdout.rstrip("\n")

    def unit_properties(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", *(f"-p{p}" for p in props), unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_argv(self, unit: str) -> list[str]:
        """The argv of the unit's running main process, as the kernel has it."""
        pid = self.unit_property(unit, "MainPID")
        return self.run(["cat", f"/proc/{pid}/cmdline"]).stdout.rstrip("\0").split("\0")

    def wait_active(self, unit: str, timeout: float = 30.0) -> None:
        """Wait until unit is active; fail at once if it fails, with its status and journal."""

        def active() -> bool:
            state = self.unit_property(unit, "ActiveState")
            if state == "failed":
                raise HarnessError(f"{unit} failed:\n{self.diagnose(unit)}")
            return state == "active"

        self.wait_for(active, timeout, f"{unit} to become active", unit=unit)

    def wait_for(
        self,
        probe: Callable[[], T],
        timeout: float,
        what: str,
        *,
        unit: str | None = None,
        interval: float = 0.1,
    ) -> T:
        """Poll probe() until it returns something true; return that, or raise after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                detail = f"\n{self.diagnose(unit)}" if unit else ""
                raise HarnessError(f"timed out after {timeout} s waiting for {what}{detail}")
            time.sleep(interval)

    def journal(self, unit: str) -> list[dict[str, object]]:
        """The journal of unit (journalctl -u UNIT -o json), oldest first."""
        out = self.run(["journalctl", "--no-pager", "--all", "-o", "json", "-u", unit]).stdout
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def diagnose(self, unit: str | None = None) -> str:
        """Status and journal of unit (or failed units and the boot log), for error messages."""
        parts = []
        with contextlib.suppress(Exception):
            if unit:
                parts.append(self.systemctl("status", "--full", unit, check=False).stdout)
                parts.append(
                    self.run(
                        ["journalctl", "--no-pager", "-n", "50", "-u", unit], check=False
                    ).stdout
                )
            else:
                parts.append(self.systemctl("--failed", check=False).stdout)
                parts.append(self.systemctl("list-jobs", check=False).stdout)
        parts.append(self._log_tail())
        return "\n".join(parts)

    # -- internals ---------------------------------------------------------------------------

    def _preflight(self) -> None:
        missing = []
        if os.geteuid() != 0:
            missing.append("root (the harness mounts and creates namespaces)")
        for tool in ("unshare", "nsenter", "setpriv", "mount", "umount"):
            if shutil.which(tool, path=PATH) is None:
                missing.append(f"{tool} (util-linux)")
        if not any(p.exists() for p in SYSTEMD_BINARIES):
            missing.append(f"systemd (none of {[str(p) for p in SYSTEMD_BINARIES]})")
        if (
            not Path("/lib/systemd/system/dbus.service").exists()
            and not Path("/usr/lib/systemd/system/dbus.service").exists()
        ):
            missing.append("dbus (dbus.service; apt-get install dbus)")
        filesystems = Path("/proc/filesystems").read_text()
        for fs in ("overlay", "cgroup2", "tmpfs"):
            if f"\t{fs}\n" not in filesystems:
                missing.append(f"{fs} support in the kernel")
        if missing:
            raise HarnessError(
                "cannot boot a systemd namespace on this machine; missing: " + ", ".join(missing)
            )

    def _plant_canaries(self) -> None:
        for directory in ("/tmp", "/var/tmp"):
            canary = Path(directory) / f"gpunode-ns-canary-{self.token}"
            canary.write_text("must survive the systemd namespace\n")
            self._canaries.append(canary)

    def _mask_list(self) -> list[str]:
        names = set(MASKED)
        etc = Path("/etc/systemd/system")
        for pattern in ("*.wants", "*.requires", "*.upholds"):
            for directory in etc.glob(pattern):
                names.update(entry.name for entry in directory.iterdir())
        init_d = Path("/etc/init.d")
        if init_d.is_dir():
            names.update(f"{script.name}.service" for script in init_d.iterdir())
        return sorted(names - KEEP - set(self.units))

    def _write_files(self) -> None:
        if self.dir.exists():
            shutil.rmtree(self.dir)
        system = self.dir / "system"
        (system / "multi-user.target.wants").mkdir(parents=True)
        for sub in ("journald.conf.d", "logind.conf.d", "layers"):
            (self.dir / sub).mkdir()
        for name, text in self.units.items():
            if "/" in name or not name:
                raise ValueError(f"bad unit name {name!r}")
            (system / name).write_text(text)
        for name in self.enable:
            (system / "multi-user.target.wants" / name).symlink_to(f"/run/systemd/system/{name}")
        self.masked = self._mask_list()
        for name in self.masked:
            (system / name).symlink_to("/dev/null")
        (self.dir / "journald.conf.d" / "50-gpunode-test.conf").write_text(JOURNALD_CONF)
        (self.dir / "logind.conf.d" / "50-gpunode-test.conf").write_text(LOGIND_CONF)
        self.boot_log.write_bytes(b"")
        self.console_log.write_bytes(b"")
        (self.dir / "token").write_text(self.token + "\n")
        (self.dir / "boot.sh").write_text(self._script())

    def _auto_binds(self) -> list[Path]:
        wanted = [*self.binds, Path(sys.prefix), Path(sys.base_prefix)]
        wanted.append(Path(__file__).resolve().parents[2])  # this checkout
        wanted.append(Path(sys.executable).resolve().parent)
        if cache := os.environ.get("GPUNODE_TEST_CACHE"):  # real binaries a test bind-mounts
            wanted.append(Path(cache))
        binds: list[Path] = []
        for path in wanted:
            path = path.resolve()
            if _hidden(path) and path.exists() and path not in binds:
                binds.append(path)
        # A bind inside another is carried along by the outer (recursive) one.
        return [p for p in binds if not any(o != p and _under(p, o) for o in binds)]

    def _script(self) -> str:
        q = shlex.quote
        d = self.dir
        systemd = next(p for p in SYSTEMD_BINARIES if p.exists())
        lines = [
            "#!/bin/sh",
            "# Generated by gpunode_testing.systemd_ns; runs as PID 1 of fresh namespaces.",
            "set -eu",
            "",
            "# util-linux's mount must not write the machine's /run/mount/utab: -n throughout.",
            "",
            "# 0. Host paths under /tmp, /var/tmp, /run that must stay visible: stage them.",
        ]
        binds = self._auto_binds()
        for n, path in enumerate(binds):
            stage = d / "binds" / str(n)
            stage.mkdir(parents=True, exist_ok=True)
            lines.append(f"mount -n --rbind {q(str(path))} {q(str(stage))}")
        lines += [
            "",
            "# 1. Private scratch file systems, before anything else: a stock boot empties /tmp.",
            "mount -n -t tmpfs -o mode=755,nosuid,nodev tmpfs /run",
            "mount -n -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp",
            "mount -n -t tmpfs -o mode=1777,nosuid,nodev tmpfs /var/tmp",
            "",
            "# 2. /etc and /dev copy-on-write (socket units link /dev/log, /dev/initctl; tests may",
            "#    edit /etc): the upper layers live on a private tmpfs.",
            f"layers={q(str(d / 'layers'))}",
            'mount -n -t tmpfs -o mode=700 tmpfs "$layers"',
            f"for dir in etc dev {' '.join(self.overlays)}; do",
            '    upper="$layers/$(echo "$dir" | tr / -)"',
            '    mkdir "$upper-upper" "$upper-work"',
            '    options="lowerdir=/$dir,upperdir=$upper-upper,workdir=$upper-work"',
            '    mount -n -t overlay -o "$options" overlay "/$dir"',
            "done",
            "# private journal and systemd state (after the overlays: /var/lib may be one)",
            "for dir in /var/log /var/lib/systemd; do",
            '    if [ -d "$dir" ]; then mount -n -t tmpfs -o mode=755 tmpfs "$dir"; fi',
            "done",
            "mount -n -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm",
            "mount -n -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /dev/pts",
            "mount -n --bind /dev/pts/ptmx /dev/ptmx",
            f"mount -n --bind {q(str(self.console_log))} /dev/console",
            "",
            "# 3. Kernel settings read-only; a cgroup2 of our own cgroup namespace.",
            "mount -n --bind /proc/sys /proc/sys",
            "mount -n -o remount,bind,ro /proc/sys",
            "mount -n -o remount,bind,ro /sys",
            "umount -n -R /sys/fs/cgroup 2>/dev/null || umount -n -l /sys/fs/cgroup || :",
            "mount -n -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup",
            "",
            "# 4. Units: masks and the test's own; journald and logind settings.",
            "mkdir -p /run/systemd/system /run/systemd/journald.conf.d /run/systemd/logind.conf.d",
            f"cp -a {q(str(d / 'system'))}/. /run/systemd/system/",
            f"cp {q(str(d / 'journald.conf.d'))}/* /run/systemd/journald.conf.d/",
            f"cp {q(str(d / 'logind.conf.d'))}/* /run/systemd/logind.conf.d/",
            f"cp {q(str(d / 'token'))} /run/gpunode-ns.token",
        ]
        shadowing = sorted(set(self.units) | set(self.masked))
        if shadowing:
            lines.append("cd /etc/systemd/system  # the overlay: removals stay inside")
            lines.append("rm -rf -- " + " ".join(f"{q(n)} {q(n + '.d')}" for n in shadowing))
            lines.append("cd /")
        if binds:
            lines += ["", "# 5. Staged host paths back in place."]
        for n, path in enumerate(binds):
            stage = d / "binds" / str(n)
            lines.append(f"mkdir -p {q(str(path))}")
            lines.append(f"mount -n --rbind {q(str(stage))} {q(str(path))}")
        if self.prepare:
            lines += ["", "# 6. The test's own preparation (inside the namespace, before boot).",
                      *self.prepare]
        lines += [
            "",
            "# 7. systemd, as a container's init.",
            f"exec env -i container=docker PATH={PATH} LANG=C.UTF-8 \\",
            f"    {systemd} --system --unit=multi-user.target --log-target=journal",
            "",
        ]
        return "\n".join(lines)

    def _start_process(self) -> None:
        parent = _unified_cgroup()
        self._sweep_stale_cgroups(parent)
        cgroup = parent / f"gpunode-ns-{self.token}"
        try:
            cgroup.mkdir()
        except OSError as e:
            raise HarnessError(f"cannot create cgroup {cgroup}: {e}") from e
        self._cgroup = cgroup
        argv = [
            # Dies with the thread that started it (pytest); --kill-child then kills PID 1.
            "setpriv",
            "--pdeathsig",
            "KILL",
            "--",
            # Into the cgroup made for the namespace, so the new cgroup namespace is rooted there.
            "/bin/sh",
            "-c",
            'echo 0 > "$0" && exec "$@"',
            str(cgroup / "cgroup.procs"),
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--propagation",
            "private",
            "--mount-proc",
            "--uts",
            "--ipc",
            "--net",
            "--cgroup",
            "/bin/sh",
            str(self.dir / "boot.sh"),
        ]
        with open(self.boot_log, "ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                env={"PATH": PATH, "LANG": "C.UTF-8"},
            )
        self._started_at = time.monotonic()

    def _wait_booted(self) -> None:
        assert self._proc is not None
        deadline = self._started_at + self.boot_timeout
        last = "not started"
        quiet = [self.quiet_boot] if self.quiet_boot > 0 else []
        while True:
            if self._proc.poll() is not None:
                raise HarnessError(
                    f"the namespace exited with status {self._proc.returncode} before systemd "
                    f"finished booting\n{self._log_tail()}"
                )
            if self.pid is None:
                children = _children(self._proc.pid)
                # setpriv → sh → (exec) unshare; its forked child is the namespace's PID 1.
                self.pid = children[0] if children else None
            if self.pid is not None and self._comm(self.pid) == "systemd":
                # The script has exec'ed systemd: the private /run is in place, so systemctl
                # can only reach this systemd.
                if quiet:
                    time.sleep(quiet.pop())
                result = self.run(["systemctl", "is-system-running"], check=False, timeout=15)
                last = result.stdout.strip() or result.stderr.strip()
                if last in BOOTED:
                    self.state = last
                    self.boot_seconds = time.monotonic() - self._started_at
                    return
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"systemd did not finish booting within {self.boot_timeout} s "
                    f"(is-system-running: {last!r})\n{self.diagnose()}"
                )
            time.sleep(0.1)

    @classmethod
    def _sweep_stale_cgroups(cls, parent: Path, age: float = 300.0) -> None:
        """Remove empty cgroups of namespaces whose test process was killed before close()."""
        for stale in parent.glob("gpunode-ns-*"):
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > age and not cls._populated(stale):
                    cls._remove_cgroup(stale, timeout=0)

    @staticmethod
    def _populated(cgroup: Path) -> bool:
        try:
            return "populated 1" in (cgroup / "cgroup.events").read_text()
        except OSError:
            return False

    @staticmethod
    def _comm(pid: int) -> str | None:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None

    def _log_tail(self, lines: int = 60) -> str:
        out = []
        for path in (self.boot_log, self.console_log):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path} (last {lines} lines) ---\n" + "\n".join(tail))
        return "\n".join(out)

    @staticmethod
    def _remove_cgroup(cgroup: Path, timeout: float = 10.0) -> str | None:
        """rmdir the namespace's cgroup tree, deepest first; None, or why it could not."""
        deadline = time.monotonic() + timeout
        while True:
            if not cgroup.exists():
                return None
            busy = None
            for root, _, _ in os.walk(cgroup, topdown=False):
                try:
                    os.rmdir(root)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        return f"cannot remove cgroup {root}: {e}"
                    busy = Path(root)
            if busy is None and not cgroup.exists():
                return None
            if time.monotonic() > deadline:
                procs = ""
                with contextlib.suppress(OSError):
                    procs = (busy / "cgroup.procs").read_text().split()  # type: ignore[operator]
                return f"cgroup {busy} still busy after {timeout} s (processes: {procs})"
            time.sleep(0.1)
