"""The real-systemd harness (gpunode_testing.systemd_ns) works, and is safe for the machine.

A real systemd 252 boots as PID 1 of private namespaces; a real containerd.service shaped like
Flatcar's runs under it; pystemd, run inside, restarts it over that systemd's own D-Bus. Needs
root, util-linux, systemd, dbus and containerd (apt-get install -y containerd dbus): on a machine
without them these tests fail with the reason; they never skip.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode_testing.systemd_ns import MACHINE_PATHS, HarnessError, SystemdNamespace

WORK_BASE = Path("/var/lib/gpunode-tests")  # not /tmp: the namespace has its own /tmp
pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS, str(WORK_BASE))
CONTAINERD = Path("/usr/bin/containerd")
UNIT = "containerd.service"
# journal MESSAGE_IDs systemd logs for a unit (sd-messages.h)
UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
UNIT_STOPPED = "9d1aaa27d60140bd96365438aad20286"

# As Flatcar ships it (/usr/lib/systemd/system/containerd.service), but for the config path.
CONTAINERD_UNIT = """\
[Unit]
Description=containerd container runtime
Documentation=https://containerd.io
After=network.target

[Service]
Delegate=yes
Environment=CONTAINERD_CONFIG={config}
ExecStart=/usr/bin/containerd --config ${{CONTAINERD_CONFIG}}
KillMode=process
Restart=always
RestartSec=5s
Type=notify
LimitNOFILE=1048576
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity

[Install]
WantedBy=multi-user.target
"""

# Everything containerd keeps lives under the work directory or the namespace's private /run.
CONTAINERD_CONFIG = """\
version = 2
root = "{root}/root"
state = "{root}/state"
# aufs would run modprobe against the machine's kernel; the rest need what is not here.
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"
"""

# Run inside the namespace by the venv's python: what gpunode will do to restart containerd.
PYSTEMD = """\
import json, os, sys, time
from pystemd.dbuslib import DBus, apply_signature
from pystemd.systemd1 import Unit

assert "DBUS_SYSTEM_BUS_ADDRESS" not in os.environ  # sd-bus's default: /run/dbus/...

def peer_pid(bus, name):
    args = apply_signature(b"s", [name])
    reply = bus.call_method(b"org.freedesktop.DBus", b"/org/freedesktop/DBus",
                            b"org.freedesktop.DBus", b"GetConnectionUnixProcessID", args)
    body = reply.body
    return body[0] if isinstance(body, (list, tuple)) else body

def invocation(unit):
    return bytes(unit.Unit.InvocationID).hex()

with DBus() as bus:
    unit = Unit(sys.argv[1].encode(), bus=bus)
    unit.load()
    exec_start = [
        {"path": e[0].decode(), "argv": [a.decode() for a in e[1]]}
        for e in unit.Service.ExecStart
    ]
    environment = [e.decode() for e in unit.Service.Environment]
    before = invocation(unit)
    job = None
    if sys.argv[2] == "restart":
        job = unit.Unit.Restart(b"replace")
        deadline = time.monotonic() + 30
        while not (invocation(unit) != before and unit.Unit.ActiveState == b"active"
                   and unit.Service.MainPID):
            if time.monotonic() > deadline:
                sys.exit(f"restart did not finish: {unit.Unit.ActiveState} {unit.Unit.SubState}")
            time.sleep(0.05)
    socket = os.stat("/run/dbus/system_bus_socket")
    print(json.dumps({
        "exec_start": exec_start,
        "environment": environment,
        "fragment": unit.Unit.FragmentPath.decode(),
        "job": job and (job[0] if isinstance(job, tuple) else job).decode(),
        "invocation_before": before,
        "invocation_after": invocation(unit),
        "systemd_pid": peer_pid(bus, b"org.freedesktop.systemd1"),
        "bus_daemon_pid": peer_pid(bus, b"org.freedesktop.DBus"),
        "pid1_ns": os.readlink("/proc/1/ns/pid"),
        "bus_socket": [socket.st_dev, socket.st_ino],
    }))
