"""Restarting containerd after a config change: through systemd, then waiting until its socket
answers; and what is said when containerd is not running (or not managed here)."""

from __future__ import annotations

import time

from gpunode import log
from gpunode.containerd import edit
from gpunode.containerd.discover import CONTAINERD_UNIT
from gpunode.errors import HostError, SystemdError
from gpunode.platform.host import Host
from gpunode.platform.systemd import Systemd

DEFAULT_SOCKET = "/run/containerd/containerd.sock"


def config_text(host: Host, target: str, original: str | None) -> str:
    text = host.read_optional(target)
    if text is None and original is not None:
        text = host.read_optional(original)
    return text or ""


def note_not_restarted(systemd: Systemd, target: str) -> None:
    if systemd.available:
        log.get().info("containerd.not_running", target=target,
                       note="containerd will read the new config when it starts")
    else:
        log.get().warning("containerd.unmanaged", target=target,
                          note="containerd is not managed by a reachable systemd here: it reads "
                          "the new config when it next starts; whoever runs it must restart it "
                          "if it is running now")


def restart(host: Host, systemd: Systemd, config_text: str, timeout: float) -> None:
    started = time.monotonic()
    systemd.restart(CONTAINERD_UNIT, timeout)
    _wait_for_socket(host, _socket_path(config_text), timeout - (time.monotonic() - started))


def _socket_path(config_text: str) -> str:
    try:
        doc = edit.parse(config_text, "containerd config")
    except edit.EditError:
        return DEFAULT_SOCKET
    grpc = doc.get("grpc")
    address = grpc.get("address") if isinstance(grpc, dict) else None
    return address if isinstance(address, str) and address else DEFAULT_SOCKET


def _wait_for_socket(host: Host, path: str, timeout: float) -> None:
    deadline = time.monotonic() + max(timeout, 1.0)
    last = "not tried"
    while time.monotonic() < deadline:
        try:
            host.connect(path)
            return
        except HostError as exc:
            last = exc.reason
        time.sleep(0.05)
    raise SystemdError(CONTAINERD_UNIT, "reach", f"{path} does not answer: {last}")
