"""The running kernel as /proc tells it: its release (which names /lib/modules/<release> and the
driver cache entries) and this boot's id."""

from __future__ import annotations

from gpunode.errors import DriverError
from gpunode.platform.host import Host

RELEASE = "/proc/sys/kernel/osrelease"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def release(host: Host) -> str:
    """The running kernel's release; a DriverError when /proc does not say it plainly."""
    text = host.read_optional(RELEASE)
    if not text or not text.strip():
        raise DriverError(f"cannot tell the running kernel: {RELEASE} is missing",
                          "is /proc mounted (and --root the node's root)?")
    value = text.strip()
    # It names directories (/lib/modules/<release>, cache entries): a kernel writes one word
    # of printable ASCII, anything else is a damaged file, not a kernel to build for.
    if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
        raise DriverError(f"cannot tell the running kernel: {host.display(RELEASE)} holds "
                          f"{value[:80]!r}, not a kernel release",
                          "is /proc mounted (and --root the node's root)?")
    return value
