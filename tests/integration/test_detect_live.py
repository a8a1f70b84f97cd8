"""On this machine's real /sys (PCI devices, none of them NVIDIA): udev and sysfs agree."""

from __future__ import annotations

import os

import pytest

from gpunode.gpu.detect import detect
from gpunode.platform.host import Host

# The machine's PCI devices (libudev reads /sys itself) and the PCI names it has.
pytestmark = pytest.mark.allow_paths(
    "/sys", "/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids")


@pytest.fixture(scope="module")
def live() -> Host:
    if not os.listdir("/sys/bus/pci/devices"):
        pytest.skip("this machine exposes no PCI devices in /sys")
    return Host()


def test_udev_and_sysfs_yield_identical_records_for_every_pci_function(live: Host) -> None:
    via_udev = detect(live, vendor=None, use_udev=True)
    via_sysfs = detect(live, vendor=None, use_udev=False)
    assert via_udev.source == "udev"  # pyudev really ran, it did not fall back
    assert via_sysfs.source == "sysfs"
    assert len(via_udev.functions) == len(os.listdir("/sys/bus/pci/devices"))
    assert via_udev.functions == via_sysfs.functions
    assert via_udev.problems == via_sysfs.problems


def test_live_detect_defaults_to_udev_and_keeps_exactly_the_nvidia_functions(live: Host) -> None:
    result = detect(live)
    everything = detect(live, vendor=None)
    assert result.source == "udev"
    assert result.functions == tuple(f for f in everything.functions if f.vendor_id == "10de")
