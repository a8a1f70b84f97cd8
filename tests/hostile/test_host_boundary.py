"""Hostile entries where gpunode touches files that used to bypass the Host: the driver cache's
lock and downloads (`driver build`), the globs of containerd's imports. Each is refused with one
message naming the path, without a hang and with every file as it was, or read inside --root.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.driver import cache
from helpers.driver_build import write_build_setup
from hostile.support import Cli, check_refusal

KERNEL = "6.6.95-flatcar"
INSTALLER = b"#!/bin/sh\n# fake NVIDIA installer\n"
IMAGE = b"fake developer container\n"
def _build_node(make_host: HostFactory, mutate: Callable[[Path], None]) -> Path:
    """A node set up for `driver build` from a mirror under the root; its cache dir and lock
    exist already (a failed build leaves them: they are the cache, not the refusal's doing)."""
    host = make_host("nc4as-t4-v3", "bare", extra={"/proc/sys/kernel/osrelease": KERNEL + "\n"})
    root = host.root
    write_build_setup(root, "570.195.03", INSTALLER, IMAGE)
    cache_dir = root / cache.CACHE_ROOT.lstrip("/")
    (cache_dir / KERNEL).mkdir(parents=True)
    (cache_dir / ".lock").write_bytes(b"")  # the lock an earlier build made
    mutate(root)
    return root


def _replace(path: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            target.unlink()
        make(target)

    return mutate


LOCK = cache.LOCK_FILE
BUILD_REFUSED: dict[str, tuple[Callable[[Path], None], str]] = {
    "cache-lock-is-a-symlink": (_replace(LOCK, lambda p: p.symlink_to("/etc/passwd")),
                                r"Failed to lock '.*/opt/gpunode/drivers/\.lock': is a symlink, "
                                "not the lock file"),
    "cache-lock-is-a-fifo": (_replace(LOCK, os.mkfifo),
                             r"Failed to lock '.*/opt/gpunode/drivers/\.lock': is a FIFO"),
    "cache-lock-is-a-directory": (_replace(LOCK, Path.mkdir),
                                  r"Failed to lock '.*/opt/gpunode/drivers/\.lock': "
                                  r"(is a directory|Is a directory)"),
    "mirror-installer-is-a-fifo": (_replace("/srv/mirror/driver.run", os.mkfifo),
                                   r"Failed to download '/srv/mirror/driver.run': is a FIFO"),
    "mirror-installer-links-out-of-the-root": (
        _replace("/srv/mirror/driver.run", lambda p: p.symlink_to("../../../../../../../x")),
        r"Failed to download '/srv/mirror/driver.run': a symlink climbs above the root"),
}


@pytest.mark.parametrize("case", BUILD_REFUSED.values(), ids=BUILD_REFUSED.keys())
def test_driver_build_refuses_a_hostile_cache_or_mirror_entry(
    make_host: HostFactory, cli: Cli, case: tuple[Callable[[Path], None], str]
) -> None:
    mutate, pattern = case
    root = _build_node(make_host, mutate)
    check_refusal(cli, root, ["--root", str(root), "driver", "build"], 1, pattern)
    assert not (root / "etc/passwd").exists()  # nothing made where a link points


IMPORTS_DIR = "/etc/containerd/conf.d"


def test_an_imports_glob_through_a_link_climbing_out_of_the_root_is_refused(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    root = host.root
    config = root / "etc/containerd/config.toml"
    config.write_text('version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n'
                      + config.read_text().removeprefix("version = 2\n"))
    _replace(IMPORTS_DIR, lambda p: p.symlink_to("../../../../../../../../etc"))(root)
    check_refusal(cli, root, ["--root", str(root), "containerd", "configure"], 1,
                  r"conf\.d.*a symlink climbs above the root")
