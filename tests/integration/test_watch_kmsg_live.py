"""The watch daemon's readers on this machine's real kernel interfaces: /dev/kmsg as a record
device (gpunode/watch/kmsg.py: one record per read from the start of the ring buffer, never
blocking) and an abstract notification socket (gpunode/watch/notify.py: '@name')."""

from __future__ import annotations

import os
import socket
import time

import pytest

from gpunode.errors import HostError
from gpunode.platform.host import Host
from gpunode.watch import kmsg, notify, xid

pytestmark = pytest.mark.allow_paths("/dev/kmsg")


def test_dev_kmsg_is_read_as_records_from_the_ring_buffer_s_start_without_blocking() -> None:
    try:
        stream = kmsg.RecordStream(Host(), "/dev/kmsg")
    except HostError as exc:  # a container without /dev/kmsg, or no CAP_SYSLOG
        pytest.skip(f"this machine's /dev/kmsg cannot be read: {exc}")
    try:
        assert stream.kind == "device" and stream.fileno() == stream.fd
        started = time.monotonic()
        records: list[str] = []
        while True:
            batch = stream.read()
            records += batch
            if not stream.more:
                break
        assert time.monotonic() - started < 5  # EAGAIN at the end, never a wait
        parsed = [xid.parse_record(r) for r in records]
        assert records and all(p is not None for p in parsed), records[:3]
        seqs = [p.seq for p in parsed if p is not None]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # one record per read
        print(f"{len(records)} records, seq {seqs[0]}..{seqs[-1]}, {stream.lost} overwritten")
        assert all(r.seq > seqs[-1] for r in map(xid.parse_record, stream.read()) if r)
    finally:
        stream.close()
        assert stream.fd == -1


def test_an_abstract_notify_socket_gets_the_datagram() -> None:
    name = f"gpunode-test-notify-{os.getpid()}"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind("\0" + name)
    manager.settimeout(2)
    try:
        notifier = notify.Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready("watching")
        assert manager.recv(4096) == b"READY=1\nSTATUS=watching"
        notifier.close()
    finally:
        manager.close()


@pytest.mark.allow_paths("/sys", "/run/udev")
def test_the_udev_monitor_of_pci_devices_is_made_on_a_live_host_by_default() -> None:
    from gpunode.config import AgentConfig
    from gpunode.watch import daemon

    monitor = daemon.Daemon(Host(), AgentConfig(), notify.Notifier({}))._udev_monitor()
    assert monitor is not None and isinstance(monitor.fileno(), int)
    assert daemon.poll_wait([monitor.fileno()], 0) in ([], [monitor.fileno()])
