"""The command line as a process: the installed console script as systemd runs it, and which of
the heavy modules a run imports (`python -X importtime` lists every module a process imported):
each is imported only by a step that needs it. In-process: tests/unit/test_cli.py and
test_cli_pipeline.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import HostFactory
from gpunode.platform.host import Host


def imports_of_a_second_run(*argv: str) -> tuple[set[str], str]:
    """`python -X importtime -m gpunode ARGV`, run twice (the first makes any change): the
    modules the second run imported, and its stderr."""
    command = [sys.executable, "-X", "importtime", "-m", "gpunode", *argv]
    subprocess.run(command, capture_output=True, check=True)
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    return imported, done.stderr


def test_installed_command_runs_as_a_process(make_host: HostFactory) -> None:
    """The console script as systemd would run it: JSON logs on stderr (not a TTY)."""
    host = make_host("nc4as-t4-v3", "ready")
    gpunode = Path(sys.executable).with_name("gpunode")
    done = subprocess.run([str(gpunode), "--root", str(host.root), "status"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "READY" in done.stdout.splitlines()[0]
    assert json.loads(done.stderr.splitlines()[0])["event"] == "step.done"
    version = subprocess.run([str(gpunode), "--version"], capture_output=True, text=True,
                             check=True)
    assert version.stdout.strip().startswith("gpunode ")


def test_configure_writes_with_tomlkit_and_a_run_without_change_reads_only(
        flatcar: Host) -> None:
    """The first run writes the runtime's tables (tomlkit); the no-change run decides from
    tomllib alone; under --root no bus is asked."""
    command = [sys.executable, "-X", "importtime", "-m", "gpunode", "--root", str(flatcar.root),
               "containerd", "configure"]
    first = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "nvidia-container-runtime" in (flatcar.root / "etc/containerd/config.toml").read_text()
    imported = {line.split("|")[-1].strip() for line in first.stderr.splitlines()
                if line.startswith("import time:")}
    assert {"gpunode.containerd.edit", "tomlkit"} <= imported
    assert not {m for m in imported if m.split(".")[0] in ("pystemd",)}
    imported, _ = imports_of_a_second_run("--root", str(flatcar.root), "containerd", "configure")
    assert "gpunode.containerd.edit" in imported
    assert not {m for m in imported if m.split(".")[0] in ("tomlkit", "pystemd")}


HEAVY = {"tomlkit", "structlog", "pyudev", "yaml", "pystemd", "http.client", "ssl",
         "gpunode.kube.client"}


def heavy(imported: set[str]) -> set[str]:
    return {m for m in imported if m in HEAVY or m.split(".")[0] in HEAVY}


def test_a_boot_that_changes_nothing_and_status_import_no_heavy_module(
        make_host: HostFactory) -> None:
    """Under --root, JSON logs, the chart registering the node: no TOML writer, no console
    renderer, no udev, no YAML, no bus, no Kubernetes client."""
    node = make_host("nc4as-t4-v3", "ready")
    imported, stderr = imports_of_a_second_run("--root", str(node.root), "boot")
    assert {"gpunode.pipeline.boot", "gpunode.containerd.step"} <= imported
    assert json.loads(stderr.splitlines()[-1])["event"] == "boot.done"
    assert heavy(imported) == set()
    imported, _ = imports_of_a_second_run("--root", str(node.root), "status", "--json")
    assert "gpunode.status.checks" in imported
    assert heavy(imported) == set()


def test_a_cpu_node_s_boot_imports_none_of_the_pipeline(make_host: HostFactory) -> None:
    node = make_host("azure-d4s-v5", "bare")
    command = [sys.executable, "-X", "importtime", "-m", "gpunode", "--root", str(node.root),
               "boot"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "gpunode.pipeline.shortcut" in imported
    assert not imported & {"gpunode.pipeline.boot", "gpunode.platform.systemd",
                           "gpunode.driver.step", "gpunode.containerd.step"}
    assert heavy(imported) == set()
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["step.done", "boot.done"]
    assert json.loads((node.root / "run/gpunode/state.json").read_text())["outcome"] == "no-gpu"


def test_status_of_a_node_that_has_not_joined_imports_no_kubernetes_client(
        make_host: HostFactory) -> None:
    node = make_host("nc4as-t4-v3", "ready")  # no kubeconfig: the node check is a skip
    imported, _ = imports_of_a_second_run("--root", str(node.root), "status", "--json")
    assert "gpunode.status.checks" in imported
    assert not imported & {"gpunode.kube.client", "http.client", "ssl"}


def test_the_exit_keeps_exit_codes_and_every_byte(make_host: HostFactory) -> None:
    """What the command printed arrives whole through a pipe, the atexit handlers run, and the
    exit code is main()'s (gpunode.cli.main.run)."""
    host = make_host("nd96amsr-a100-v4", "ready")
    gpunode = str(Path(sys.executable).with_name("gpunode"))
    listing = subprocess.run([gpunode, "--root", str(host.root), "cdi", "generate"],
                             capture_output=True, check=False)
    assert listing.returncode == 0, listing.stderr
    assert len(listing.stdout) > 8192  # more than stdout's buffer holds
    header, _, spec = listing.stdout.decode().partition("\n")
    assert header.startswith("# Written by gpunode")
    assert len(json.loads(spec)["devices"]) == 17  # by index, by UUID, "all": every byte came
    refused = subprocess.run([gpunode, "--root", str(host.root), "boot", "--bogus"],
                             capture_output=True, check=False)
    assert refused.returncode == 2
    atexit_runs = subprocess.run(
        [sys.executable, "-c", "import atexit, sys; atexit.register(print, 'atexit ran'); "
         "sys.argv = ['gpunode', '--version']; from gpunode.cli.main import run; run()"],
        capture_output=True, text=True, check=False)
    assert (atexit_runs.returncode, atexit_runs.stdout) == (0, "gpunode 0.1.0\natexit ran\n")
    for closed in ("1", "2"):  # started with stdout or stderr closed: nothing to flush there
        for words in ("--version", f"--root {host.root} status --json", f"--root {host.root} "
                      "cdi generate"):
            done = subprocess.run(f"{gpunode} {words} {closed}>&-", shell=True,
                                  capture_output=True, text=True, check=False)
            assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    failed = subprocess.run([gpunode, "--root", str(host.root), "--log-format", "json",
                             "boot", "--config", str(host.root / "missing.toml")],
                            capture_output=True, text=True, check=False)
    assert failed.returncode == 2 and json.loads(failed.stderr.splitlines()[-1])["event"] \
        == "command.refused"