"""


def _fresh_workdir() -> Path:
    try:
        WORK_BASE.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HarnessError(f"cannot create {WORK_BASE} (run these tests as root): {e}") from e
    return Path(tempfile.mkdtemp(prefix="systemd-ns-", dir=WORK_BASE))


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = _fresh_workdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def containerd_ns() -> Iterator[tuple[SystemdNamespace, Path]]:
    """One boot for the containerd tests: containerd.service enabled, as on Flatcar."""
    if not CONTAINERD.exists():
        pytest.fail(f"{CONTAINERD} is missing: apt-get install -y containerd", pytrace=False)
    work = _fresh_workdir()
    try:
        root = work / "containerd"
        root.mkdir()
        config = root / "config.toml"
        config.write_text(CONTAINERD_CONFIG.format(root=root))
        units = {UNIT: CONTAINERD_UNIT.format(config=config)}
        with SystemdNamespace(units, work, enable=[UNIT]) as ns:
            yield ns, config
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _count(entries: list[dict[str, object]], message_id: str) -> int:
    return sum(1 for e in entries if e.get("MESSAGE_ID") == message_id)


# It plants files in the machine's /tmp to prove that the namespace does not see them.
@pytest.mark.allow_paths("/tmp/gpunode-ns-bind-*", "/tmp/gpunode-ns-test-canary-*")
def test_boots_to_running_and_leaves_the_machine_alone(workdir: Path) -> None:
    host_tmp = Path(tempfile.mkdtemp(prefix="gpunode-ns-bind-", dir="/tmp"))
    canary = Path("/tmp") / f"gpunode-ns-test-canary-{os.getpid()}"
    canary.write_text("must survive\n")
    (host_tmp / "seen").write_text("bound in\n")
    try:
        ns = SystemdNamespace({}, workdir, binds=[host_tmp])
        with ns:
            assert ns.state == "running", ns.diagnose()
            assert ns.systemctl("--failed", "--plain").stdout.strip() == ""
            # PID 1 of its own PID namespace is systemd, in container mode.
            assert ns.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
            assert ns.systemctl("show", "-p", "Virtualization", "--value").stdout.strip() == (
                "docker"
            )
            for unit in ("dbus.service", "systemd-journald.service", "systemd-logind.service"):
                assert ns.unit_property(unit, "ActiveState") == "active", unit
            # The boot's tmpfiles are masked, and /tmp inside is not the machine's.
            assert ns.unit_property("systemd-tmpfiles-setup.service", "LoadState") == "masked"
            assert ns.run(["test", "-e", str(canary)], check=False).returncode == 1
            assert ns.run(["cat", str(host_tmp / "seen")]).stdout == "bound in\n"
            # Nothing the machine enables runs in here.
            running = ns.systemctl("list-units", "--state=running", "--plain").stdout
            names = sorted(line.split()[0] for line in running.splitlines() if line.strip())
            assert names == [
                "dbus.service",
                "dbus.socket",
                "init.scope",
                "systemd-journald-dev-log.socket",
                "systemd-journald.service",
                "systemd-journald.socket",
                "systemd-logind.service",
            ]
            pid = ns.pid
            assert pid is not None
        # close(): PID 1 is gone (and with it everything inside), the canaries survived.
        assert not Path(f"/proc/{pid}").exists()
        assert canary.read_text() == "must survive\n", "the machine's /tmp was emptied!"
        assert (host_tmp / "seen").exists()
    finally:
        canary.unlink(missing_ok=True)
        shutil.rmtree(host_tmp, ignore_errors=True)


def test_a_quiet_boot_is_asked_nothing_until_its_time_is_up(workdir: Path) -> None:
    """quiet_boot (the benchmarks' boots): the harness's first check comes after it, so a boot
    shorter than it runs beside no nsenter or systemctl of the harness's."""
    with SystemdNamespace({}, workdir, quiet_boot=1.0) as ns:
        assert ns.state == "running", ns.diagnose()
        assert ns.boot_seconds is not None and ns.boot_seconds >= 1.0
        finished = ns.run(["journalctl", "--no-pager", "-o", "cat", "-b", "_PID=1"]).stdout
        assert "Startup finished in" in finished


def test_flatcar_shaped_containerd_becomes_active(
    containerd_ns: tuple[SystemdNamespace, Path],
) -> None:
    ns, config = containerd_ns
    ns.wait_active(UNIT, timeout=30)
    props = ns.unit_properties(UNIT, "SubState", "Type", "FragmentPath", "MainPID", "NRestarts")
    assert props["SubState"] == "running"
    assert props["Type"] == "notify"
    assert props["FragmentPath"] == f"/run/systemd/system/{UNIT}"
    assert int(props["MainPID"]) > 1
    assert ns.run(["cat", f"/proc/{props['MainPID']}/comm"]).stdout.strip() == "containerd"
    # It answers on the namespace's /run; its root and state are the test's.
    version = ns.run(["ctr", "--address", "/run/containerd/containerd.sock", "version"])
    assert "Server:" in version.stdout
    assert (config.parent / "root").is_dir()
    assert (config.parent / "state").is_dir()


def test_pystemd_restarts_containerd_over_the_namespace_bus(
    containerd_ns: tuple[SystemdNamespace, Path],
) -> None:
    ns, config = containerd_ns
    ns.wait_active(UNIT, timeout=30)
    props = ("InvocationID", "ExecMainStartTimestampMonotonic", "MainPID", "NRestarts")
    before = ns.unit_properties(UNIT, *props)
    journal_before = ns.journal(UNIT)
    assert _count(journal_before, UNIT_STARTED) >= 1

    result = ns.run([sys.executable, "-c", PYSTEMD, UNIT, "restart"], timeout=60)
    seen = json.loads(result.stdout)

    # What gpunode needs to read: the argv and the environment, unexpanded.
    assert seen["exec_start"] == [
        {
            "path": "/usr/bin/containerd",
            "argv": ["/usr/bin/containerd", "--config", "${CONTAINERD_CONFIG}"],
        }
    ]
    assert seen["environment"] == [f"CONTAINERD_CONFIG={config}"]
    assert seen["job"].startswith("/org/freedesktop/systemd1/job/")

    ns.wait_active(UNIT, timeout=30)
    after = ns.unit_properties(UNIT, *props)
    assert seen["invocation_before"] == before["InvocationID"]
    assert seen["invocation_after"] == after["InvocationID"] != before["InvocationID"]
    assert int(after["ExecMainStartTimestampMonotonic"]) > int(
        before["ExecMainStartTimestampMonotonic"]
    )
    assert after["MainPID"] != before["MainPID"]
    # NRestarts counts automatic restarts only: a requested restart leaves it alone, so this
    # also says that containerd did not crash and come back on its own.
    assert after["NRestarts"] == before["NRestarts"] == "0"

    # Exactly one restart: one more stop and one more start in the unit's journal.
    def restart_logged() -> list[dict[str, object]] | None:
        entries = ns.journal(UNIT)
        started = _count(entries, UNIT_STARTED) - _count(journal_before, UNIT_STARTED)
        return entries if started >= 1 else None

    journal_after = ns.wait_for(restart_logged, 10, "the restart in the journal")
    assert _count(journal_after, UNIT_STARTED) - _count(journal_before, UNIT_STARTED) == 1
    assert _count(journal_after, UNIT_STOPPED) - _count(journal_before, UNIT_STOPPED) == 1
    invocations = {e.get("INVOCATION_ID") for e in journal_after} - {None}
    assert after["InvocationID"] in invocations
    assert before["InvocationID"] in invocations


def test_the_bus_is_the_namespace_s_own(containerd_ns: tuple[SystemdNamespace, Path]) -> None:
    ns, config = containerd_ns
    ns.wait_active(UNIT, timeout=30)
    result = ns.run([sys.executable, "-c", PYSTEMD, UNIT, "inspect"], timeout=60)
    seen = json.loads(result.stdout)
    assert ns.pid is not None
    # The bus names systemd as PID 1 — of the namespace this harness made, not the machine's.
    assert seen["systemd_pid"] == 1
    assert seen["pid1_ns"] == os.readlink(f"/proc/{ns.pid}/ns/pid")
    assert seen["pid1_ns"] != os.readlink("/proc/self/ns/pid")
    assert seen["bus_daemon_pid"] == int(ns.unit_property("dbus.service", "MainPID"))
    # Its socket is the one in the namespace's private /run ...
    inside = os.stat(f"/proc/{ns.pid}/root/run/dbus/system_bus_socket")
    assert seen["bus_socket"] == [inside.st_dev, inside.st_ino]
    host = Path("/run/dbus/system_bus_socket")
    if host.exists():
        assert [host.stat().st_dev, host.stat().st_ino] != seen["bus_socket"]
    # ... and the unit it served is the test's, from the namespace's /run.
    assert seen["fragment"] == f"/run/systemd/system/{UNIT}"
    # (the config's path names this test's random work directory)
    assert seen["environment"] == [f"CONTAINERD_CONFIG={config}"]


MAIN_PROCESS = """\
import json
from gpunode.platform.systemd import DbusSystemd
main = DbusSystemd().main_process("containerd.service")
print(json.dumps({"pid": main.pid, "started": main.started} if main else None))
"""


def test_gpunode_reads_when_systemd_started_containerd_to_the_microsecond(
    containerd_ns: tuple[SystemdNamespace, Path],
) -> None:
    """gpunode.platform.systemd's main_process is systemd's MainPID and ExecMainStartTimestamp (what
    status orders the config's mtime against), as busctl reads them from the same bus."""
    ns, _ = containerd_ns
    ns.wait_active(UNIT, timeout=30)
    seen = json.loads(ns.run([sys.executable, "-c", MAIN_PROCESS], timeout=60).stdout)
    path = "/org/freedesktop/systemd1/unit/containerd_2eservice"
    busctl = ns.run(["busctl", "get-property", "org.freedesktop.systemd1", path,
                     "org.freedesktop.systemd1.Service", "ExecMainStartTimestamp",
                     "MainPID"]).stdout.split()
    assert busctl[0] == "t" and busctl[2] == "u"
    assert seen == {"pid": int(busctl[3]), "started": int(busctl[1]) / 1_000_000}
    assert seen["pid"] == int(ns.unit_property(UNIT, "MainPID"))
