"""A baked image booted in a real systemd (PID+mount namespace, gpunode_testing.systemd_ns).

The image: a directory with Flatcar's os-release, baked by the bundled gpunode of the real
system extension (packaging/build_sysext.py, `built`) — as the mounted-image pipeline runs it
on a build host — with that extension and a small stand-in of Flatcar's driver sysext
(`ID=_any`, one file in /usr, squashed as build_sysext.py squashes gpunode's). Then a node
boots from it: the namespace gets the image's /etc and /opt, the fixture T4 (driver loaded)
over the machine's PCI functions, and the extensions merged before systemd starts, as Flatcar
merges them in the initramfs since 2025 (flatcar/scripts changelog 2025-12-12). systemd then
runs gpunode.service from the merged /usr, before a real containerd.service.

What is not real: the driver sysext holds no modules (the fixture's driver is "loaded"), and
Flatcar's initramfs itself does not run: the bake placed the file and the link its
initrd-setup-root-after-ignition would find and keep (docs/image-bake.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpunode
from conftest import REPO
from gpunode_testing import fixtures
from gpunode_testing.boot_harness import CONTAINERD_UNIT, KUBELET_UNIT, node_prepare
from gpunode_testing.systemd_ns import MACHINE_PATHS, SystemdNamespace
from helpers.sysext import Built, extension

pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS)

DRIVER = "nvidia-drivers-570-open"
VERSION = "4459.2.1"  # fixtures.FLATCAR_OS_RELEASE
MARKER = f"/usr/share/{DRIVER}/stand-in"
AGENT = '[detect]\nsource = "sysfs"\n'  # the fixture's PCI functions are plain directories
NO_VENV = {"PATH": "/usr/bin:/bin"}


def sha512(path: Path) -> str:
    return hashlib.sha512(path.read_bytes()).hexdigest()


@pytest.fixture
def workdir(built: Built) -> Iterator[Path]:
    path = built.dir / f"bake-{secrets.token_hex(4)}"
    path.mkdir()
    yield path
    with contextlib.suppress(OSError):
        shutil.rmtree(path)


def bake_image(built: Built, workdir: Path) -> tuple[Path, str]:
    """The baked image root, and what the bake printed."""
    driver = extension(workdir / "driver-tree", workdir / "mirror" / f"flatcar-{DRIVER}.raw",
                       f"flatcar-{DRIVER}", {MARKER: "the driver sysext's /usr\n"})
    (workdir / "agent.toml").write_text(AGENT)
    config = workdir / "bake.toml"
    config.write_text(f'[gpunode]\nsource = "{built.image}"\nsha512 = "{sha512(built.image)}"\n'
                      f'\n[[driver]]\nname = "{DRIVER}"\nsource = "{driver}"\n'
                      f'sha512 = "{sha512(driver)}"\n\n[agent]\nconfig = "agent.toml"\n')
    image = workdir / "image"
    (image / "usr/lib").mkdir(parents=True)
    (image / "usr/lib/os-release").write_text(fixtures.FLATCAR_OS_RELEASE)
    done = subprocess.run([str(built.tree / "usr/bin/gpunode"), "image", "bake", "--root",
                           str(image), "--config", str(config)], env=NO_VENV,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return image, done.stdout


def baked_node(workdir: Path, image: Path) -> SystemdNamespace:
    fixture = workdir / "fixture"
    fixtures.build(fixtures.MACHINES["nc4as-t4-v3"], fixture,
                   fixtures.Options(state="driver", flat_sysfs=True, dev_nodes="plain"))
    (workdir / "os-release").write_text(fixtures.FLATCAR_OS_RELEASE)
    prepare = [
        *node_prepare(fixture, gpunode_on_usr=False),
        # The node's root partition is the image's: its /etc and /opt (copy-on-write here).
        f"cp -a {image}/etc/. /etc/",
        f"cp -a {image}/opt/. /opt/",
        f"cp {workdir / 'os-release'} /usr/lib/os-release",
        "rm -f /etc/os-release",  # Debian's is a link into /usr; Flatcar's /etc has its own
        f"cp {workdir / 'os-release'} /etc/os-release",
        # systemd-sysext merges in a child mount namespace and relies on the overlay
        # propagating back (tests/integration/test_sysext.py's flatcar_boot says why).
        "mount -n --make-rshared /",
        "systemd-sysext merge",  # what Flatcar's initramfs does before the real root's systemd
    ]
    units = {"containerd.service": CONTAINERD_UNIT, "kubelet.service": KUBELET_UNIT}
    return SystemdNamespace(units, workdir, overlays=("usr", "opt", "var/lib"),
                            enable=("containerd.service", "kubelet.service"), prepare=prepare)


def test_a_baked_image_boots_gpunode_from_the_merged_usr_before_containerd(
        built: Built, workdir: Path) -> None:
    image, printed = bake_image(built, workdir)
    assert "gpunode-sysext gpunode" in printed and f"driver-sysext {DRIVER}" in printed
    with baked_node(workdir, image) as ns:
        ns.wait_active("gpunode.service", timeout=60)
        ns.wait_active("containerd.service")

        # systemd-sysext merged both baked images: gpunode's and the driver's.
        merged = ns.run(["systemd-sysext", "list"]).stdout
        assert "gpunode" in merged and f"flatcar-{DRIVER}" in merged
        assert ns.run(["cat", MARKER]).stdout == "the driver sysext's /usr\n"
        assert ns.run(["readlink", f"/etc/extensions/flatcar-{DRIVER}.raw"]).stdout.strip() == \
            f"/etc/flatcar/sysext/flatcar-{DRIVER}-{VERSION}.raw"

        # gpunode.service is the unit of the merged image, enabled by the bake's link, and ran
        # the bundled gpunode; containerd's main process started after it was done.
        unit = ns.unit_properties("gpunode.service", "FragmentPath", "Result", "ExecMainStatus",
                                  "ActiveEnterTimestampMonotonic")
        # (/lib/systemd/system on a merged-/usr machine like this one: /lib is usr/lib)
        assert ns.run(["readlink", "-f", unit["FragmentPath"]]).stdout.strip() == \
            "/usr/lib/systemd/system/gpunode.service"
        assert ns.run(["cat", unit["FragmentPath"]]).stdout == \
            (REPO / "units/gpunode.service").read_text()
        assert (unit["Result"], unit["ExecMainStatus"]) == ("success", "0")
        python = f"python{sys.version_info.major}.{sys.version_info.minor}"
        assert f"/lib/gpunode/bin/{python}" in ns.run(["cat", "/usr/bin/gpunode"]).stdout
        assert ns.run(["/usr/bin/gpunode", "--version"]).stdout.startswith("gpunode ")
        containerd = ns.unit_properties("containerd.service", "ExecMainStartTimestampMonotonic",
                                        "NRestarts")
        assert 0 < int(unit["ActiveEnterTimestampMonotonic"]) <= \
            int(containerd["ExecMainStartTimestampMonotonic"])
        started = [e for e in ns.journal("containerd.service")
                   if str(e.get("MESSAGE", "")).startswith("Started ")]
        assert len(started) == 1 and containerd["NRestarts"] == "0"
        events = [json.loads(str(e["MESSAGE"])) for e in ns.journal("gpunode.service")
                  if str(e.get("MESSAGE", "")).startswith("{")]
        assert {e["step"] for e in events if e["event"] == "step.done"} >= {
            "detect", "driver", "containerd"}
        assert ns.run(["cat", "/etc/gpunode/config.toml"]).stdout == AGENT

        # plan and status on the node: baked, nothing to download.
        plan = ns.run(["/usr/bin/gpunode", "plan"]).stdout
        assert (f"bake: baked gpunode {gpunode.__version__}, {DRIVER} (Flatcar {VERSION}): "
                "baked, no download") in plan
        status = json.loads(ns.run(["/usr/bin/gpunode", "status", "--json"],
                                   check=False).stdout)
        bake = next(c for c in status["checks"] if c["name"] == "bake")
        assert bake["state"] == "ok" and "no download at boot" in bake["detail"]
        assert [a["name"] for a in status["baked"]["artifacts"]] == [
            "gpunode", DRIVER, "config.toml"]
