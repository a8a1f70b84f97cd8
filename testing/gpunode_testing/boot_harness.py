"""A fixture GPU node booted in a real systemd, in Flatcar's shape: the end-to-end boot test
(tests/integration/test_boot_systemd.py) and the boot-path benchmark (benchmarks/boot_path.py)
share it.

The fixture's PCI functions and driver files are bind-mounted over the real ones, gpunode from
this virtualenv goes on /usr/bin, and containerd.service reads Flatcar's config on /usr, so
gpunode runs as on a node, with root /.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpunode_testing import fixtures
from gpunode_testing.boundary import DEFAULT_TEST_CACHE
from gpunode_testing.driver_files import install_lines

# The repository's units/ (this package is installed editable from testing/).
UNITS = Path(__file__).resolve().parents[2] / "units"
WORK_PARENT = Path(DEFAULT_TEST_CACHE)  # on disk, outside /tmp: visible in a namespace
CONTAINERD_UNIT = "\n".join(line for line in fixtures.FLATCAR_CONTAINERD_UNIT.splitlines()
                            if not line.startswith("ExecStartPre")) + "\n"
KUBELET_UNIT = """[Unit]
Description=stand-in kubelet (needs containerd, as the real one does)
After=containerd.service gpunode.service
Wants=containerd.service

[Service]
ExecStart=/bin/sleep infinity

[Install]
WantedBy=multi-user.target
"""


def node_prepare(fixture: Path, gpunode_on_usr: bool = True,
                 shipped_dropin: bool = False, agent_config: bool = True) -> list[str]:
    """Shell lines run inside before systemd starts (with /usr a copy-on-write overlay): the
    fixture's PCI functions and driver files over the real ones, its driver user-space, gpunode
    on /usr/bin (unless a test's system extension brings it), Flatcar's containerd config on
    /usr; with `shipped_dropin`, the containerd drop-in gpunode's sysext ships
    (units/containerd-env.conf), where the sysext puts it; without `agent_config`, no
    /etc/gpunode/config.toml (only for a fixture without NVIDIA functions, which udev's view
    of the fixture's directories cannot mislead)."""
    gpunode = Path(sys.executable).with_name("gpunode")
    lines = [f"mount -n --bind {fixture}/sys/bus/pci/devices /sys/bus/pci/devices"]
    if (fixture / "proc/driver/nvidia").exists():
        lines.append(f"mount -n --bind {fixture}/proc/driver /proc/driver")
    # This kernel has no /proc/modules (no module support): gpunode then reads /sys/module.
    lines += [f"mount -n --bind {fixture}/sys/module /sys/module",
              f"mount -n --bind {fixture}/proc/devices /proc/devices",
              *install_lines(fixture)]  # the driver's user-space, onto the /usr overlay
    if gpunode_on_usr:
        lines += [f"printf '#!/bin/sh\\nexec {gpunode} \"$@\"\\n' > /usr/bin/gpunode",
                  "chmod 755 /usr/bin/gpunode"]
    if shipped_dropin:
        shipped = "/usr/lib/systemd/system/containerd.service.d/10-gpunode-env.conf"
        lines += [f"mkdir -p {shipped.rpartition('/')[0]}",
                  f"cp {UNITS / 'containerd-env.conf'} {shipped}"]
    lines += [
        "printf '#!/bin/sh\\nexec runc \"$@\"\\n' > /usr/bin/nvidia-container-runtime",
        "chmod 755 /usr/bin/nvidia-container-runtime",
        "mkdir -p /usr/share/containerd",
        f"cp {fixture}/usr/share/containerd/config.toml /usr/share/containerd/config.toml",
        "rm -f /etc/containerd/config.toml",  # Debian's package file; Flatcar has none
        "rm -rf /var/lib/gpunode",  # (overlay) a node gpunode never touched
        # udev gives devices outside /sys/devices the subsystem "subsystem", so the fixture's
        # directories in /sys/bus/pci/devices are read as plain sysfs files.
        *(["mkdir -p /etc/gpunode",
           "printf '[detect]\\nsource = \"sysfs\"\\n' > /etc/gpunode/config.toml"]
          if agent_config else []),
    ]
    return lines
