"""`make gpu-check` (gpunode_testing.gpu_check) on a fixture node carrying NVIDIA's real 550 files,
as far as a machine without a GPU goes: every gpunode command it runs passes, the CUDA program
runs in podman with gpunode's spec and reaches the real libcuda (driver 12040), and the check
fails there, saying the program found no device, as it must on a machine whose GPU is missing.
The node is left exactly as it was (the check is read-only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode_testing import cuda_probe, podman, real_driver
from hostile.support import snapshot
from real.nvidia_driver import ensure_driver

pytestmark = pytest.mark.allow_paths(*cuda_probe.MACHINE_PATHS)


def test_the_gpu_check_runs_every_step_and_changes_nothing(tmp_path: Path) -> None:
    driver = ensure_driver("550")
    source = real_driver.read_source(driver.root, driver.version)
    root = real_driver.build_node("nc4as-t4-v3", tmp_path / "node", source, "sysext",
                                  state="ready", flavour="open")
    probe = cuda_probe.ensure_probe()
    before = snapshot(root)
    done = subprocess.run([sys.executable, "-m", "gpunode_testing.gpu_check", "--root",
                           str(root), "--probe", str(probe.binary.parent), "--json"],
                          capture_output=True, text=True, timeout=600, check=False)
    report = json.loads(done.stdout)
    steps = {s["name"]: s for s in report["steps"]}
    assert [steps[n]["ok"] for n in ("detect", "status", "plan", "cdi generate")] == [True] * 4
    assert steps["detect"]["detail"] == "1 GPU(s): 0001:00:00.0 TU104GL [Tesla T4]"
    assert steps["nvidia-smi -L"]["ok"] is None  # --root is not /: no nvidia-smi is asked
    assert snapshot(root) == before
    if podman.missing_tools():
        assert steps["cuda in podman"]["ok"] is None and done.returncode == 0
        pytest.skip(f"podman missing here: {podman.missing_tools()}")
    cuda = steps["cuda in podman (nvidia.com/gpu=0)"]
    assert (cuda["ok"], cuda["output"]["driver"], cuda["output"]["devices_error"]) == (
        False, 12040, "cudaErrorNoDevice")
    assert done.returncode == 1 and "gpu-check: FAILED" in done.stderr
