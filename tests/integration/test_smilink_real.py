"""The nvidia-smi wrapper gpunode writes for the GPU Operator's validator, run for real by
/bin/sh: it runs the driver root's nvidia-smi with its arguments and the root's library
directory on LD_LIBRARY_PATH, whatever characters the paths hold."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gpunode.driver import smilink


def test_the_wrapper_runs_the_driver_roots_nvidia_smi_with_its_libraries(tmp_path: Path) -> None:
    root = tmp_path / "driver root's 'dir' $HOME"
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    smi = root / "bin" / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "lib=$LD_LIBRARY_PATH"\nfor a in "$@"; do echo "arg=$a"; '
                   "done\n")
    smi.chmod(0o755)
    wrapper = tmp_path / "opt-bin-nvidia-smi"
    wrapper.write_text(smilink.wrapper(str(smi), str(root / "lib")))
    wrapper.chmod(0o755)
    done = subprocess.run([str(wrapper), "--version", "two words"], capture_output=True,
                          text=True, timeout=10, check=True,
                          env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/elsewhere"})
    assert done.stdout.splitlines() == [f"lib={root}/lib", "arg=--version", "arg=two words"]
