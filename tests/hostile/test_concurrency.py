"""Two gpunode commands on one node at once: the node lock serialises those that change it,
the others never wait, and concurrent runs all succeed and leave a correct, temp-free tree."""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.platform import nodelock
from gpunode.platform.host import Host
from gpunode_testing import fixtures
from hostile.support import Cli, check_refusal

LOCK = "run/gpunode/lock"
REPO = Path(__file__).resolve().parents[2]


@contextmanager
def held_elsewhere(root: Path, pid: int = 4242, command: str = "boot") -> Iterator[None]:
    """The lock as another gpunode holds it: its own open file, flocked, naming its pid."""
    path = root / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, f"{pid} {command}\n".encode())
        yield
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodelock, "WAIT_SECONDS", 0.3)
    monkeypatch.setattr(nodelock, "BOOT_WAIT_SECONDS", 0.6)


def _runtime(host: Host) -> Host:
    binary = host.root / "usr/bin/nvidia-container-runtime"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return host


@pytest.mark.parametrize("argv", [
    ["boot"], ["driver", "load"], ["driver", "build"], ["containerd", "configure"],
    ["containerd", "revert"],
], ids=["boot", "driver-load", "driver-build", "configure", "revert"])
def test_a_command_that_changes_the_node_waits_then_names_the_lock_holder(
    make_host: HostFactory, cli: Cli, argv: list[str]
) -> None:
    host = _runtime(make_host("nc4as-t4-v3", "driver"))
    with held_elsewhere(host.root):
        started = time.monotonic()
        check_refusal(cli, host.root, ["--root", str(host.root), *argv], 1,
                      r"another gpunode command \(pid 4242, gpunode boot\) is changing this "
                      r"node and holds .*/run/gpunode/lock; gave up after waiting")
        waited = time.monotonic() - started
    assert waited >= (0.6 if argv == ["boot"] else 0.3)


@pytest.mark.parametrize("argv", [
    ["status"], ["detect"], ["plan"], ["driver", "status"], ["containerd", "configure",
                                                             "--dry-run"],
], ids=["status", "detect", "plan", "driver-status", "configure-dry-run"])
def test_read_only_commands_take_no_lock(
    make_host: HostFactory, cli: Cli, argv: list[str]
) -> None:
    host = _runtime(make_host("nc4as-t4-v3", "driver"))
    with held_elsewhere(host.root):
        result = cli("--root", str(host.root), *argv)
    assert result.code in (0, 1)
    assert "is changing this node" not in result.err


def test_the_lock_is_a_private_file_under_the_root_naming_its_holder(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    assert cli("--root", str(host.root), "driver", "load").code == 0
    lock = host.root / LOCK
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert lock.read_text() == f"{os.getpid()} driver load\n"


def test_a_lock_released_while_waiting_is_taken(make_host: HostFactory, cli: Cli,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    monkeypatch.setattr(nodelock, "WAIT_SECONDS", 5.0)
    path = host.root / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    real_sleep = time.sleep

    def release_then_sleep(seconds: float) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", release_then_sleep)  # the lock's poll (Host.lock)
    try:
        result = cli("--root", str(host.root), "driver", "load")
    finally:
        os.close(fd)
    assert result.code == 0
    assert result.events[0]["event"] == "lock.waiting"


@pytest.mark.parametrize("odd", ["fifo", "directory", "symlink"])
def test_a_lock_path_that_is_no_file_is_refused(
    make_host: HostFactory, cli: Cli, odd: str
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    path = host.root / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    {"fifo": lambda: os.mkfifo(path), "directory": path.mkdir,
     "symlink": lambda: path.symlink_to("/etc/passwd")}[odd]()
    reason = {"fifo": "is a FIFO", "directory": "is a directory|Is a directory",
              "symlink": "is a symlink, not the lock file"}[odd]
    before = os.lstat(path)
    result = cli("--root", str(host.root), "driver", "load")
    assert result.code == 1
    assert len(result.errors) == 1
    assert re.search(reason, str(result.errors[0]["error"]))
    assert os.lstat(path).st_mode == before.st_mode
    assert not (host.root / "etc/passwd").exists()  # nothing made where a link points


# -- real concurrent processes -----------------------------------------------------------------


def _spawn(root: Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gpunode", "--root", str(root), "--log-format",
                             "json", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        results.append((p.returncode, err))
    return results


def _assert_tree(root: Path) -> None:
    temps = [str(p) for p in root.rglob("*") if p.name.endswith(".gpunode-tmp")]
    assert temps == []
    for path, (major, minor) in {"dev/nvidiactl": (195, 255), "dev/nvidia0": (195, 0),
                                 "dev/nvidia-uvm": (508, 0), "dev/nvidia-uvm-tools": (508, 1),
                                 "dev/nvidia-modeset": (195, 254)}.items():
        st = (root / path).lstat()
        assert stat.S_ISCHR(st.st_mode), path
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), path
        assert stat.S_IMODE(st.st_mode) == 0o666
        assert os.readlink(root / f"dev/char/{major}:{minor}") == f"../{path[4:]}"


N = 6


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0, reason="making character devices needs root")
def test_concurrent_driver_loads_on_one_root_all_succeed(tmp_path: Path) -> None:
    root = fixtures.build(fixtures.MACHINES["nc4as-t4-v3"], tmp_path / "node",
                          fixtures.Options(state="driver"))
    for node in (root / "dev").glob("nvidia*"):
        node.unlink()
    results = _finish([_spawn(root, "driver", "load") for _ in range(N)])
    assert [code for code, _ in results] == [0] * N, [err for _, err in results]
    assert all("Traceback" not in err for _, err in results)
    _assert_tree(root)


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0, reason="making character devices needs root")
def test_concurrent_boots_on_one_root_serialise_and_all_succeed(tmp_path: Path) -> None:
    root = fixtures.build(fixtures.MACHINES["nc4as-t4-v3"], tmp_path / "node",
                          fixtures.Options(state="driver"))
    _runtime(Host(root))
    for node in (root / "dev").glob("nvidia*"):
        node.unlink()
    procs = [_spawn(root, "boot") for _ in range(N)]
    procs += [_spawn(root, "containerd", "configure") for _ in range(2)]
    results = _finish(procs)
    assert [code for code, _ in results] == [0] * len(procs), [err for _, err in results]
    _assert_tree(root)
    record = json.loads((root / "run/gpunode/state.json").read_text())
    assert record["outcome"] == "ok"
    config = (root / "etc/containerd/config.toml").read_text()
    assert config.count('runtimes.nvidia]') == 1
