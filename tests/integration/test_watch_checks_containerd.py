"""The watch's containerd repair read back by real containerd 1.6, 1.7 and 2.x: after another
tool rewrote a configured node's config without the `nvidia` runtime, the file the watch
writes (gpunode/watch/checks.py, through `containerd configure`'s own code) is one every
version's `config dump` accepts, with the runtime a copy of runc running the NVIDIA runtime."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig
from gpunode.watch import checks
from gpunode_testing import fixtures
from helpers.fake_containerd import RecordingSystemd
from real.containerd_bins import VERSIONS, dump_config, ensure_containerd

NVIDIA_BINARY = "/usr/bin/nvidia-container-runtime"


@pytest.fixture(scope="module", params=VERSIONS, ids=[f"containerd-{v}" for v in VERSIONS])
def containerd(request: pytest.FixtureRequest) -> Path:
    try:
        return ensure_containerd(request.param)
    except Exception as err:  # a failure, never a skip: CI fetches the binaries first
        problem = f"could not get a real containerd {request.param}:\n{err}"
    pytest.fail(problem, pytrace=False)


def runtimes(dumped: dict[str, Any]) -> dict[str, Any]:
    plugins = dumped["plugins"]
    cri = plugins.get("io.containerd.cri.v1.runtime") or plugins["io.containerd.grpc.v1.cri"]
    return cri["containerd"]["runtimes"]


def test_the_repaired_config_is_read_by_real_containerd_with_the_nvidia_runtime(
        containerd: Path, make_host: HostFactory, tmp_path: Path) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    config = host.root / "etc/containerd/config.toml"
    config.write_text(fixtures.FLATCAR_CONTAINERD_CONFIG)  # another tool's rewrite
    found: list[dict[str, Any]] = []
    checks.run(host, AgentConfig(), found, {}, dry_run=False,
               manager=RecordingSystemd(state="inactive", host=host))
    assert [c["kind"] for c in found] == ["repair"]
    # config dump starts nothing; the machine's own containerd paths are kept out all the same
    text = config.read_text().replace("/var/lib/containerd", str(tmp_path / "root"))
    copy = tmp_path / "config.toml"
    copy.write_text(text.replace("/run/containerd", str(tmp_path / "state")))
    table = runtimes(tomllib.loads(dump_config(containerd, copy)))
    assert table["nvidia"]["options"]["BinaryName"] == NVIDIA_BINARY
    assert table["nvidia"]["runtime_type"] == table["runc"]["runtime_type"]
    # Under --root no containerd is asked for its effective runc table (configure's probe), so
    # the copy holds runc's options as the file has them; 2.x's dump adds its defaults to runc.
    nvidia, runc = table["nvidia"]["options"], table["runc"]["options"]
    assert nvidia["SystemdCgroup"] is True
    assert all(runc.get(k) == v for k, v in nvidia.items() if k != "BinaryName")
