"""Who brings the GPUs up for gpu/init.py: on a live node, systemd starts nvidia-persistenced and
gpunode opens the GPUs' device nodes itself; under --root nobody does (init.NoInitializer).

nvidia-persistenced runs as a systemd service, never as a child of gpunode: gpunode.service is a
oneshot-like unit whose processes systemd stops when it ends (KillMode=control-group), and a
daemon nobody supervises is restarted and stopped at shutdown by nobody. Where a unit file
`nvidia-persistenced.service` exists (a driver package or the image ships one: NVIDIA's sample
unit, Debian's, Flatcar's ebuild's) systemd starts that one, with its options; else
`systemd-run` makes it a transient unit of that name running `<driver's nvidia-persistenced>
--persistence-mode` (Type=forking, as NVIDIA's sample unit; `--collect`, so a start that
failed does not keep the name). Either way the name is one unit: systemd refuses a second
transient unit of it, and the step starts nothing while it is active (gpu/init.py
`persistenced_running`). systemd-run is systemd's own client for transient units: it turns
the unit's settings into StartTransientUnit's typed properties and waits for the start job,
as nothing else in gpunode needs to. Where no service manager answers (a container, a chroot)
nothing is started: the GPUs are opened once instead.

Opening a GPU: open(2) of /dev/nvidiaN without O_NONBLOCK, closed at once. The driver initializes
the GPU in that open (nvidia_open → nv_open_device → rm_init_adapter; a failure is EIO) and
keeps its UUID after the close. The open blocks while the GPU initializes, so it runs in a
thread bounded by the step's timeout: a GPU that hangs there is reported, and the thread is left
to the kernel.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpunode.errors import CommandFailed, SystemdError
from gpunode.gpu import init
from gpunode.platform import command
from gpunode.platform.host import Host
from gpunode.platform.systemd import UNKNOWN, Systemd

SYSTEMD_RUN = "systemd-run"


@dataclass(frozen=True)
class LiveInitializer:
    """A live node: persistenced through systemd, device nodes opened here."""

    host: Host
    systemd: Systemd
    may_act: bool = True

    def unit_state(self) -> str | None:
        state = self.systemd.active_state(init.PERSISTENCED_UNIT)
        return None if state == UNKNOWN else state

    def start_persistenced(self, binary: str, timeout: float) -> str:
        unit = init.PERSISTENCED_UNIT
        loaded = self.systemd.load_state(unit) if self.systemd.available else UNKNOWN
        if loaded == UNKNOWN:
            raise SystemdError(unit, "start", self.systemd.unavailable_reason or "no service "
                               "manager answers", "gpunode starts nvidia-persistenced only as "
                               "a systemd unit; the GPUs are opened once instead")
        if loaded == "loaded":
            self.systemd.start(unit, max(timeout, 10.0))
            return f"started {unit} (its unit file)"
        argv = [SYSTEMD_RUN, f"--unit={unit}", "--collect", "--service-type=forking",
                f"--property=PIDFile={init.PERSISTENCED_PID_FILE}",
                "--description=NVIDIA Persistence Daemon (started by gpunode)",
                self.host.real(binary), *init.PERSISTENCED_ARGS]
        try:
            command.run(argv, max(timeout, 10.0))
        except CommandFailed as exc:
            raise SystemdError(unit, "start", f"{' '.join(argv)}: {exc}",
                               f"see 'journalctl -u {unit}'") from exc
        return f"started {unit} (transient: {binary} {' '.join(init.PERSISTENCED_ARGS)})"

    def open_devices(self, paths: Sequence[str], timeout: float) -> dict[str, str]:
        """Open each at once, side by side (each GPU initializes in its own open); path → why
        it failed, for those that did."""
        failed: dict[str, str] = {}

        def once(path: str) -> None:
            try:
                fd = os.open(self.host.real(path), os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
            except OSError as exc:
                failed[path] = exc.strerror or str(exc)
                return
            os.close(fd)

        openers = [threading.Thread(target=once, args=(p,), name=f"open {p}", daemon=True)
                   for p in paths]
        for opener in openers:
            opener.start()
        deadline = time.monotonic() + timeout
        for path, opener in zip(paths, openers, strict=True):
            opener.join(max(0.0, deadline - time.monotonic()))
            if opener.is_alive():
                failed[path] = f"the open did not return within {timeout:g} s"
        return failed

def for_host(host: Host, systemd: Systemd) -> init.Initializer:
    return LiveInitializer(host, systemd) if host.is_live else init.NoInitializer()
