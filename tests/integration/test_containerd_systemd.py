"""The containerd step against a real systemd and a real containerd, in a PID+mount namespace:
Flatcar's layout (config on /usr, CONTAINERD_CONFIG in the unit), gpunode run inside as on a
node. /usr, /etc and /var/lib are copy-on-write in there, so nothing reaches this machine."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode_testing import fixtures
from gpunode_testing.systemd_ns import MACHINE_PATHS, SystemdNamespace

pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS)

UNIT = "containerd.service"
WORK_PARENT = Path("/var/cache/gpunode-tests")  # outside /tmp, /run and the overlays
# Flatcar's unit, less what its ExecStartPre lines need (a /run/docker it makes).
FLATCAR_UNIT = "\n".join(line for line in fixtures.FLATCAR_CONTAINERD_UNIT.splitlines()
                         if not line.startswith("ExecStartPre")) + "\n"
# containerd will refuse to start when its config names this runtime (an ExecStartPre check):
# a stand-in for "the new config does not work", so the rollback runs against real systemd.
REFUSE_BROKEN = ("[Service]\nExecStartPre=/bin/sh -c "
                 "'! grep -q /broken/ $${CONTAINERD_CONFIG}'\n")


@pytest.fixture
def node() -> Iterator[SystemdNamespace]:
    workdir = WORK_PARENT / f"containerd-step-{secrets.token_hex(4)}"
    workdir.mkdir(parents=True)
    try:
        with SystemdNamespace({UNIT: FLATCAR_UNIT}, workdir, overlays=("usr", "var/lib")) as ns:
            # Flatcar has no /etc/containerd/config.toml (Debian's package ships one: gone in
            # the overlay only).
            ns.run(["rm", "-f", "/etc/containerd/config.toml"])
            ns.run(["rm", "-rf", "/var/lib/gpunode"])  # (overlay) a node gpunode never touched
            write(ns, "/usr/share/containerd/config.toml", fixtures.FLATCAR_CONTAINERD_CONFIG)
            write(ns, "/usr/bin/nvidia-container-runtime", "#!/bin/sh\nexec runc \"$@\"\n")
            ns.run(["chmod", "755", "/usr/bin/nvidia-container-runtime"])
            write(ns, f"/etc/systemd/system/{UNIT}.d/50-test.conf", REFUSE_BROKEN)
            ns.systemctl("daemon-reload")
            ns.systemctl("start", UNIT)
            ns.wait_active(UNIT)
            yield ns
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def write(ns: SystemdNamespace, path: str, text: str) -> None:
    ns.run(["sh", "-c", f"mkdir -p \"$(dirname {path})\" && cat > {path}"], input=text)


def gpunode(ns: SystemdNamespace, *args: str) -> subprocess.CompletedProcess[str]:
    return ns.run([sys.executable, "-m", "gpunode", "--log-format", "json", *args], check=False)


def invocation(ns: SystemdNamespace) -> tuple[str, str]:
    props = ns.unit_properties(UNIT, "InvocationID", "MainPID")
    return props["InvocationID"], props["MainPID"]


def test_configure_restarts_once_and_containerd_runs_the_new_config(
    node: SystemdNamespace,
) -> None:
    before = invocation(node)
    done = gpunode(node, "containerd", "configure")
    assert done.returncode == 0, done.stderr
    after = invocation(node)
    assert after != before  # exactly one restart: a new invocation, a new main process ...
    assert node.unit_property(UNIT, "NRestarts") == "0"  # ... and no crash-restart loop
    events = [json.loads(line) for line in done.stderr.splitlines()]
    assert [e["restarted"] for e in events if e.get("step") == "containerd"] == [True]
    # The running containerd reads the writable copy, through gpunode's drop-in.
    assert node.main_argv(UNIT)[1:3] == ["--config", "/etc/containerd/config.toml"]
    dumped = node.run(["containerd", "--config", "/etc/containerd/config.toml", "config",
                       "dump"]).stdout
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in dumped

    second = gpunode(node, "containerd", "configure")
    assert second.returncode == 0, second.stderr
    assert invocation(node) == after  # nothing to change: no restart


def test_containerd_that_refuses_the_new_config_gets_the_old_one_back(
    node: SystemdNamespace,
) -> None:
    gpunode(node, "containerd", "configure")
    good = node.run(["cat", "/etc/containerd/config.toml"]).stdout
    done = gpunode(node, "containerd", "configure", "--runtime-path",
                   "/broken/nvidia-container-runtime", "--force")
    assert done.returncode == 1
    assert "the previous config was restored and containerd is running with it again" in \
        done.stderr
    assert node.run(["cat", "/etc/containerd/config.toml"]).stdout == good
    assert node.unit_property(UNIT, "ActiveState") == "active"


def test_containerd_that_is_not_running_is_not_started(node: SystemdNamespace) -> None:
    node.systemctl("stop", UNIT)
    done = gpunode(node, "containerd", "configure")
    assert done.returncode == 0, done.stderr
    # "failed" when containerd's own stop ended non-zero (seen under load): stopped either way,
    # and gpunode must not have started it
    assert node.unit_property(UNIT, "ActiveState") in ("inactive", "failed")
    node.systemctl("start", UNIT)  # when it starts, it reads the new config
    node.wait_active(UNIT)
    assert node.main_argv(UNIT)[1:3] == ["--config", "/etc/containerd/config.toml"]


def test_revert_puts_containerd_back_on_the_original_config(node: SystemdNamespace) -> None:
    gpunode(node, "containerd", "configure")
    done = gpunode(node, "containerd", "revert")
    assert done.returncode == 0, done.stderr
    assert node.main_argv(UNIT)[1:3] == ["--config", "/usr/share/containerd/config.toml"]
    assert node.run(["test", "-e", "/etc/containerd/config.toml"], check=False).returncode == 1


def test_a_new_memlock_dropin_alone_restarts_a_running_containerd_once(
    node: SystemdNamespace,
) -> None:
    """The config already has the runtime (limit_memlock was off): switching it on changes
    only the drop-in, which a running containerd sees after a daemon-reload and one restart;
    switching it off again removes it the same way."""
    write(node, "/etc/gpunode/config.toml", "[containerd]\nlimit_memlock = false\n")
    assert gpunode(node, "containerd", "configure").returncode == 0
    assert node.unit_property(UNIT, "LimitMEMLOCK") != "infinity"
    before = invocation(node)
    write(node, "/etc/gpunode/config.toml", "[containerd]\nlimit_memlock = true\n")
    done = gpunode(node, "containerd", "configure")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines()]
    assert [e["restarted"] for e in events if e.get("step") == "containerd"] == [True]
    assert invocation(node) != before and node.unit_property(UNIT, "NRestarts") == "0"
    assert node.unit_property(UNIT, "LimitMEMLOCK") == "infinity"
    after = invocation(node)
    assert gpunode(node, "containerd", "configure").returncode == 0
    assert invocation(node) == after  # nothing to change: no restart
    write(node, "/etc/gpunode/config.toml", "[containerd]\nlimit_memlock = false\n")
    assert gpunode(node, "containerd", "configure").returncode == 0
    assert node.run(["test", "-e", "/etc/systemd/system/containerd.service.d/"
                     "20-gpunode-memlock.conf"], check=False).returncode == 1
    assert node.unit_property(UNIT, "LimitMEMLOCK") != "infinity"
