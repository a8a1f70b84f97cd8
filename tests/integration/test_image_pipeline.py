"""The image-pipeline examples of packaging/image-bake/ (docs/image-bake.md), run where they
can be and checked where they cannot:

- bake-mounted-image.sh for real, as root, on a disk image in Flatcar's layout
  (tests/helpers/flatcar_disk.py: GPT, USR-A and ROOT as ext4) attached by loop devices: the
  bake lands on ROOT, USR-A is untouched, nothing stays mounted or attached, also when the
  bake fails;
- bake-in-vm.sh (the step Packer's shell provisioner and the Ansible role run) for real
  through the Ansible role, with ansible-playbook inside a real systemd in a namespace that
  has Flatcar's os-release (the image-build machine), the real gpunode sysext merged from
  /run/extensions for the bake, and a stand-in flatcar-reset recording what it is asked to
  keep;
- `bash -n` and shellcheck on both scripts; the playbook and role parsed (PyYAML) and checked
  by `ansible-playbook --syntax-check`, which refuses a module name it cannot resolve;
- the Packer template parsed as HCL2 (python-hcl2, a parser independent of Packer) and its
  references checked. There is no Packer and no KVM here: the template is never built.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml

import gpunode
from conftest import REPO
from gpunode.bake import config as bake_config
from gpunode.delivery import ignition
from gpunode_testing import fixtures
from gpunode_testing.systemd_ns import MACHINE_PATHS, SystemdNamespace
from helpers import flatcar_disk
from helpers.bake import make_inputs, sha512
from helpers.sysext import IMAGE_NAME, Built

PIPELINES = REPO / "packaging" / "image-bake"
MOUNTED = PIPELINES / "bake-mounted-image.sh"
IN_VM = PIPELINES / "bake-in-vm.sh"
PACKER = PIPELINES / "packer" / "flatcar-gpunode.pkr.hcl"
ANSIBLE = PIPELINES / "ansible"
BIN = Path(sys.executable).parent


def script_flags(script: Path) -> set[str]:
    """The options a script's argument loop accepts (its `--name)` case labels)."""
    return set(re.findall(r"^\s+(--[a-z-]+)\)", script.read_text(), re.MULTILINE))


# -- the scripts, the playbook, the template ----------------------------------------------------


@pytest.mark.parametrize("script", [MOUNTED, IN_VM], ids=lambda p: p.name)
def test_the_scripts_pass_bash_n_and_shellcheck(script: Path) -> None:
    for argv in (["bash", "-n", str(script)], ["shellcheck", "-x", str(script)]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("script", "argv", "message"), [
    (MOUNTED, [], "^usage: sudo bake-mounted-image.sh --image"),
    (MOUNTED, ["--image", "/nonexistent.bin", "--config", "{config}"], "--image /nonexistent.bin: "
     "not a file"),
    (MOUNTED, ["--image", "{config}", "--config", "/nonexistent.toml"], "--config /nonexistent"),
    (MOUNTED, ["--image", "{config}", "--config", "{config}", "--gpunode", "x",
               "--gpunode-sysext", "y"], "not both"),
    (MOUNTED, ["--image", "{config}", "--bogus"], "unknown argument '--bogus'"),
    (IN_VM, ["--config", "{config}"], "^usage: sudo bake-in-vm.sh --config"),
    (IN_VM, ["--config", "{config}", "--gpunode-sysext", "{config}"], "not Flatcar"),
    (IN_VM, ["--reset", "--config", "/nonexistent.toml", "--gpunode-sysext", "{config}"],
     "--config /nonexistent.toml: not a file"),
], ids=["mounted-no-args", "mounted-no-image", "mounted-no-config", "mounted-two-gpunodes",
        "mounted-unknown-flag", "vm-no-sysext", "vm-not-flatcar", "vm-no-config"])
