"""The optional artifacts of `gpunode image bake` in a Flatcar fixture root: the toolkit sysext
where the sysext-bakery puts it, a prebuilt module set unpacked where the prebuilt strategy
looks, a driver built (by a fake compiler) into the image's cache; a second bake that changes
nothing, a changed input that replaces only itself, and a boot of the baked root that loads
what was baked without a compile. (Bad inputs: tests/hostile/test_bake_optional.py.)"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.config import load_config
from gpunode.containerd.probe import NoProbe
from gpunode.driver import builders, cache
from gpunode.pipeline import boot
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from helpers.bake import GPUNODE_PATH, Inputs, make_inputs, sha512
from helpers.bake_extras import (
    KERNEL,
    PREBUILT_DIR,
    T4,
    TOOLKIT_FILE,
    TOOLKIT_PATH,
    image_kernel,
    module_set,
    prebuilt_section,
    tar_bytes,
    toolkit_section,
)
from helpers.driver_build import IMAGE, INSTALLER, BuiltKernel, FakeBuilder, sha
from hostile.support import Cli, snapshot

ENTRY = f"opt/gpunode/drivers/{KERNEL}/{T4.driver_version}-proprietary"


def _root(make_host: HostFactory, state: str = "bare") -> Path:
    root = make_host("nc4as-t4-v3", state).root
    image_kernel(root)
    return root


def _bake(cli: Cli, root: Path, config: Path) -> Any:
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err
    return result


def _manifest(root: Path, what: str) -> list[dict[str, Any]]:
    artifacts = json.loads((root / "etc/gpunode/baked.json").read_text())["artifacts"]
    return [a for a in artifacts if a["what"] == what]


def _changed(result: Any) -> list[str]:
    return sorted(line for line in result.out.splitlines() if line.startswith("changed "))


# -- the toolkit sysext --------------------------------------------------------------------------


def test_the_toolkit_sysext_lands_where_the_sysext_bakery_puts_it(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(extra=toolkit_section(inputs)))
    assert (root / TOOLKIT_PATH).read_bytes() == inputs.images[TOOLKIT_FILE]
    assert os.readlink(root / "etc/extensions/nvidia-runtime.raw") == "/" + TOOLKIT_PATH
    # a bakery sysext is no Flatcar extension: the initramfs must not try to download it
    assert "nvidia-runtime" not in (root / "etc/flatcar/enabled-sysext.conf").read_text()
    [entry] = _manifest(root, "toolkit-sysext")
    assert entry == {"what": "toolkit-sysext", "name": "nvidia-runtime", "version": "v1.17.5",
                     "path": "/" + TOOLKIT_PATH, "sha512": sha512(inputs.images[TOOLKIT_FILE]),
                     "source": str(tmp_path / "mirror" / TOOLKIT_FILE),
                     "link": "/etc/extensions/nvidia-runtime.raw"}


def test_a_new_toolkit_version_replaces_only_the_toolkit(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(extra=toolkit_section(inputs) + prebuilt_section(inputs)))
    gpunode_inode = os.stat(root / GPUNODE_PATH).st_ino
    set_inode = os.stat(root / PREBUILT_DIR / "nvidia.ko").st_ino
    newer = "nvidia-runtime-v1.18.1-x86-64.raw"
    result = _bake(cli, root, inputs.config(extra=toolkit_section(inputs, b"newer\n", newer)
                                            + prebuilt_section(inputs)))
    assert os.readlink(root / "etc/extensions/nvidia-runtime.raw") == \
        f"/opt/extensions/nvidia-runtime/{newer}"
    assert not (root / TOOLKIT_PATH).exists()
    assert os.stat(root / GPUNODE_PATH).st_ino == gpunode_inode
    assert os.stat(root / PREBUILT_DIR / "nvidia.ko").st_ino == set_inode
    assert _changed(result) == sorted([
        f"changed {root}/opt/extensions/nvidia-runtime/{newer}",
        f"changed {root}/etc/extensions/nvidia-runtime.raw",
        f"changed removed {root}/{TOOLKIT_PATH}", f"changed {root}/etc/gpunode/baked.json"])


def test_a_toolkit_no_longer_baked_is_removed_with_its_link(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(extra=toolkit_section(inputs)))
    _bake(cli, root, inputs.config())
    assert not (root / TOOLKIT_PATH).exists()
    assert not (root / "etc/extensions/nvidia-runtime.raw").is_symlink()
    assert not (root / "opt/extensions/nvidia-runtime").exists()
    assert (root / GPUNODE_PATH).exists()


# -- prebuilt module sets ------------------------------------------------------------------------


def test_a_prebuilt_set_is_unpacked_where_the_prebuilt_strategy_looks(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(extra=prebuilt_section(inputs)))
    directory = root / PREBUILT_DIR
    files = {str(p.relative_to(directory)): p.read_bytes()
             for p in directory.rglob("*") if p.is_file()}
    assert files == module_set()
    assert os.stat(directory / "bin/nvidia-smi").st_mode & 0o111
    assert stat.S_IMODE(os.stat(directory / "nvidia.ko").st_mode) == 0o644
    [entry] = _manifest(root, "prebuilt-modules")
    assert (entry["name"], entry["kernel"], entry["version"]) == (KERNEL, KERNEL,
                                                                  T4.driver_version)
    assert entry["path"] == "/" + PREBUILT_DIR
    assert entry["files"]["nvidia.ko"] == sha(module_set()["nvidia.ko"], "sha256")
    assert not list(root.rglob("*.gpunode-tmp"))


def test_a_prebuilt_set_goes_into_the_agent_configs_first_prebuilt_dir_for_its_kernel(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    (tmp_path / "mirror/gpunode.toml").write_text(
        '[driver]\nprebuilt_dirs = ["/opt/vendor/nvidia", "/opt/nvidia/modules"]\n')
    extra = prebuilt_section(inputs, kernel="6.6.95-flatcar") + \
        '\n[agent]\nconfig = "gpunode.toml"\n'
    _bake(cli, root, inputs.config(extra=extra))
    assert (root / "opt/vendor/nvidia/6.6.95-flatcar/nvidia.ko").exists()


def test_a_new_archive_replaces_the_set_whole_and_nothing_else(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(extra=toolkit_section(inputs) + prebuilt_section(inputs)))
    toolkit_inode = os.stat(root / TOOLKIT_PATH).st_ino
    newer = {k.replace(T4.driver_version, "550.144.06"): v for k, v in module_set().items()}
    result = _bake(cli, root, inputs.config(extra=toolkit_section(inputs) + prebuilt_section(
        inputs, tar_bytes(newer), "newer.tar.gz")))
    assert sorted(p.name for p in (root / PREBUILT_DIR / "lib").iterdir()) == [
        "libcuda.so.550.144.06", "libnvidia-ml.so.550.144.06"]  # the old set's files are gone
    assert os.stat(root / TOOLKIT_PATH).st_ino == toolkit_inode
    assert _changed(result) == sorted([f"changed {root}/{PREBUILT_DIR}",
                                       f"changed {root}/etc/gpunode/baked.json"])
    assert not list(root.rglob("*.gpunode-tmp"))


def test_a_set_changed_in_place_is_unpacked_again(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    config = inputs.config(extra=prebuilt_section(inputs))
    _bake(cli, root, config)
    (root / PREBUILT_DIR / "nvidia.ko").write_bytes(b"tampered")
    (root / PREBUILT_DIR / "stray.ko").write_bytes(b"not ours")
    result = _bake(cli, root, config)
    assert (root / PREBUILT_DIR / "nvidia.ko").read_bytes() == module_set()["nvidia.ko"]
    assert not (root / PREBUILT_DIR / "stray.ko").exists()
    assert f"changed {root}/{PREBUILT_DIR}" in _changed(result)


def test_a_half_unpacked_set_of_a_killed_bake_is_swept_by_the_next_one(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    left = root / f"opt/nvidia/modules/.{KERNEL}.bake.gpunode-tmp"
    left.mkdir(parents=True)
    (left / "nvidia.ko").write_bytes(b"half")
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(extra=prebuilt_section(inputs)))
    assert not list(root.rglob("*.gpunode-tmp"))
    assert (root / PREBUILT_DIR / "nvidia.ko").read_bytes() == module_set()["nvidia.ko"]


# -- a driver built into the image's cache -------------------------------------------------------


@pytest.fixture
def builder(monkeypatch: pytest.MonkeyPatch) -> FakeBuilder:
    """The compiler the bake's build gets (the real one needs a Flatcar developer
    container): writes fake modules and the installer's user-space, counts its calls."""
    fake = FakeBuilder()
    monkeypatch.setattr(builders, "default_adapters",
                        lambda config, host=None: (builders.UrlFetcher(Host()), fake))
    return fake


