"""The command line as a process: the installed console script as systemd runs it, and what
a second, no-change run imports (`python -X importtime` lists every module a process imported).
In-process: tests/unit/test_cli.py, test_cli_pipeline.py and test_fastpath.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.host import Host


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


def test_configure_imports_neither_tomlkit_nor_the_bus(flatcar: Host) -> None:
    """The first run's change only appends the runtime's tables, written by tomltext itself;
    the no-change run decides from tomllib alone."""
    command = [sys.executable, "-X", "importtime", "-m", "gpunode", "--root", str(flatcar.root),
               "containerd", "configure"]
    first = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "nvidia-container-runtime" in (flatcar.root / "etc/containerd/config.toml").read_text()
    imported = {line.split("|")[-1].strip() for line in first.stderr.splitlines()
                if line.startswith("import time:")}
    assert "gpunode.containerd.edit" in imported  # the measurement sees gpunode's own modules
    assert not {m for m in imported if m.split(".")[0] in ("tomlkit", "pystemd")}
    imported, _ = imports_of_a_second_run("--root", str(flatcar.root), "containerd", "configure")
    assert "gpunode.containerd.edit" in imported
    assert not {m for m in imported if m.split(".")[0] in ("tomlkit", "pystemd")}


def test_a_pipeline_that_changes_nothing_and_status_import_only_what_they_use(
        make_host: HostFactory, tmp_path: Path) -> None:
    """Neither runs a program, digests a file, nor makes a dataclass without a docstring:
    no subprocess, no hashlib (OpenSSL), and `dataclasses` without `inspect`
    (gpunode.dataclass_cache), each several ms of every boot; nor pathlib, which the host
    boundary does without (with re, fnmatch, urllib.parse and ipaddress, ~4 ms). Nor typing,
    tomllib, datetime or string (~15% of a boot): the agent config and containerd's are read
    by gpunode.tomlsubset, and gpunode imports typing for type checkers only."""
    node = make_host("nc4as-t4-v3", "ready")
    config = tmp_path / "config.toml"  # --config: the whole pipeline, not the no-op boot
    config.write_text('[detect]\nsource = "sysfs"\n\n[log]\nlevel = "info"\n')
    unused = {"inspect", "ast", "dis", "subprocess", "hashlib", "_hashlib", "pathlib",
              "typing", "tomllib", "datetime", "string",
              "gpunode.kube.registration"}  # the default registers through the chart
    imported, stderr = imports_of_a_second_run("--root", str(node.root), "--config",
                                               str(config), "boot")
    assert {"gpunode.boot", "gpunode.containerd.step", "dataclasses"} <= imported
    assert json.loads(stderr.splitlines()[-1])["event"] == "boot.done"
    assert not imported & unused
    imported, _ = imports_of_a_second_run("--root", str(node.root), "status", "--json")
    assert {"gpunode.status.checks", "dataclasses"} <= imported
    assert not imported & (unused | {"argparse", "gpunode.cli",  # clirun.plain
                                     "gpunode.nodelock"})  # no change is pending


def test_a_first_boot_records_its_change_without_openssl_base64_or_difflib(
        flatcar: Host) -> None:
    """The first boot writes containerd's config through the journal, which digests and keeps
    what it replaces, and records its line changes in the ledger: with CPython's own SHA-256,
    binascii and the one insert an append is, not hashlib (libcrypto, ~3 ms), base64 (~1 ms)
    or difflib (~1.5 ms) on the boot every GPU node waits for."""
    command = [sys.executable, "-X", "importtime", "-m", "gpunode", "--root", str(flatcar.root),
               "boot"]
    first = subprocess.run(command, capture_output=True, text=True, check=True)
    names = [line.split("|")[-1].strip() for line in first.stderr.splitlines()
             if line.startswith("import time:")]
    imported = set(names)
    assert "nvidia-container-runtime" in (flatcar.root / "etc/containerd/config.toml").read_text()
    assert "gpunode.containerd.journal" in imported
    assert not imported & {"hashlib", "_hashlib", "base64", "difflib", "typing", "tomllib"}
    # looked for once (on 3.11 it is not there: each failed import searches all of sys.path)
    assert names.count("_sha2") <= 1


@pytest.mark.parametrize("state", ["ready", "driver"])
@pytest.mark.parametrize("words", [["status"], ["status", "--json"]])
def test_a_plain_status_answers_as_the_full_command_line_does(
        make_host: HostFactory, state: str, words: list[str]) -> None:
    """clirun.plain's `status` and argparse's (cli.main) print the same, exit the same."""
    node = make_host("nc4as-t4-v3", state)
    argv = ["--root", str(node.root), "--log-format", "json", *words]
    plain = subprocess.run([sys.executable, "-m", "gpunode", *argv], capture_output=True,
                           text=True, check=False)
    full = subprocess.run([sys.executable, "-c", "import sys; from gpunode.cli import main; "
                           "sys.exit(main(sys.argv[1:]))", *argv], capture_output=True,
                          text=True, check=False)
    assert plain.returncode == full.returncode == (0 if state == "ready" else 1)
    assert plain.stdout == full.stdout and plain.stdout.strip()
    events = [json.loads(line) for line in (plain.stderr + full.stderr).splitlines()]
    assert [e["event"] for e in events] == ["step.done", "step.done"]
    assert events[0]["verdict"] == events[1]["verdict"]


def test_no_op_boot_imports_none_of_the_pipeline(make_host: HostFactory) -> None:
    node = make_host("nc4as-t4-v3", "ready")
    imported, stderr = imports_of_a_second_run("--root", str(node.root), "boot")
    assert "gpunode.fastpath" in imported
    assert not imported & {"gpunode.cli", "argparse", "dataclasses", "tomllib", "psutil"}
    assert json.loads(stderr.splitlines()[-1])["event"] == "boot.unchanged"


def test_a_cpu_node_s_first_boot_imports_none_of_the_pipeline(make_host: HostFactory) -> None:
    node = make_host("azure-d4s-v5", "bare")
    command = [sys.executable, "-X", "importtime", "-m", "gpunode", "--root", str(node.root),
               "boot"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "gpunode.fastpath" in imported
    assert not imported & {"gpunode.cli", "gpunode.host", "argparse", "dataclasses", "tomllib",
                           "json", "re", "typing"}
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["step.done", "boot.done"]
    assert json.loads((node.root / "run/gpunode/state.json").read_text())["outcome"] == "no-gpu"


def test_a_gpu_node_s_plain_boot_runs_without_the_command_line_parser(
        make_host: HostFactory) -> None:
    """`gpunode boot` with at most --root, --config and --log-format goes through
    clirun.plain: the whole pipeline, none of argparse and the other commands."""
    node = make_host("nc4as-t4-v3", "driver")
    command = [sys.executable, "-X", "importtime", "-m", "gpunode", "--root", str(node.root),
               "--log-format", "json", "boot"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert {"gpunode.clirun", "gpunode.boot", "gpunode.containerd.step"} <= imported
    assert not imported & {"argparse", "gpunode.cli", "gpunode.cliargs", "gpunode.ignition"}
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "boot.done"
    assert [e["step"] for e in events if e["event"] in ("step.done", "step.failed")] == [
        "detect", "driver", "cdi", "containerd"]


def test_status_of_a_node_that_has_not_joined_imports_no_kubernetes_client(
        make_host: HostFactory) -> None:
    node = make_host("nc4as-t4-v3", "ready")  # no kubeconfig: the node check is a skip
    imported, _ = imports_of_a_second_run("--root", str(node.root), "status", "--json")
    assert "gpunode.status.checks" in imported
    assert not imported & {"gpunode.kube.client", "http.client", "ssl"}


def test_the_fast_exit_keeps_exit_codes_and_every_byte(make_host: HostFactory) -> None:
    """The command ends without Python's teardown (gpunode.entry.run): what it printed
    arrives whole through a pipe, the atexit handlers run, and the exit code is main()'s."""
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
         "sys.argv = ['gpunode', '--version']; from gpunode.entry import run; run()"],
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


def test_a_plain_boot_resolves_root_and_config_as_the_full_command_line_does(
        tmp_path: Path) -> None:
    """`--root link/..` is the parent of where the link points, not the link's own directory
    (clirun.host_for resolves it, whichever way in): the plain boot and `plan` name the same
    tree, and refuse a root that is a file in the same words."""
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
