"""What Flatcar Container Linux itself provides around NVIDIA GPUs, as gpunode meets it.

- `nvidia.service`, enabled in the base image's /usr (ExecStart=/usr/lib/nvidia/bin/setup-nvidia):
  compiles and installs a driver in the developer container at boot; gpunode's Ignition
  snippet masks it, and `gpunode boot` refuses to race it (the preflight step).
- The official driver sysexts (`flatcar-nvidia-drivers-<branch>[-open]`): enabled by a line
  in /etc/flatcar/enabled-sysext.conf, fetched by the initramfs, and once merged they leave
  an extension-release file under /usr/lib/extension-release.d.
"""

from __future__ import annotations

NVIDIA_UNIT = "nvidia.service"
ENABLED_SYSEXT = "/etc/flatcar/enabled-sysext.conf"
EXTENSION_RELEASE_DIR = "/usr/lib/extension-release.d"
SYSEXT_PREFIX = "extension-release.flatcar-nvidia-drivers-"