def build_section(inputs: Inputs, extra: str = "") -> str:
    """[build] from the mirror's installer and developer container, and an agent config of
    the fixture driver's version that never builds on a node."""
    inputs.add("dev.bin", IMAGE)
    inputs.add("driver.run", INSTALLER)
    (inputs.directory / "gpunode.toml").write_text(
        f'[driver]\nversion = "{T4.driver_version}"\nflavour = "proprietary"\n')
    return ('\n[agent]\nconfig = "gpunode.toml"\n\n[build]\nenabled = true\n'
            'driver_url = "driver.run"\n'
            f'driver_sha256 = "{sha(INSTALLER, "sha256")}"\n'
            'dev_container_url = "dev.bin"\n'
            f'dev_container_sha512 = "{sha(IMAGE, "sha512")}"\n{extra}')


def test_a_build_compiles_the_images_driver_into_its_cache_once(
        make_host: HostFactory, tmp_path: Path, cli: Cli, builder: FakeBuilder) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    config = inputs.config(extra=build_section(inputs))
    result = _bake(cli, root, config)
    assert builder.calls == 1
    entry = root / ENTRY
    assert cache.check_entry(Host(root), "/" + ENTRY, KERNEL, T4.driver_version,
                             "proprietary")[0] is not None
    assert f"changed {entry}" in _changed(result)
    [recorded] = _manifest(root, "driver-build")
    assert recorded["path"] == "/" + ENTRY and recorded["kernel"] == KERNEL
    assert (recorded["flavour"], recorded["version"]) == ("proprietary", T4.driver_version)
    assert recorded["sha512"] == sha512((entry / "manifest.json").read_bytes())
    assert recorded["source"] == str(tmp_path / "mirror/driver.run")
    before = snapshot(root)
    second = _bake(cli, root, config)
    assert builder.calls == 1  # the usable entry is not built again
    assert "nothing changed" in second.out and snapshot(root) == before


