"""`make demo` (gpunode_testing.demo) shows what it promises, so it cannot rot: a bare fixture T4
node booted by gpunode.service in a real systemd, containerd starting once, `gpunode status`
saying READY, and a podman container seeing its GPU through the CDI spec gpunode wrote."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gpunode_testing import demo, podman
from gpunode_testing.systemd_ns import MACHINE_PATHS

pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS, str(podman.BUSYBOX))


@pytest.fixture
def podman_present() -> None:
    if missing := podman.missing_tools():
        pytest.fail("missing " + ", ".join(missing) + ": make setup installs them")


def test_make_demo_boots_a_bare_t4_node_to_ready_and_a_container_sees_its_gpu(
        podman_present: None, capsys: pytest.CaptureFixture[str]) -> None:
    if reason := demo.systemd_unavailable():
        pytest.skip(f"the demo's real-systemd namespace cannot boot here ({reason})")
    rc = demo.main([])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "booted in a real systemd" in out
    for step in ("detect", "driver", "gpu_init", "cdi", "containerd"):
        assert re.search(rf"^   {step} +[\d.]+ ms  ", out, re.M), (step, out)
    assert "made /dev/nvidiactl, /dev/nvidia0" in out  # gpunode made the nodes, not the fixture
    assert "containerd.service started once, after gpunode.service was done" in out
    assert "gpunode status (/): READY" in out
    assert re.search(r"^   c[rw-]{9} .* 195, +0 .*/dev/nvidia0$", out, re.M), out
    assert "the container saw /dev/nvidia0: character device 195:0; libcuda.so.1: the " \
        "driver's libcuda.so.550.127.08; nvidia-smi: /usr/local/nvidia/bin/nvidia-smi" in out
    seconds = float(re.findall(r"^demo OK in ([\d.]+) s", out, re.M)[0])
    assert seconds < 60  # "well under a minute"; a few seconds on a quiet machine


def test_without_systemd_the_demo_boots_the_fixture_under_root_and_says_so(
        podman_present: None, tmp_path: Path) -> None:
    result = demo.run(work=tmp_path, systemd=False)
    lines = demo.render(result)
    assert "booted with `gpunode --root <fixture> boot` instead" in lines[1]
    assert [e["step"] for e in result.steps()] == ["detect", "driver", "gpu_init", "cdi",
                                                   "containerd"]
    assert result.verdict == "ready"
    if os.geteuid() != 0:
        assert result.container is None and "need root" in str(result.container_skipped)
        return
    assert result.container is not None, result.container_skipped
    assert result.container.nvidia0 == "character device 195:0", result.container.error
    assert result.ok(), "\n".join(lines)
