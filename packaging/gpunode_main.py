"""The frozen gpunode's entry point (PyInstaller runs this file as __main__): gpunode.entry:run,
after giving back the environment the bundle's bootloader changed.

PyInstaller's bootloader starts the bundle with its own libraries first in LD_LIBRARY_PATH (the
caller's value, if any, kept in LD_LIBRARY_PATH_ORIG) and a few _PYI_* variables. This process
needs that, and the dynamic loader has read it at start-up; but every program gpunode runs
(modprobe, insmod, modinfo, systemd-nspawn, containerd, nvidia-smi) would inherit it and load the
bundle's libcrypto, libzstd, liblzma, libsystemd... from the build machine (Debian 12) instead
of the node's own, which can be older than what the node's programs were built against ("version
`OPENSSL_3.2.0' not found"). So the environment is restored before gpunode starts.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping


def restore_environment(environ: MutableMapping[str, str]) -> None:
    """LD_LIBRARY_PATH as the caller had it (or unset), no _PYI_* variables."""
    original = environ.pop("LD_LIBRARY_PATH_ORIG", None)
    if original is None:
        environ.pop("LD_LIBRARY_PATH", None)
    else:
        environ["LD_LIBRARY_PATH"] = original
    for name in [name for name in environ if name.startswith("_PYI_")]:
        del environ[name]


if __name__ == "__main__":
    restore_environment(os.environ)
    from gpunode.entry import run

    run()