def test_a_build_for_several_flavours_makes_one_entry_each(
        make_host: HostFactory, tmp_path: Path, cli: Cli, builder: FakeBuilder) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    extra = build_section(inputs, 'flavours = ["open", "proprietary"]\n')
    (inputs.directory / "gpunode.toml").write_text(f'[driver]\nversion = "{T4.driver_version}"\n')
    _bake(cli, root, inputs.config(extra=extra))
    assert builder.calls == 2
    assert sorted(p.name for p in (root / f"opt/gpunode/drivers/{KERNEL}").iterdir()
                  if not p.name.startswith(".")) == [f"{T4.driver_version}-open",
                                                     f"{T4.driver_version}-proprietary"]


def _boot(root: Path) -> tuple[dict[str, Any], BuiltKernel]:
    """`gpunode boot` of the baked root: a kernel that records what is loaded, and a builder
    that fails the test if anything is compiled."""
    class NoCompile(FakeBuilder):
        def build(self, *args: object) -> None:  # type: ignore[override]
            raise AssertionError("the baked node compiled")

    host = Host(root)
    kmod = BuiltKernel(root, T4)
    adapters = boot.Adapters(systemd=NoSystemd(), kmod=kmod, probe=NoProbe(),
                             build=(builders.UrlFetcher(host), NoCompile()))
    run = boot.boot(host, load_config(host), adapters)
    driver = next(s for s in run.steps if s["name"] == "driver")
    return driver, kmod


def test_a_boot_of_the_baked_root_loads_the_cached_build_without_a_compile(
        make_host: HostFactory, tmp_path: Path, cli: Cli, builder: FakeBuilder) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(driver=None, extra=build_section(inputs)))
    driver, kmod = _boot(root)
    assert driver["outcome"] == "ok", driver
    assert (driver["strategy"], driver["action"]) == ("build", "load")
    assert driver["source"] == "/" + ENTRY
    assert next(argv[1] for argv in kmod.calls if argv[0] == "insmod") == \
        str(root / ENTRY / "nvidia.ko")
    assert driver["driver_root"]["root"] == "/" + ENTRY  # libcuda from the baked entry


def test_a_boot_of_the_baked_root_loads_the_prebuilt_set(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host)
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(driver=None, extra=prebuilt_section(inputs)))
    driver, kmod = _boot(root)
    assert (driver["strategy"], driver["action"]) == ("prebuilt", "load"), driver
    assert driver["source"] == "/" + PREBUILT_DIR
    assert str(root / PREBUILT_DIR / "nvidia.ko") in [argv[1] for argv in kmod.calls]


# -- status and plan on the baked node -----------------------------------------------------------


def _bake_check(cli: Cli, root: Path) -> dict[str, str]:
    status = cli("--root", str(root), "status", "--json")
    return next(c for c in json.loads(status.out)["checks"] if c["name"] == "bake")


def test_status_names_every_baked_artifact_and_says_no_download(
        make_host: HostFactory, tmp_path: Path, cli: Cli, builder: FakeBuilder) -> None:
    root = _root(make_host, "ready")
    inputs = make_inputs(tmp_path / "mirror")
    extra = toolkit_section(inputs) + prebuilt_section(inputs) + build_section(inputs)
    _bake(cli, root, inputs.config(extra=extra))
    check = _bake_check(cli, root)
    assert check["state"] == "ok", check
    assert check["detail"] == (
        "baked gpunode 0.2.0, nvidia-drivers-570-open, nvidia-runtime v1.17.5, prebuilt "
        f"modules for {KERNEL}, NVIDIA {T4.driver_version}-proprietary built for {KERNEL} "
        "(Flatcar 4459.2.1): no download at boot")
    plan = cli("--root", str(root), "plan")
    assert plan.code == 0, plan.err
    assert f"built for {KERNEL} (Flatcar 4459.2.1): baked, no download" in plan.out


def test_status_warns_when_the_running_kernel_is_not_the_prebuilt_sets(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = _root(make_host, "ready")
    inputs = make_inputs(tmp_path / "mirror")
    _bake(cli, root, inputs.config(driver=None, extra=prebuilt_section(inputs)))
    (root / "proc/sys/kernel/osrelease").write_text("6.12.40-flatcar\n")
    check = _bake_check(cli, root)
    assert check["state"] == "warn"
    assert (f"the running kernel is 6.12.40-flatcar, not {KERNEL} (the baked prebuilt "
            "modules)") in check["detail"]
    assert "gpunode image bake" in check["hint"]
