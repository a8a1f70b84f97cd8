"""`gpunode image bake` from local files into a Flatcar fixture root: every artifact where
Flatcar and gpunode look for it, digests verified, the manifest, a second bake that changes
nothing, and a changed input that replaces only itself. (Over HTTP:
tests/integration/test_bake_http.py; bad inputs: tests/hostile/test_bake.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import HostFactory
from helpers.bake import (
    DRIVER,
    DRIVER_PATH,
    FLATCAR_VERSION,
    GPUNODE_FILE,
    GPUNODE_PATH,
    make_inputs,
    sha512,
)
from hostile.support import Cli, snapshot


def _baked_root(make_host: HostFactory, tmp_path: Path, cli: Cli, state: str = "driver"
                ) -> tuple[Path, Path]:
    root = make_host("nc4as-t4-v3", state).root
    config = make_inputs(tmp_path / "mirror").config()
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err
    return root, config


def test_a_bake_places_every_artifact_where_flatcar_and_gpunode_look(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root, _ = _baked_root(make_host, tmp_path, cli)
    mirror = tmp_path / "mirror"
    assert (root / GPUNODE_PATH).read_bytes() == (mirror / GPUNODE_FILE).read_bytes()
    assert os.readlink(root / "etc/extensions/gpunode.raw") == "/" + GPUNODE_PATH
    # Flatcar's initramfs looks for exactly this file before it downloads (flatcar/bootengine)
    assert (root / DRIVER_PATH).read_bytes() == (mirror / f"flatcar-{DRIVER}.raw").read_bytes()
    assert os.readlink(root / f"etc/extensions/flatcar-{DRIVER}.raw") == "/" + DRIVER_PATH
    assert DRIVER in (root / "etc/flatcar/enabled-sysext.conf").read_text().splitlines()
    assert os.readlink(root / "etc/systemd/system/nvidia.service") == "/dev/null"
    for unit in ("gpunode.service", "gpunode-label.service", "gpunode-watch.service"):
        link = root / "etc/systemd/system/multi-user.target.wants" / unit
        assert os.readlink(link) == f"/usr/lib/systemd/system/{unit}"
    assert (root / "etc/modprobe.d/blacklist-nouveau.conf").read_text().startswith(
        "blacklist nouveau\n")


def test_the_manifest_says_what_was_baked_its_version_digest_and_source(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root, _ = _baked_root(make_host, tmp_path, cli)
    mirror = tmp_path / "mirror"
    manifest = json.loads((root / "etc/gpunode/baked.json").read_text())
    assert manifest["schema_version"] == 1
    assert manifest["os"]["id"] == "flatcar" and manifest["os"]["version"] == FLATCAR_VERSION
    gpunode, driver = manifest["artifacts"]
    assert gpunode == {"what": "gpunode-sysext", "name": "gpunode", "version": "0.2.0",
                       "path": "/" + GPUNODE_PATH,
                       "sha512": sha512((mirror / GPUNODE_FILE).read_bytes()),
                       "source": str(mirror / GPUNODE_FILE)}
    assert driver["what"] == "driver-sysext" and driver["name"] == DRIVER
    assert driver["version"] == FLATCAR_VERSION and driver["path"] == "/" + DRIVER_PATH
    assert (driver["branch"], driver["flavour"]) == ("570", "open")
    assert manifest["units"] == {"masked": ["nvidia.service"],
                                 "enabled": ["gpunode.service", "gpunode-label.service",
                                             "gpunode-watch.service"]}


def test_a_second_bake_with_the_same_inputs_writes_nothing(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root, config = _baked_root(make_host, tmp_path, cli)
    before = snapshot(root)
    inodes = {p: os.lstat(p).st_ino for p in root.rglob("*")}
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0
    assert "nothing changed" in result.out
    assert snapshot(root) == before
    assert {p: os.lstat(p).st_ino for p in root.rglob("*")} == inodes  # no file rewritten


def test_an_artifact_already_in_place_is_not_read_again(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root, config = _baked_root(make_host, tmp_path, cli)
    for image in (tmp_path / "mirror").glob("*.raw"):
        image.unlink()  # a fetch would fail now
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err
    assert "in place, sha512 matches" in result.out


def test_a_new_gpunode_image_replaces_only_gpunodes_artifact(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root, _ = _baked_root(make_host, tmp_path, cli)
    driver_inode = os.stat(root / DRIVER_PATH).st_ino
    inputs = make_inputs(tmp_path / "mirror")
    inputs.add("gpunode-0.3.0-x86-64.raw", b"hsqs newer gpunode\n" * 100)
    config = inputs.config(gpunode="gpunode-0.3.0-x86-64.raw")
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err
    assert os.readlink(root / "etc/extensions/gpunode.raw") == \
        "/opt/extensions/gpunode/gpunode-0.3.0-x86-64.raw"
    assert not (root / GPUNODE_PATH).exists()  # the old image is gone
    assert os.stat(root / DRIVER_PATH).st_ino == driver_inode  # the driver untouched
    changed = [line for line in result.out.splitlines() if line.startswith("changed ")]
    assert sorted(changed) == sorted([
        f"changed {root}/opt/extensions/gpunode/gpunode-0.3.0-x86-64.raw",
        f"changed {root}/etc/extensions/gpunode.raw",
        f"changed removed {root}/{GPUNODE_PATH}",
        f"changed {root}/etc/gpunode/baked.json"])


def test_another_driver_branch_replaces_the_old_one_and_its_enabled_line(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root, _ = _baked_root(make_host, tmp_path, cli)
    conf = root / "etc/flatcar/enabled-sysext.conf"
    conf.write_text("# mine\npodman\n" + conf.read_text())
    inputs = make_inputs(tmp_path / "mirror")
    inputs.add("flatcar-nvidia-drivers-570.raw", b"proprietary\n" * 100)
    text = inputs.config().read_text().replace(f'name = "{DRIVER}"',
                                               'name = "nvidia-drivers-570"')
    text = text.replace(f"flatcar-{DRIVER}.raw", "flatcar-nvidia-drivers-570.raw")
    text = text.replace(sha512(inputs.images[f"flatcar-{DRIVER}.raw"]),
                        sha512(b"proprietary\n" * 100))
    (tmp_path / "mirror/bake.toml").write_text(text)
    result = cli("image", "bake", "--root", str(root), "--config",
                 str(tmp_path / "mirror/bake.toml"))
    assert result.code == 0, result.err
    assert conf.read_text() == "# mine\npodman\nnvidia-drivers-570\n"
    assert not (root / DRIVER_PATH).exists()
    assert not (root / f"etc/extensions/flatcar-{DRIVER}.raw").is_symlink()
    assert (root / f"etc/flatcar/sysext/flatcar-nvidia-drivers-570-{FLATCAR_VERSION}.raw"
            ).read_bytes() == b"proprietary\n" * 100


def test_a_driver_source_names_the_images_flatcar_version(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "mirror")
    (tmp_path / "mirror" / FLATCAR_VERSION).mkdir()
    inputs.add(f"{FLATCAR_VERSION}/flatcar-{DRIVER}.raw", b"driver for 4459.2.1\n")
    config = inputs.config(driver="{version}/flatcar-{name}.raw",
                           driver_sha=sha512(b"driver for 4459.2.1\n"))
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err
    assert (root / DRIVER_PATH).read_bytes() == b"driver for 4459.2.1\n"


def test_the_agent_config_is_installed_as_the_bake_config_names_it(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "mirror")
    (tmp_path / "mirror/gpunode.toml").write_text('[driver]\nstrategy = "flatcar-sysext"\n')
    config = inputs.config(extra='\n[agent]\nconfig = "gpunode.toml"\n')
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err
    assert (root / "etc/gpunode/config.toml").read_text() == \
        '[driver]\nstrategy = "flatcar-sysext"\n'
    manifest = json.loads((root / "etc/gpunode/baked.json").read_text())
    assert manifest["artifacts"][-1]["what"] == "agent-config"


def test_a_bake_without_drivers_writes_no_enabled_sysext_file(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    config = make_inputs(tmp_path / "mirror").config(driver=None)
    assert cli("image", "bake", "--root", str(root), "--config", str(config)).code == 0
    assert not (root / "etc/flatcar/enabled-sysext.conf").exists()
    assert (root / GPUNODE_PATH).exists()


def test_a_stage_left_by_a_killed_bake_is_swept_by_the_next_one(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    name = f".flatcar-{DRIVER}-{FLATCAR_VERSION}.raw.bake.gpunode-tmp"
    stage = root / "etc/flatcar/sysext" / name
    stage.parent.mkdir(parents=True)
    stage.write_bytes(b"half a driver")
    config = make_inputs(tmp_path / "mirror").config()
    assert cli("image", "bake", "--root", str(root), "--config", str(config)).code == 0
    assert not list(root.rglob("*.gpunode-tmp"))
    assert (root / DRIVER_PATH).exists()


def test_a_new_build_of_the_same_driver_replaces_its_file_and_nothing_else(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root, _ = _baked_root(make_host, tmp_path, cli)
    gpunode_inode = os.stat(root / GPUNODE_PATH).st_ino
    inputs = make_inputs(tmp_path / "mirror")
    inputs.add(f"flatcar-{DRIVER}.raw", b"hsqs the driver, rebuilt\n" * 10)
    result = cli("image", "bake", "--root", str(root), "--config", str(inputs.config()))
    assert result.code == 0, result.err
    assert (root / DRIVER_PATH).read_bytes() == b"hsqs the driver, rebuilt\n" * 10
    assert os.stat(root / GPUNODE_PATH).st_ino == gpunode_inode
    assert sorted(line for line in result.out.splitlines() if line.startswith("changed ")) == [
        f"changed {root}/{DRIVER_PATH}", f"changed {root}/etc/gpunode/baked.json"]
