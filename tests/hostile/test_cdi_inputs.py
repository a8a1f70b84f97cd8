"""Hostile inputs to `gpunode cdi generate`: what the spec is made from (the driver's GPU
information, its version file, its user-space) and where it goes (--output). Each is refused
with one clear event, the documented exit code, and every file as it was."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from hostile.support import Cli, check_refusal

GPU = "0001:00:00.0"
INFORMATION = f"proc/driver/nvidia/gpus/{GPU}/information"
VERSION = "550.127.08"


def _write(path: str, text: str | bytes) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        data = text.encode() if isinstance(text, str) else text
        (root / path).write_bytes(data)

    return write


def _remove(path: str) -> Callable[[Path], None]:
    return lambda root: (root / path).unlink()


def _fifo(path: str) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        (root / path).unlink(missing_ok=True)
        os.mkfifo(root / path)

    return make


# (what is done to a T4 with its driver loaded, the argv after `cdi generate`, exit, pattern)
CASES: dict[str, tuple[Callable[[Path], None], list[str], int, str]] = {
    "information-a-fifo": (_fifo(INFORMATION), [], 1, r"information"),
    "driver-not-loaded": (_remove("proc/driver/nvidia/version"), [], 1,
                          r"no CDI spec without the driver"),
    "libcuda-missing": (_remove(f"usr/lib64/libcuda.so.{VERSION}"), [], 1,
                        rf"user-space is missing: libcuda.so.{VERSION}"),
    "output-relative": (lambda root: None, ["--output", "cdi/nvidia.yaml"], 2,
                        r"--output 'cdi/nvidia.yaml': name an absolute file path"),
    "output-a-fifo": (lambda root: (root / "etc/cdi").mkdir(parents=True) or os.mkfifo(
        root / "etc/cdi/nvidia.yaml"), ["--output", "/etc/cdi/nvidia.yaml"], 2,
        r"not a regular file"),
}


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_a_bad_input_is_refused_with_one_clear_event(
    make_host: HostFactory, cli: Cli, case: str
) -> None:
    change, argv, code, pattern = CASES[case]
    root = make_host("nc4as-t4-v3", "driver").root
    change(root)
    result = check_refusal(cli, root, ["--root", str(root), "cdi", "generate", *argv], code,
                           pattern)
    assert result.out == ""


# A UUID that names no GPU (none, garbage, the placeholder of a GPU not initialized yet, an
# index, `all`, a path): the GPU keeps its index device and `all`, and gets no UUID device.
UUIDS = {
    "uuid-missing": "Model: \t Tesla T4\nDevice Minor: \t 0\n",
    "uuid-not-a-device-name": "GPU UUID: \t GPU-1 /../x\nDevice Minor: \t 0\n",
    "uuid-an-index": "GPU UUID: \t 0\nDevice Minor: \t 0\n",
    "uuid-all": "GPU UUID: \t all\nDevice Minor: \t 0\n",
    "uuid-placeholder": "GPU UUID: \t GPU-????????-????-????-????-????????????\n"
                        "Device Minor: \t 0\n",
    "uuid-placeholder-cut": "GPU UUID: \t GPU-????\nDevice Minor: \t 0\n",
}


@pytest.mark.parametrize("case", UUIDS, ids=UUIDS.keys())
def test_a_uuid_that_names_no_gpu_costs_the_uuid_device_only(
    make_host: HostFactory, cli: Cli, case: str
) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    _write(INFORMATION, UUIDS[case])(root)
    result = cli("--root", str(root), "cdi", "generate", "--format", "json")
    assert result.code == 0, result.err
    assert [d["name"] for d in json.loads(result.out)["devices"]] == ["0", "all"]
    (warning,) = [e for e in result.events if e["event"] == "cdi.device_left_out"]
    assert "GPU 0 (0001:00:00.0) has its index device only" in str(warning["note"])


# -- one device minor for several GPUs (issue 38): never a spec that maps two GPUs to one node ---

ND96 = "nd96amsr-a100-v4"


def _same_minor(root: Path, addresses: tuple[str, ...] = ("0001:00:00.0", "0004:00:00.0"),
                minor: int = 0) -> None:
    for address in addresses:
        info = root / f"proc/driver/nvidia/gpus/{address}/information"
        info.write_text(re.sub(r"Device Minor: \t \d+", f"Device Minor: \t {minor}",
                               info.read_text()))


COLLIDE = r"0001:00:00.0 and 0004:00:00.0 all say Device Minor 0 \(/dev/nvidia0\)"


def test_cdi_generate_refuses_a_device_minor_two_gpus_name(
    make_host: HostFactory, cli: Cli
) -> None:
    root = make_host(ND96, "driver").root
    _same_minor(root)
    check_refusal(cli, root, ["--root", str(root), "cdi", "generate", "--output",
                              "/var/run/cdi/nvidia.yaml"], 1, COLLIDE)


def test_every_gpu_naming_one_minor_is_named(make_host: HostFactory, cli: Cli) -> None:
    """Eight GPUs on /dev/nvidia0, as the hostile round found: all eight named, no spec."""
    root = make_host(ND96, "driver").root
    _same_minor(root, tuple(f"{i:04x}:00:00.0" for i in range(1, 9)))
    result = check_refusal(cli, root, ["--root", str(root), "cdi", "generate"], 1,
                           r"0001:00:00.0 and .* and 0008:00:00.0 all say Device Minor 0")
    assert result.out == "" and result.errors[0]["error_code"] == "driver-device-minor-ambiguous"


def test_boot_writes_no_spec_and_status_fails_naming_the_gpus(
    make_host: HostFactory, cli: Cli
) -> None:
    """boot's cdi step fails (the spec is not written), status's cdi_spec check fails with the
    same words, and the node is not ready; a spec written before is judged by them too."""
    root = make_host(ND96, "ready").root
    _same_minor(root)
    result = cli("--root", str(root), "boot")
    assert result.code == 1
    record = json.loads((root / "run/gpunode/state.json").read_text())
    cdi_step = next(s for s in record["steps"] if s["name"] == "cdi")
    assert cdi_step["outcome"] == "failed" and re.search(COLLIDE, cdi_step["error"])
    assert cdi_step["code"] == "driver-device-minor-ambiguous"
    result = cli("--root", str(root), "status", "--json")
    assert result.code == 1
    check = next(c for c in json.loads(result.out)["checks"] if c["name"] == "cdi_spec")
    assert (check["state"], check["code"]) == ("fail", "driver-device-minor-ambiguous")
    assert re.search(COLLIDE, check["detail"])
