"""gpunode where no systemd answers on the system bus (an image build, a chroot, a container,
CI): boot's preflight on a live host says what it could not check and goes on, never a
traceback. The same on the live root, for real, in a namespace without a bus:
tests/integration/test_boot_nobus_namespace.py.
"""

from __future__ import annotations

import json

import pytest

from gpunode.pipeline.boot import _refuse_flatcar_nvidia
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd


class NoBus(NoSystemd):
    """The D-Bus adapter as it answers on a live host with no reachable bus."""

    unavailable_reason = ("no systemd on the system bus (unix:path=/run/dbus/system_bus_socket: "
                          "Could not open a bus to DBus (No such file or directory))")


def test_boot_preflight_on_a_live_host_without_a_bus_logs_that_it_could_not_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _refuse_flatcar_nvidia(Host(), NoBus())  # no ConflictError: nobody can say it runs
    [event] = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert (event["event"], event["level"], event["unit"]) == (
        "boot.preflight_unchecked", "warning", "nvidia.service")
    assert event["reason"] == NoBus.unavailable_reason