def test_a_bad_invocation_exits_2_with_one_message_and_touches_nothing(
        tmp_path: Path, script: Path, argv: list[str], message: str) -> None:
    config = tmp_path / "bake.toml"
    config.write_text("")
    done = subprocess.run(["bash", str(script), *(a.format(config=config) for a in argv)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert done.stdout == "" and sorted(tmp_path.iterdir()) == [config]


def test_the_example_bake_config_and_agent_config_are_accepted_by_gpunode() -> None:
    config = bake_config.load(str(PIPELINES / "bake.toml"))
    assert [d.name for d in config.drivers] == ["nvidia-drivers-570-open"]
    assert config.agent_config == str(PIPELINES / "gpunode.toml")
    ignition.agent_config(config.agent_config)  # raises ConfigError when the node would refuse


def ansible_env(home: Path) -> dict[str, str]:
    return {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home),
            "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
            "ANSIBLE_REMOTE_TEMP": str(home / "tmp")}


def syntax_check(playbooks: Path, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", "localhost,",
                           str(playbooks / "bake-gpunode.yml")], env=ansible_env(home),
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_ansible_playbook_parses_and_names_only_modules_ansible_resolves(
        tmp_path: Path) -> None:
    for path in sorted(ANSIBLE.rglob("*.yml")):
        assert yaml.safe_load(path.read_text()) is not None, path
    tasks = yaml.safe_load((ANSIBLE / "roles/gpunode_bake/tasks/main.yml").read_text())
    modules = {key for task in tasks for key in task if key.startswith("ansible.")}
    assert modules == {"ansible.builtin.assert", "ansible.builtin.file", "ansible.builtin.copy",
                       "ansible.builtin.script", "ansible.builtin.debug"}
    done = syntax_check(ANSIBLE, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # The check checks: a misspelt module is refused.
    broken = tmp_path / "broken"
    shutil.copytree(PIPELINES, broken)
    main = broken / "ansible/roles/gpunode_bake/tasks/main.yml"
    main.write_text(main.read_text().replace("ansible.builtin.copy:", "ansible.builtin.kopy:"))
    refused = syntax_check(broken / "ansible", tmp_path)
    assert refused.returncode != 0 and "ansible.builtin.kopy" in refused.stdout + refused.stderr


def test_the_ansible_role_passes_bake_in_vm_only_options_it_accepts() -> None:
    tasks = yaml.safe_load((ANSIBLE / "roles/gpunode_bake/tasks/main.yml").read_text())
    command = next(t["ansible.builtin.script"]["cmd"] for t in tasks
                   if "ansible.builtin.script" in t)
    assert command.startswith("{{ role_path }}/../../../bake-in-vm.sh ")
    assert (ANSIBLE / "roles/gpunode_bake/../../../bake-in-vm.sh").resolve() == IN_VM
    assert set(re.findall(r"--[a-z-]+", command)) <= script_flags(IN_VM)


def unquoted(value: Any) -> Any:
    """python-hcl2 (8.x) keeps the quotes of block labels and strings ('"qemu"'): without."""
    if isinstance(value, dict):
        return {unquoted(k): unquoted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unquoted(v) for v in value]
    if isinstance(value, str) and len(value) > 1 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


# python-hcl2 writes its parser's cache beside itself on first use.
@pytest.mark.allow_paths(str(Path(hcl2.__file__).parent / ".lark_cache*"))
def test_the_packer_template_parses_as_hcl2_and_uses_only_what_it_declares() -> None:
    text = PACKER.read_text()
    template = unquoted(hcl2.loads(text))
    declared = {name for block in template["variable"] for name in block}
    assert set(re.findall(r"\bvar\.(\w+)", text)) == declared
    local_names = {name for block in template["locals"] for name in block}
    assert set(re.findall(r"\blocal\.(\w+)", text)) <= local_names
    sources = {f"source.{kind}.{name}" for block in template["source"]
               for kind in block for name in block[kind]}
    (build,) = template["build"]
    assert set(build["sources"]) <= sources == {"source.qemu.flatcar"}
    kinds = [kind for p in build["provisioner"] for kind in p]
    assert kinds == ["shell", "file", "shell"]  # Packer's built-in provisioners
    copied = build["provisioner"][1]["file"]["sources"]
    assert any("bake-in-vm.sh" in s for s in copied) and IN_VM.exists()
    bake = " ".join(build["provisioner"][2]["shell"]["inline"])
    assert "bake-in-vm.sh" in bake
    assert set(re.findall(r"(?<![\w-])--[a-z-]+", bake)) <= script_flags(IN_VM)
    # Flatcar's QEMU image reads its Ignition config from this firmware config name
    # (flatcar/scripts build_library/qemu_template.sh).
    assert "name=opt/org.flatcar-linux/config" in text


# -- the mounted image, for real ----------------------------------------------------------------


def flatcar_disk_image(directory: Path) -> tuple[Path, flatcar_disk.Layout]:
    """flatcar_production_image.bin's USR-A (os-release, update.conf) and ROOT (an empty
    /etc, no /usr mount point) partitions, in a GPT disk image."""
    usr = directory / "usr-tree"
    (usr / "lib").mkdir(parents=True)
    (usr / "lib/os-release").write_text(fixtures.FLATCAR_OS_RELEASE)
    (usr / "share/flatcar").mkdir(parents=True)
    (usr / "share/flatcar/update.conf").write_text("GROUP=stable\nSERVER=https://example\n")
    root = directory / "root-tree"
    (root / "etc").mkdir(parents=True)
    parts = {n: (flatcar_disk.LABELS[n], flatcar_disk.filesystem(
        tree, directory / f"part{n}.img", flatcar_disk.LABELS[n], mib))
        for n, tree, mib in ((flatcar_disk.USR_A, usr, 8), (flatcar_disk.ROOT, root, 24))}
    disk = directory / "flatcar_production_image.bin"
    return disk, flatcar_disk.disk(disk, parts)


def debugfs(partition: bytes, directory: Path, request: str) -> str:
    image = directory / f"read-{secrets.token_hex(3)}.img"
    image.write_bytes(partition)
    done = subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True,
                          text=True, timeout=30, check=True)
    image.unlink()
    return done.stdout


def names(listing: str) -> set[str]:
    """The names in debugfs's `ls` output ("  2  (12) .    2  (12) ..  11  (20) etc")."""
    return set(re.findall(r"\(\d+\)\s+(\S+)", listing))


def loops_of(disk: Path) -> str:
    return subprocess.run(["losetup", "--associated", str(disk)], capture_output=True,
                          text=True, timeout=30, check=True).stdout


def mounted_under(directory: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if str(directory) in line]


def mounted_image_ready(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("attaching and mounting an image needs root")
    probe = subprocess.run(["losetup", "--find"], capture_output=True, text=True, timeout=30,
                           check=False)
    if probe.returncode != 0:
        pytest.skip(f"no loop device on this machine: {probe.stderr.strip()}")


def run_mounted(disk: Path, config: Path, tmp_path: Path, *gpunode: str
                ) -> subprocess.CompletedProcess[str]:
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    return subprocess.run(["bash", str(MOUNTED), "--image", str(disk), "--config", str(config),
                           *gpunode], env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                           "TMPDIR": str(scratch)},
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.allow_paths("/proc/self/mountinfo")
def test_the_mounted_image_script_bakes_onto_root_with_the_sysexts_gpunode_and_detaches(
        built: Built, tmp_path: Path) -> None:
    mounted_image_ready(tmp_path)
    disk, layout = flatcar_disk_image(tmp_path)
    usr_before = flatcar_disk.partition_bytes(disk, layout, flatcar_disk.USR_A)
    inputs = make_inputs(tmp_path / "mirror")
    shutil.copy(built.image, inputs.directory / IMAGE_NAME)
    inputs.images[IMAGE_NAME] = built.image.read_bytes()
    config = inputs.config(gpunode=IMAGE_NAME)

    done = run_mounted(disk, config, tmp_path, "--gpunode-sysext", str(built.image))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "driver-sysext nvidia-drivers-570-open" in done.stdout

    assert loops_of(disk) == "" and mounted_under(tmp_path) == []
    assert list((tmp_path / "scratch").iterdir()) == []  # mount point and bundle removed
    assert flatcar_disk.partition_bytes(disk, layout, flatcar_disk.USR_A) == usr_before
    root = flatcar_disk.partition_bytes(disk, layout, flatcar_disk.ROOT)
    manifest = json.loads(debugfs(root, tmp_path, "cat /etc/gpunode/baked.json"))
    assert manifest["baked_by"] == f"gpunode {gpunode.__version__}"  # the bundle baked
    assert manifest["os"]["version"] == "4459.2.1"
    assert [a["sha512"] for a in manifest["artifacts"]] == [
        sha512(built.image.read_bytes()),
        sha512(inputs.images["flatcar-nvidia-drivers-570-open.raw"])]
    links = debugfs(root, tmp_path, "stat /etc/extensions/gpunode.raw")
    assert f"/opt/extensions/gpunode/{IMAGE_NAME}" in links
    stored = debugfs(root, tmp_path, f"stat /opt/extensions/gpunode/{IMAGE_NAME}")
    assert f"Size: {built.image.stat().st_size}" in stored
    # the mount point the script made is gone again
    assert names(debugfs(root, tmp_path, "ls /")) == {".", "..", "lost+found", "etc", "opt"}


@pytest.mark.allow_paths("/proc/self/mountinfo")
def test_a_failed_bake_leaves_the_image_as_it_was_and_nothing_mounted(tmp_path: Path) -> None:
    mounted_image_ready(tmp_path)
    disk, layout = flatcar_disk_image(tmp_path)
    usr_before = flatcar_disk.partition_bytes(disk, layout, flatcar_disk.USR_A)
    inputs = make_inputs(tmp_path / "mirror")
    config = inputs.config(driver_sha="0" * 128)  # not the driver file's sha512

    done = run_mounted(disk, config, tmp_path, "--gpunode", str(BIN / "gpunode"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "bake-failed" in done.stderr or "sha512" in done.stderr
    assert loops_of(disk) == "" and mounted_under(tmp_path) == []
    # (ROOT's bytes change with any read-write mount: its superblock counts mounts.)
    root = flatcar_disk.partition_bytes(disk, layout, flatcar_disk.ROOT)
    assert names(debugfs(root, tmp_path, "ls /")) == {".", "..", "lost+found", "etc"}
    assert names(debugfs(root, tmp_path, "ls /etc")) == {".", ".."}
    assert flatcar_disk.partition_bytes(disk, layout, flatcar_disk.USR_A) == usr_before


def test_the_mounted_image_script_refuses_a_disk_without_flatcars_partitions(
        tmp_path: Path) -> None:
    mounted_image_ready(tmp_path)
    tree = tmp_path / "tree"
    tree.mkdir()
    other = flatcar_disk.filesystem(tree, tmp_path / "data.img", "DATA", 8)
    disk = tmp_path / "other.bin"
    flatcar_disk.disk(disk, {1: ("DATA", other)})
    inputs = make_inputs(tmp_path / "mirror")
    done = run_mounted(disk, inputs.config(), tmp_path, "--gpunode", str(BIN / "gpunode"))
    assert done.returncode == 1
    assert "has no GPT partition named ROOT: not a Flatcar disk image" in done.stderr
    assert loops_of(disk) == ""


# -- bake-in-vm.sh through the Ansible role, in a Flatcar-shaped machine ------------------------


RESET_STAND_IN = """#!/bin/sh
# flatcar-reset stand-in: records what it is asked to keep
printf '%s\\n' "$@" > /run/flatcar-reset.args
"""


@pytest.fixture
def workdir(built: Built) -> Iterator[Path]:
    path = built.dir / f"vm-{secrets.token_hex(4)}"
    path.mkdir()
    yield path
    with contextlib.suppress(OSError):
        shutil.rmtree(path)


@pytest.mark.allow_paths(*MACHINE_PATHS)
def test_the_ansible_role_bakes_inside_the_build_machine_and_stages_the_reset(
        built: Built, workdir: Path) -> None:
    (workdir / "os-release").write_text(fixtures.FLATCAR_OS_RELEASE)
    (workdir / "flatcar-reset").write_text(RESET_STAND_IN)
    inputs = workdir / "inputs"
    inputs.mkdir()
    shutil.copy(built.image, inputs / IMAGE_NAME)
    (inputs / "gpunode.toml").write_text('[detect]\nsource = "sysfs"\n')
    digest = hashlib.sha512(built.image.read_bytes()).hexdigest()
    (inputs / "bake.toml").write_text(f'[gpunode]\nsource = "{IMAGE_NAME}"\nsha512 = "{digest}"\n'
                                      '\n[agent]\nconfig = "gpunode.toml"\n')
    prepare = ["mount -n --make-rshared /",  # systemd-sysext's merge propagates back
               f"cp {workdir / 'os-release'} /usr/lib/os-release",
               "rm -f /etc/os-release", f"cp {workdir / 'os-release'} /etc/os-release",
               f"install -m 755 {workdir / 'flatcar-reset'} /usr/bin/flatcar-reset",
               "mkdir -p /run/ansible/tmp"]
    playbook = [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                "-e", f"ansible_python_interpreter={sys.executable}", "-e", "ansible_become=false",
                "-e", f"gpunode_bake_sysext={inputs / IMAGE_NAME}",
                "-e", f"gpunode_bake_config={inputs / 'bake.toml'}",
                "-e", f"gpunode_bake_agent_config={inputs / 'gpunode.toml'}",
                str(ANSIBLE / "bake-gpunode.yml")]
    with SystemdNamespace({}, workdir, overlays=("usr", "opt", "var/lib"),
                          prepare=prepare) as ns:
        done = ns.run(playbook, env=ansible_env(Path("/run/ansible")), check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "changed=" in done.stdout and "failed=0" in done.stdout
        manifest = json.loads(ns.run(["cat", "/etc/gpunode/baked.json"]).stdout)
        assert manifest["artifacts"][0]["path"] == f"/opt/extensions/gpunode/{IMAGE_NAME}"
        assert ns.run(["readlink", "/etc/extensions/gpunode.raw"]).stdout.strip() == \
            f"/opt/extensions/gpunode/{IMAGE_NAME}"
        # The bake's own merge is gone; the refresh merged what the disk now says.
        assert ns.run(["test", "-e", "/run/extensions/gpunode.raw"], check=False).returncode
        assert "gpunode" in ns.run(["systemd-sysext", "list"]).stdout
        assert ns.run(["test", "-e", "/var/tmp/gpunode-bake"], check=False).returncode

        # The reset keeps every path the bake placed (read back from its manifest).
        args = ns.run(["cat", "/run/flatcar-reset.args"]).stdout.split()
        assert args[0] == "--keep-paths"
        kept = args[1:]
        placed = [a["path"] for a in manifest["artifacts"]] + manifest["files"] + [
            "/etc/extensions/gpunode.raw", "/etc/systemd/system/nvidia.service",
            *(f"/etc/systemd/system/multi-user.target.wants/{u}"
              for u in manifest["units"]["enabled"])]
        uncovered = [p for p in placed
                     if not any(p == k or p.startswith(k + "/") for k in kept)]
        assert uncovered == []
