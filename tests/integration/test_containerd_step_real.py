"""The containerd step against real things: a read-only bind mount in a mount namespace, GNU
patch applying the dry-run diff, and real containerd 1.6, 1.7 and 2.x dumping reverted
configs. The step on fixture hosts with a recording systemd: tests/unit/test_containerd_step.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HostFactory, in_place_host, with_runtime_binary
from gpunode.config import ContainerdConfig
from gpunode.containerd import revert, step
from gpunode.containerd.edit import EditError
from gpunode.platform.systemd import NoSystemd
from gpunode_testing import fixtures
from helpers.containerd_vectors import VECTORS
from real.containerd_bins import ContainerdError, dump_config, ensure_binary


def test_read_only_file_system_is_refused_and_the_config_stays(make_host: HostFactory) -> None:
    """A real read-only bind mount (root ignores directory permissions, not EROFS)."""
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    directory = host.root / "etc/containerd"
    (directory / "config.toml").write_text(fixtures.FLATCAR_CONTAINERD_CONFIG)
    before = (directory / "config.toml").read_bytes()
    script = (f"mount --bind {directory} {directory} && "
              f"mount -o remount,ro,bind {directory} && "
              f"exec {sys.executable} -m gpunode --log-format json --root {host.root} "
              "containerd configure")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1, done.stderr
    assert "Read-only file system" in done.stderr
    assert (directory / "config.toml").read_bytes() == before
    assert sorted(p.name for p in directory.iterdir()) == ["config.toml"]


# -- the dry-run diff ----------------------------------------------------------------------------


def test_dry_run_diff_of_a_file_without_final_newline_applies_with_patch(
    make_host: HostFactory, tmp_path: Path,
) -> None:
    if shutil.which("patch") is None:
        pytest.fail("GNU patch is missing: apt-get install -y patch", pytrace=False)
    host, target = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG.rstrip("\n"))
    the_plan = step.plan(host, ContainerdConfig(enable_cdi=True), NoSystemd())
    diff = the_plan.diff()
    assert "\\ No newline at end of file\n" in diff
    copy = tmp_path / "config.toml"
    copy.write_text(target.read_text())
    done = subprocess.run(["patch", "--batch", "--forward", str(copy)], input=diff, text=True,
                          capture_output=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert copy.read_text() == the_plan.edit.text


# -- real containerd: a reverted file means what the untouched one meant ------------------------


@pytest.mark.parametrize("version", ["1.6", "1.7", "2"])
def test_reverted_configs_dump_as_the_untouched_ones_in_real_containerd(
    make_host: HostFactory, tmp_path: Path, version: str,
) -> None:
    """Each vector input, configured (runtime, default, CDI), then commented by its user, then
    reverted: byte-for-byte the input plus the comment, and real containerd's `config dump` of
    it equals the dump of the untouched input plus the comment."""
    binary = ensure_binary(version).path
    checked = []
    for vector in sorted(p.name for p in VECTORS.iterdir()):
        original = (VECTORS / vector / "input.toml").read_text()
        host, target = in_place_host(make_host, original + "# the user's note\n")
        try:
            want = dump_config(binary, target)  # the same path: a dump names the file
        except ContainerdError:
            continue  # a config this containerd refuses as it is (a v3 file on 1.x)
        target.write_text(original)
        config = ContainerdConfig(set_as_default=True, enable_cdi=True)
        try:
            the_plan = step.plan(host, config, NoSystemd())
        except EditError:
            continue  # refused as it stands (tests/unit/test_containerd_edit.py says why)
        step.apply(host, the_plan, NoSystemd(), 5)
        target.write_text(target.read_text() + "# the user's note\n")
        revert.revert(host, NoSystemd(), 5)
        assert target.read_text() == original + "# the user's note\n", vector
        assert dump_config(binary, target) == want, vector
        checked.append(vector)
    assert len(checked) >= 6, checked
