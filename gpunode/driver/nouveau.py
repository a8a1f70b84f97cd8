"""nouveau, the kernel's own driver for NVIDIA GPUs: it must not bind them, or the NVIDIA
modules cannot. The modprobe.d file that keeps it away, stated once: ignition installs it, and
every hint that says how to blacklist it quotes it."""

from __future__ import annotations

BLACKLIST_FILE = "/etc/modprobe.d/blacklist-nouveau.conf"
BLACKLIST_TEXT = "blacklist nouveau\noptions nouveau modeset=0\n"
BLACKLIST_HINT = ("blacklist it: write "
                  + " and ".join(repr(line) for line in BLACKLIST_TEXT.splitlines())
                  + f" to {BLACKLIST_FILE}, then reboot")
