"""The optional bake artifacts with real components: the toolkit sysext and a prebuilt set
fetched from a real HTTP server on 127.0.0.1 (once; a second bake and a boot ask nothing),
and a `[build]` that runs the real build.sh (outside a container, on a stand-in NVIDIA
installer, real make and ldconfig, as tests/integration/test_driver_build_real.py does) into
the image's cache — after which a boot of that root loads the build without compiling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.config import load_config
from gpunode.containerd.probe import NoProbe
from gpunode.driver import builders
from gpunode.pipeline import boot
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from gpunode_testing import fixtures
from helpers.bake import make_inputs, serving
from helpers.bake_extras import (
    KERNEL,
    PREBUILT_DIR,
    T4,
    TOOLKIT_FILE,
    TOOLKIT_PATH,
    image_kernel,
    module_set,
    prebuilt_section,
    toolkit_section,
)
from helpers.driver_build import (
    BuiltKernel,
    build_sh_command,
    fake_installer,
    kernel_tree,
    sha,
    strip_system_userspace,
)
from hostile.support import Cli


class NoCompile:
    def build(self, *args: object) -> None:
        raise AssertionError("the baked node compiled")


def _boot(root: Path) -> dict[str, object]:
    host = Host(root)
    adapters = boot.Adapters(systemd=NoSystemd(), kmod=BuiltKernel(root, T4), probe=NoProbe(),
                             build=(builders.UrlFetcher(host), NoCompile()))
    run = boot.boot(host, load_config(host), adapters)
    return next(s for s in run.steps if s["name"] == "driver")


def test_the_toolkit_and_a_prebuilt_set_over_http_are_fetched_once_and_a_boot_asks_nothing(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "bare").root
    image_kernel(root)
    inputs = make_inputs(tmp_path / "mirror")
    with serving(tmp_path / "mirror") as server:
        extra = toolkit_section(inputs) + prebuilt_section(inputs)
        config = inputs.config(base=server.url, driver=None, extra=extra.replace(
            'source = "', f'source = "{server.url}'))
        first = cli("image", "bake", "--root", str(root), "--config", str(config))
        assert first.code == 0, first.err
        assert sorted(server.requests) == sorted(["/gpunode-0.2.0-x86-64.raw",
                                                  f"/{TOOLKIT_FILE}", "/set.tar.gz"])
        second = cli("image", "bake", "--root", str(root), "--config", str(config))
        assert second.code == 0 and "nothing changed" in second.out, second.err
        driver = _boot(root)
        assert len(server.requests) == 3  # neither the second bake nor the boot asked
    assert (root / TOOLKIT_PATH).read_bytes() == inputs.images[TOOLKIT_FILE]
    assert (root / PREBUILT_DIR / "nvidia.ko").read_bytes() == module_set()["nvidia.ko"]
    assert (driver["strategy"], driver["action"]) == ("prebuilt", "load")
    manifest = json.loads((root / "etc/gpunode/baked.json").read_text())
    assert manifest["artifacts"][1]["source"] == f"{server.url}{TOOLKIT_FILE}"


def test_a_build_runs_the_real_build_sh_into_the_images_cache_and_the_boot_loads_it(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the stand-in installer's libraries need it")
    root = make_host("nc4as-t4-v3", "bare").root
    image_kernel(root)
    inputs = make_inputs(tmp_path / "mirror")
    installer = fake_installer(tmp_path, T4.driver_version)
    image = b"developer container image\n"
    inputs.add("driver.run", installer)
    inputs.add("dev.bin", image)
    (tmp_path / "mirror/gpunode.toml").write_text(
        f'[driver]\nversion = "{T4.driver_version}"\nflavour = "proprietary"\n')
    command = build_sh_command(kernel_tree(tmp_path / "kernel", fixtures.KERNEL))
    extra = ('\n[agent]\nconfig = "gpunode.toml"\n\n[build]\nenabled = true\n'
             f'driver_url = "driver.run"\ndriver_sha256 = "{sha(installer, "sha256")}"\n'
             f'dev_container_url = "dev.bin"\ndev_container_sha512 = "{sha(image, "sha512")}"\n'
             f"command = {json.dumps(command)}\n")
    config = inputs.config(driver=None, extra=extra)
    baked = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert baked.code == 0, baked.err
    entry = root / f"opt/gpunode/drivers/{KERNEL}/{T4.driver_version}-proprietary"
    assert sorted(p.name for p in entry.glob("*.ko")) == [
        "nvidia-modeset.ko", "nvidia-uvm.ko", "nvidia.ko"]
    assert (entry / f"lib/libcuda.so.{T4.driver_version}").exists()
    again = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert again.code == 0 and "nothing changed" in again.out, again.err
    strip_system_userspace(root)  # a built node's user-space is its cache entry's only
    driver = _boot(root)
    assert (driver["strategy"], driver["action"], driver["outcome"]) == ("build", "load", "ok")
    assert driver["driver_root"]["root"] == f"/opt/gpunode/drivers/{KERNEL}/" \
        f"{T4.driver_version}-proprietary"  # type: ignore[index]
