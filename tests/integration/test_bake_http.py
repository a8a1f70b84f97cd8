"""`gpunode image bake` from a real HTTP server on 127.0.0.1 into a Flatcar fixture root: the
artifacts fetched once and verified, a retried 503, a second bake that asks the server nothing,
and then a boot of that root (driver loaded) that makes no request either while plan and status
say the image is baked."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import HostFactory, with_runtime_binary
from helpers.bake import DRIVER, DRIVER_PATH, GPUNODE_FILE, GPUNODE_PATH, make_inputs, serving
from hostile.support import Cli


def test_a_bake_over_http_fetches_each_artifact_once_and_a_second_bake_nothing(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "mirror")
    with serving(tmp_path / "mirror") as server:
        config = inputs.config(base=server.url)
        first = cli("image", "bake", "--root", str(root), "--config", str(config))
        assert first.code == 0, first.err
        assert sorted(server.requests) == sorted([f"/{GPUNODE_FILE}", f"/flatcar-{DRIVER}.raw"])
        second = cli("image", "bake", "--root", str(root), "--config", str(config))
        assert second.code == 0, second.err
        assert len(server.requests) == 2  # nothing asked again
    assert "nothing changed" in second.out
    assert (root / GPUNODE_PATH).read_bytes() == inputs.images[GPUNODE_FILE]
    assert (root / DRIVER_PATH).read_bytes() == inputs.images[f"flatcar-{DRIVER}.raw"]
    manifest = json.loads((root / "etc/gpunode/baked.json").read_text())
    assert manifest["artifacts"][0]["source"] == f"{server.url}{GPUNODE_FILE}"


def test_a_busy_server_is_asked_again_within_the_attempts(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "mirror")
    with serving(tmp_path / "mirror", fail_first=1) as server:
        config = inputs.config(base=server.url, driver=None)
        result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err
    assert server.requests == [f"/{GPUNODE_FILE}"] * 2
    assert any(e["event"] == "bake.retry" for e in result.events)


def test_a_corrupt_download_is_refused_and_nothing_is_placed(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "mirror")
    with serving(tmp_path / "mirror") as server:
        config = inputs.config(base=server.url)
        (tmp_path / "mirror" / f"flatcar-{DRIVER}.raw").write_bytes(b"tampered on the mirror")
        result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 1
    assert "the bake config pins; nothing was placed" in result.errors[0]["error"]
    assert not (root / "opt/extensions").exists() and not (root / "etc/flatcar/sysext").exists()
    assert not list(root.rglob("*.gpunode-tmp"))


def test_a_baked_node_boots_without_a_request_and_plan_and_status_say_it_is_baked(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = with_runtime_binary(make_host("nc4as-t4-v3", "driver")).root
    inputs = make_inputs(tmp_path / "mirror")
    with serving(tmp_path / "mirror") as server:
        config = inputs.config(base=server.url)
        assert cli("image", "bake", "--root", str(root), "--config", str(config)).code == 0
        baked_requests = len(server.requests)
        plan = cli("--root", str(root), "plan")
        boot = cli("--root", str(root), "boot")
        status = cli("--root", str(root), "status", "--json")
        assert len(server.requests) == baked_requests  # the node asked nothing
    assert plan.code == 0, plan.err
    assert f"{DRIVER} (Flatcar 4459.2.1): baked, no download" in plan.out
    assert boot.code == 0, boot.err
    document = json.loads(status.out)
    bake = next(c for c in document["checks"] if c["name"] == "bake")
    assert bake["state"] == "ok" and "no download at boot" in bake["detail"]
    assert document["baked"]["artifacts"][1]["name"] == DRIVER
