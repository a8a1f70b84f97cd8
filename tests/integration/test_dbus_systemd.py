"""gpunode's systemd adapter (gpunode/platform/systemd.py, over pystemd) against a real systemd and
dbus-daemon in a namespace (gpunode_testing.systemd_ns): what DbusSystemd reads is what
`systemctl show` reads, over systemd's private socket (root) and over the system bus, and a
restart through it restarts the unit once."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode_testing.systemd_ns import MACHINE_PATHS, SystemdNamespace

WORK_BASE = Path("/var/lib/gpunode-tests")
pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS, str(WORK_BASE))

UNIT = "sleeper.service"
SLEEPER = """[Unit]
Description=a service for gpunode's D-Bus client to read
[Service]
Environment=ONE=1 "TWO=two words"
EnvironmentFile=-/etc/gpunode/absent.env
ExecStart=/bin/sleep infinity
[Install]
WantedBy=multi-user.target
"""

# Run inside by this venv's python: every read DbusSystemd makes, over the transport named.
READS = """\
import json, sys
from gpunode.platform import systemd
# the system bus, as a non-root gpunode status connects; else what root gets: the private socket
manager = (systemd.DbusSystemd("unix:path=/run/dbus/system_bus_socket") if sys.argv[1] == "bus"
           else systemd.DbusSystemd())
unit = sys.argv[2]
before = manager.main_process(unit)
out = {"active": manager.active_state(unit), "enabled": manager.enabled(unit),
       "exec": None, "main": before and [before.pid, before.started],
       "missing": manager.active_state("no-such.service"),
       "missing_exec": manager.exec_start("no-such.service")}
ex = manager.exec_start(unit)
out["exec"] = [list(ex.argv), ex.environment, list(ex.environment_files)]
if sys.argv[3:] == ["restart"]:
    manager.restart(unit, 30)
    after = manager.main_process(unit)
    out["after"] = [after.pid, after.started]
try:
    manager.restart("no-such.service", 5)
except systemd.SystemdError as exc:
    out["refused"] = [type(exc).__name__, str(exc)]
manager.daemon_reload()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ns() -> Iterator[SystemdNamespace]:
    WORK_BASE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dbus-", dir=WORK_BASE))
    try:
        with SystemdNamespace({UNIT: SLEEPER}, work, enable=[UNIT]) as namespace:
            namespace.wait_active(UNIT)
            yield namespace
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("transport", ["private", "bus"])
def test_reads_are_what_systemctl_shows(ns: SystemdNamespace, transport: str) -> None:
    seen = json.loads(ns.run([sys.executable, "-c", READS, transport, UNIT]).stdout)
    props = ns.unit_properties(UNIT, "MainPID", "ExecMainStartTimestamp", "UnitFileState")
    assert seen["active"] == "active"
    assert seen["enabled"] is True and props["UnitFileState"] == "enabled-runtime"
    assert seen["exec"] == [["/bin/sleep", "infinity"], {"ONE": "1", "TWO": "two words"},
                            ["/etc/gpunode/absent.env"]]
    assert seen["main"][0] == int(props["MainPID"])
    busctl = ns.run(["busctl", "get-property", "org.freedesktop.systemd1",
                     "/org/freedesktop/systemd1/unit/sleeper_2eservice",
                     "org.freedesktop.systemd1.Service", "ExecMainStartTimestamp"]).stdout
    assert round(seen["main"][1] * 1_000_000) == int(busctl.split()[1])
    # A unit systemd does not have: inactive (not-found), no ExecStart; a restart of it is
    # systemd's refusal with its own words, not "no systemd".
    assert seen["missing"] == "inactive" and seen["missing_exec"] is None
    kind, message = seen["refused"]
    assert kind == "SystemdError"
    assert "no-such.service" in message and "not found" in message


def test_a_restart_restarts_the_unit_once(ns: SystemdNamespace) -> None:
    before = int(ns.unit_property(UNIT, "MainPID"))
    seen = json.loads(ns.run([sys.executable, "-c", READS, "private", UNIT, "restart"],
                             timeout=60).stdout)
    after = int(ns.unit_property(UNIT, "MainPID"))
    assert seen["main"][0] == before != after == seen["after"][0]
    assert seen["after"][1] > seen["main"][1]
    assert ns.unit_property(UNIT, "NRestarts") == "0"  # requested, not a crash


MANY = """\
import sys
from gpunode.platform import systemd
address = {"private": "unix:path=/run/systemd/private",
           "bus": "unix:path=/run/dbus/system_bus_socket"}[sys.argv[1]]
states = []
for _ in range(50):
    manager = systemd.DbusSystemd(address, direct=sys.argv[1] == "private")
    states.append(manager.active_state("sleeper.service"))
print(",".join(sorted(set(states))), len(states))
"""


@pytest.mark.parametrize("transport", ["private", "bus"])
def test_every_new_connection_s_first_call_is_answered(ns: SystemdNamespace,
                                                       transport: str) -> None:
    """A first call sent right after the authentication is answered each time (sd-bus's
    server can leave a message that arrives with the authentication's BEGIN unanswered,
    systemd#17425: a 25 s stall at boot where the client is not sd-bus)."""
    done = ns.run([sys.executable, "-c", MANY, transport], timeout=120, check=False,
                  env={"SYSTEMD_BUS_TIMEOUT": "2"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["active", "50"]
