"""A node booted from a baked image: the driver step, plan and status read the bake manifest —
"baked, no download" while the node runs what was baked, a warning once an OS update moved it
on without a re-bake. (The bake itself: test_image_bake.py; over HTTP, with a boot that makes
no request: tests/integration/test_bake_http.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import HostFactory, with_runtime_binary
from helpers.bake import DRIVER, make_inputs
from hostile.support import Cli

KERNEL_FILE = "proc/sys/kernel/osrelease"


def _bake(root: Path, tmp_path: Path, cli: Cli) -> None:
    config = make_inputs(tmp_path / "mirror").config()
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err


def _bake_check(cli: Cli, root: Path) -> dict[str, str]:
    status = cli("--root", str(root), "status", "--json")
    return next(c for c in json.loads(status.out)["checks"] if c["name"] == "bake")


def test_the_driver_step_says_the_merged_sysext_was_baked_and_downloads_nothing(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = with_runtime_binary(make_host("nc4as-t4-v3", "bare")).root
    _bake(root, tmp_path, cli)
    # what the initramfs leaves once systemd-sysext merged the baked file
    release = root / f"usr/lib/extension-release.d/extension-release.flatcar-{DRIVER}"
    release.parent.mkdir(parents=True, exist_ok=True)
    release.write_text("ID=flatcar\n")
    plan = cli("--root", str(root), "plan")
    assert plan.code == 0, plan.err
    assert (f"driver: flatcar-sysext: the Flatcar driver sysext flatcar-{DRIVER} is merged, "
            "baked into the image for Flatcar 4459.2.1: no download") in plan.out


def test_status_shows_the_bake_as_ok_while_the_node_runs_what_was_baked(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    _bake(root, tmp_path, cli)
    check = _bake_check(cli, root)
    assert check["state"] == "ok"
    assert check["detail"] == (f"baked gpunode 0.2.0, {DRIVER} (Flatcar 4459.2.1): no download "
                               "at boot")


def test_status_warns_when_an_os_update_came_without_a_rebake(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    _bake(root, tmp_path, cli)
    release = root / "etc/os-release"
    release.write_text(release.read_text().replace("4459.2.1", "4459.2.2"))
    check = _bake_check(cli, root)
    assert check["state"] == "warn"
    assert "the node runs Flatcar 4459.2.2, not the baked 4459.2.1" in check["detail"]
    assert "downloaded at boot" in check["detail"]
    assert "gpunode image bake" in check["hint"]
    plan = cli("--root", str(root), "plan")
    assert "not the baked 4459.2.1: a download at boot" in plan.out


def test_status_warns_when_the_running_kernel_is_not_the_baked_one(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    (root / "usr/lib/modules/6.6.95-flatcar").mkdir(parents=True)
    (root / "usr/lib/modules/6.6.95-flatcar/modules.dep").write_text("")
    _bake(root, tmp_path, cli)
    assert json.loads((root / "etc/gpunode/baked.json").read_text())["os"]["kernel"] == \
        "6.6.95-flatcar"
    (root / KERNEL_FILE).write_text("6.12.40-flatcar\n")
    check = _bake_check(cli, root)
    assert check["state"] == "warn"
    assert "the running kernel is 6.12.40-flatcar, not the baked 6.6.95-flatcar" in \
        check["detail"]


def test_a_node_that_was_not_baked_has_no_bake_check(make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    status = json.loads(cli("--root", str(root), "status", "--json").out)
    assert "bake" not in [c["name"] for c in status["checks"]]
    assert status["baked"] is None


def test_a_damaged_manifest_is_a_warning_not_a_failure(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    _bake(root, tmp_path, cli)
    (root / "etc/gpunode/baked.json").write_text('{"schema_version": 7}')
    status = cli("--root", str(root), "status", "--json")
    check = next(c for c in json.loads(status.out)["checks"] if c["name"] == "bake")
    assert check["state"] == "warn" and check["code"] == "bake-manifest-invalid"
    assert "baked.json" in check["detail"]
