"""Hostile inputs to what `status` and boot's gpu_init step read of GPU initialization:
persistenced's pid file, the process it names, the kernel log, the GPUs' information files.
None hangs or crashes a command; a garbage pid file is no running persistenced, and a GPU
is up only when its information file gives a UUID of NVML's form."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode_testing import fixtures
from hostile.support import Cli

PID_FILE = "run/nvidia-persistenced/nvidia-persistenced.pid"
INFORMATION = "proc/driver/nvidia/gpus/0001:00:00.0/information"


def _write(path: str, data: str | bytes) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data.encode() if isinstance(data, str) else data)
    return write


def _fifo(path: str) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).unlink(missing_ok=True)
        os.mkfifo(root / path)
    return make


def _both(*changes: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda root: [change(root) for change in changes] and None


# (what is done to a T4 with its driver loaded, gpu_init's state, a word of its detail)
PERSISTENCED = {
    "pid-file-a-fifo": (_fifo(PID_FILE), "ok", "no nvidia-persistenced runs"),
    "pid-file-garbage": (_write(PID_FILE, "12abc\n"), "ok", "no nvidia-persistenced runs"),
    "pid-file-huge-number": (_write(PID_FILE, "9" * 5000 + "\n"), "ok",
                             "no nvidia-persistenced runs"),
    "pid-file-binary": (_write(PID_FILE, b"\xff\xfe\x00\n"), "ok", "no nvidia-persistenced runs"),
    "pid-of-another-process": (_both(_write(PID_FILE, "812\n")), "ok",
                               "no nvidia-persistenced runs"),  # 812 is the fixture's containerd
    "comm-a-fifo": (_both(_write(PID_FILE, "4242\n"), _fifo("proc/4242/comm")), "ok",
                    "no nvidia-persistenced runs"),
    "kmsg-a-fifo-gpu-not-up": (_both(lambda root: fixtures.uninitialize_gpus(root),
                                     _fifo("dev/kmsg")), "fail", "shows the placeholder UUID"),
    "uuid-lowercase-placeholder-cut": (_write(INFORMATION, "GPU UUID: \t GPU-????\n"
                                              "Device Minor: \t 0\n"), "fail",
                                       "shows the placeholder UUID 'GPU-????'"),
    "uuid-not-nvml-form": (_write(INFORMATION, "GPU UUID: \t GPU-12\nDevice Minor: \t 0\n"),
                           "fail", "not a GPU UUID"),
}


@pytest.mark.parametrize("case", PERSISTENCED, ids=PERSISTENCED.keys())
def test_status_judges_gpu_init_without_hanging_or_crashing(
    make_host: HostFactory, cli: Cli, case: str
) -> None:
    change, state, words = PERSISTENCED[case]
    root = make_host("nc4as-t4-v3", "driver").root
    change(root)
    result = cli("--root", str(root), "status", "--json")
    check = next(c for c in json.loads(result.out)["checks"] if c["name"] == "gpu_init")
    assert (check["state"], words in check["detail"]) == (state, True), check
    assert result.errors == []


def test_boot_under_root_names_the_gpu_not_up_at_once_even_with_a_fifo_for_a_log(
    make_host: HostFactory, cli: Cli
) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    fixtures.uninitialize_gpus(root)
    os.mkfifo(root / "dev/kmsg")
    result = cli("--root", str(root), "boot")
    assert result.code == 1
    record = json.loads((root / "run/gpunode/state.json").read_text())
    step = next(s for s in record["steps"] if s["name"] == "gpu_init")
    assert (step["outcome"], step["code"]) == ("failed", "gpu-init-failed")
    assert list(step["not_ready"]) == ["0001:00:00.0"]