def test_boot_and_plan_resolve_root_and_config_alike(tmp_path: Path) -> None:
    """`--root link/..` is the parent of where the link points, not the link's own directory
    (cli/common.py host_for): boot and `plan` name the same tree, and refuse a root that is a
    file in the same words."""
    target = tmp_path / "elsewhere" / "node"
    target.mkdir(parents=True)
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "link").symlink_to(target)
    (tmp_path / "elsewhere" / "etc/gpunode").mkdir(parents=True)
    (tmp_path / "elsewhere" / "etc/gpunode/config.toml").write_text("[log]\nlevel = 7\n")
    (tmp_path / "cwd" / "afile").write_text("")
    gpunode = str(Path(sys.executable).with_name("gpunode"))
    for command in ("boot", "plan"):
        done = subprocess.run([gpunode, "--root", "link/..", "--log-format", "json", command],
                              cwd=tmp_path / "cwd", capture_output=True, text=True, check=False)
        event = json.loads(done.stderr.splitlines()[-1])
        assert (done.returncode, event["event"]) == (2, "command.refused"), done.stderr
        assert event["file"] == str(tmp_path / "elsewhere/etc/gpunode/config.toml")
        done = subprocess.run([gpunode, "--root", "afile", "--log-format", "console", command],
                              cwd=tmp_path / "cwd", capture_output=True, text=True, check=False)
        assert (done.returncode, done.stderr.splitlines()[0]) == (
            2, "gpunode: --root afile: not a directory")
