"""The watch daemon's loop (gpunode/watch/daemon.py) on fixture nodes, with a fake clock and a
scripted poll(): what it reads from a FIFO or a file standing in for /dev/kmsg, when it wakes,
what it tells systemd (a real AF_UNIX socket in tmp_path), and how it treats an API server
that is away or refuses."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode import log
from gpunode.config import AgentConfig, KubernetesConfig
from gpunode.errors import ApiError, HostError
from gpunode.kube.client import _hint
from gpunode.platform.host import Host
from gpunode.watch import daemon, kmsg, notify, once
from helpers.watch_api import FakeApi

T4 = "0001:00:00.0"
XID = "PCI:0001:00:00"
SECOND = 1_000_000
CONFIG = AgentConfig(kubernetes=KubernetesConfig(node_name="t4-0"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Script:
    """poll() as the loop sees it: each call sleeps the whole timeout on the fake clock (or
    `advance` seconds), runs the next step, then says which real descriptors are readable; with
    no step left it stops the daemon."""

    def __init__(self, clock: Clock, steps: list[Callable[[], Any] | None]) -> None:
        self.clock = clock
        self.steps = list(steps)
        self.timeouts: list[float] = []
        self.daemon: daemon.Daemon | None = None

    def __call__(self, fds: list[int], timeout: float) -> list[int]:
        self.timeouts.append(round(timeout, 3))
        self.clock.now += timeout
        if not self.steps:
            assert self.daemon is not None
            self.daemon.request_stop()
            return []
        step = self.steps.pop(0)
        if step is not None:
            step()
        return daemon.poll_wait(fds, 0)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    yield sock
    sock.close()


def messages(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


@pytest.fixture
def t4(make_host: HostFactory) -> Host:
    return make_host("nc4as-t4-v3", "ready")


def fifo(host: Host) -> Path:
    path = host.root / "dev/kmsg"
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def feed(path: Path, *lines: str) -> Callable[[], None]:
    """A writer that opens the FIFO, writes `lines` and closes it (as `echo > fifo` does)."""
    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, "".join(line + "\n" for line in lines).encode())
        os.close(fd)
    return write


def make(host: Host, clock: Clock, steps: list[Callable[[], Any] | None], api: Any,
         notifier: notify.Notifier | None = None, **kw: Any) -> tuple[daemon.Daemon, Script]:
    script = Script(clock, steps)
    d = daemon.Daemon(host, CONFIG, notifier or notify.Notifier({}), clock=clock, wait=script,
                      api_factory=lambda: api, **kw)
    script.daemon = d
    return d, script


def conditions(api: FakeApi) -> list[tuple[str, str]]:
    return [(c["status"], c["reason"]) for c in api.conditions]


def test_ready_after_the_ring_buffer_then_the_watchdog_every_half_of_watchdog_usec(
        t4: Host, tmp_path: Path, manager: socket.socket) -> None:
    (t4.root / "dev/kmsg").write_text("6,1,100,-;Linux version 6.6.95-flatcar\n")
    clock = Clock()
    notifier = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify"),
                                "WATCHDOG_USEC": "20000000"})
    d, script = make(t4, clock, [None] * 6, FakeApi(), notifier)
    assert d.run() == 0
    sent = messages(manager)
    assert sent[1].startswith("READY=1\nSTATUS=1 kmsg records read, 1 passes")
    assert sent.count("WATCHDOG=1") == 6
    assert sent[-1] == "STOPPING=1\nSTATUS=stopping"
    # It sleeps until the next keep-alive (10 s) or check (30 s), never less.
    assert script.timeouts[:6] == [10.0, 10.0, 10.0, 10.0, 10.0, 10.0]
    assert d.passes == 1 + 2  # the ring buffer, then a periodic check at 30 s and 60 s


def test_an_idle_daemon_wakes_only_for_the_periodic_check(t4: Host) -> None:
    (t4.root / "dev/kmsg").write_text("")
    clock = Clock()
    d, script = make(t4, clock, [None] * 4, FakeApi())
    d.run()
    assert script.timeouts[:4] == [daemon.TICK_SECONDS] * 4


def test_an_xid_79_fed_to_the_fifo_is_one_gpu_ready_patch_and_only_new_lines_are_read(
        t4: Host) -> None:
    path = fifo(t4)
    api = FakeApi()
    seen: list[list[str]] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        seen.append(list(kwargs["kmsg"]))
        return once.run(*args, **kwargs)
    d, _ = make(t4, Clock(), [
        feed(path, "6,1,100,-;Linux version 6.6.95-flatcar"),
        feed(path, f"3,2,{5 * SECOND},-;NVRM: Xid ({XID}): 79, pid=1122, GPU has fallen off "
             "the bus."),
        None], api, run=run)
    assert d.run() == 0
    assert conditions(api) == [("False", "GPUFellOffBus")]
    assert api.calls == ["GET t4-0", "PATCH t4-0/status"]
    # the ring buffer (empty), each line alone, then the periodic check with nothing new
    assert [len(batch) for batch in seen] == [0, 1, 1, 0]
    saved = json.loads((t4.root / "run/gpunode/watch.json").read_text())
    assert saved["last_seq"] == 2


METRICS = "var/lib/node_exporter/textfile_collector/gpunode.prom"


def test_the_daemon_writes_the_metrics_file_after_its_passes(t4: Host) -> None:
    path = fifo(t4)
    d, _ = make(t4, Clock(), [feed(path, f"3,1,{SECOND},-;NVRM: Xid ({XID}): 79, pid=1122, GPU "
                                         "has fallen off the bus."), None, None], FakeApi())
    assert d.run() == 0
    text = (t4.root / METRICS).read_text()
    assert f'gpunode_xids_total{{address="{T4}",code="79"}} 1' in text
    assert 'state="fell-off-bus"} 1' in text


def test_records_already_waiting_are_reported_before_the_metrics_file_is_written(
        t4: Host) -> None:
    path = fifo(t4)
    d, _ = make(t4, Clock(), [], FakeApi())
    stream = kmsg.RecordStream(t4, once.KMSG)
    try:
        d._metrics_due, d._metrics_at = True, d.clock() - 1  # written a second ago
        feed(path, f"3,1,{SECOND},-;NVRM: Xid ({XID}): 79, GPU has fallen off the bus.")()
        d._write_metrics(stream)
        assert not (t4.root / METRICS).exists() and d._metrics_due  # the Xid goes first
        d.clock.now += daemon.TICK_SECONDS  # but the file is never a periodic check late
        d._write_metrics(stream)
        assert (t4.root / METRICS).exists() and not d._metrics_due
    finally:
        stream.close()


class DownApi(FakeApi):
    """An API server that is unreachable (or refuses with `status`) until `up` is set."""

    def __init__(self, status: int | None = None) -> None:
        super().__init__()
        self.up = False
        self.status = status
        self.attempts = 0

    def get_node(self, name: str) -> dict[str, Any]:
        if not self.up:
            self.attempts += 1
            hint = _hint(self.status) if self.status else ""
            raise ApiError(f"get node {name}", self.status, "connection refused"
                           if self.status is None else "forbidden", hint)
        return super().get_node(name)

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if not self.up:
            raise ApiError("create an Event", None, "connection refused")
        return super().create_event(namespace, body)


def test_an_api_server_away_gets_one_patch_with_the_latest_state_when_it_is_back(
        t4: Host, capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("json")
    path = fifo(t4)
    api = DownApi()

    def back() -> None:
        api.up = True
    d, script = make(t4, Clock(), [
        feed(path, f"3,1,{SECOND},-;NVRM: Xid ({XID}): 48, An uncorrectable double bit error"),
        None, None,
        feed(path, f"3,2,{2 * SECOND},-;NVRM: Xid ({XID}): 79, GPU has fallen off the bus."),
        None, None, back, None, None], api)
    assert d.run() == 0
    assert api.calls == ["GET t4-0", "PATCH t4-0/status"]  # one PATCH, after it came back
    [(status, reason)] = conditions(api)
    assert (status, reason) == ("False", "GPUFellOffBus")
    assert "Xid 48" in api.conditions[0]["message"] and "Xid 79" in api.conditions[0]["message"]
    # Tried again after 2, 4, 8 s ... (the clock sleeps each whole timeout), said once.
    assert api.attempts >= 3 and script.timeouts[1:3] == [2.0, 4.0]
    errors = [e for e in map(json.loads, capsys.readouterr().err.splitlines())
              if e["level"] == "error"]
    assert [e["event"] for e in errors] == ["watch.report_failed"]
    saved = json.loads((t4.root / "run/gpunode/watch.json").read_text())
    assert saved["condition"]["reason"] == "GPUFellOffBus"


def test_the_backoff_doubles_up_to_its_cap_and_memory_holds_at_most_the_events_limit(
        t4: Host) -> None:
    path = fifo(t4)
    api = DownApi()
    lines = [f"4,{n},{n * 700 * SECOND},-;NVRM: Xid ({XID}): 94, Contained ECC error."
             for n in range(1, 61)]
    d, script = make(t4, Clock(), [feed(path, line) for line in lines] + [None] * 6, api)
    d.run()
    assert len(d.unsent.events) == once.MAX_EVENTS and d.unsent.dropped == 60 - once.MAX_EVENTS
    assert d.unsent.backoff == daemon.BACKOFF_CAP
    assert max(script.timeouts) <= daemon.BACKOFF_CAP


def test_node_restriction_s_refusal_is_said_once_with_its_hint(
        t4: Host, capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("json")
    (t4.root / "dev/kmsg").write_text(
        f"3,1,{SECOND},-;NVRM: Xid ({XID}): 79, GPU has fallen off the bus.\n")
    api = DownApi(status=403)
    d, _ = make(t4, Clock(), [None] * 8, api)
    d.run()
    assert api.attempts >= 4
    errors = [e for e in map(json.loads, capsys.readouterr().err.splitlines())
              if e["level"] == "error"]
    assert len(errors) == 1 and "NodeRestriction" in errors[0]["hint"]


def test_a_pass_that_fails_keeps_its_records_and_tries_them_again_at_the_next_check(
        t4: Host) -> None:
    path = fifo(t4)
    api = FakeApi()
    calls = []

    def run(*args: Any, **kwargs: Any) -> Any:
        calls.append(list(kwargs["kmsg"]))
        if len(calls) == 2:
            raise HostError("read", "/proc/driver/nvidia/gpus", "Permission denied")
        return once.run(*args, **kwargs)
    line = f"3,1,{SECOND},-;NVRM: Xid ({XID}): 79, GPU has fallen off the bus."
    d, _ = make(t4, Clock(), [feed(path, line), None], api, run=run)
    d.run()
    assert calls == [[], [line], [line]]
    assert conditions(api) == [("False", "GPUFellOffBus")]


def test_a_flood_is_read_in_bounded_batches(t4: Host) -> None:
    count = kmsg.BATCH_RECORDS * 2 + 10
    (t4.root / "dev/kmsg").write_text("".join(
        f"4,{n},{n},-;usb 1-1: reset high-speed USB device number {n}\n"
        for n in range(1, count + 1)))
    sizes: list[int] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        sizes.append(len(kwargs["kmsg"]))
        return once.run(*args, **kwargs)
    d, _ = make(t4, Clock(), [], FakeApi(), run=run)
    d.run()
    assert sizes == [kmsg.BATCH_RECORDS, kmsg.BATCH_RECORDS, 10]
    assert json.loads((t4.root / "run/gpunode/watch.json").read_text())["last_seq"] == count


def test_under_root_udev_is_said_to_be_unavailable_once(
        t4: Host, capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("json")
    (t4.root / "dev/kmsg").write_text("")
    d, _ = make(t4, Clock(), [None], FakeApi())
    d.run()
    events = [json.loads(line)["event"] for line in capsys.readouterr().err.splitlines()]
    assert events.count("watch.udev_unavailable") == 1


def test_a_batch_left_in_the_fifo_s_queue_is_read_without_waiting(t4: Host) -> None:
    path = fifo(t4)
    count = kmsg.BATCH_RECORDS + 10
    lines = [f"6,{n},{n},-;x" for n in range(1, count + 1)]  # < 64 KiB: one pipe's worth
    sizes: list[int] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        sizes.append(len(kwargs["kmsg"]))
        return once.run(*args, **kwargs)
    d, script = make(t4, Clock(), [feed(path, *lines), None], FakeApi(), run=run)
    d.run()
    assert sizes[:3] == [0, kmsg.BATCH_RECORDS, 10]
    assert script.timeouts[1] == 0.0  # the rest was queued: no sleep before it


class FakeDevice:
    def __init__(self, action: str, pci_id: str, name: str = "0001:00:00.0") -> None:
        self.action, self.sys_name = action, name
        self.properties = {"PCI_ID": pci_id} if pci_id else {}


class FakeMonitor:
    def __init__(self, *devices: FakeDevice) -> None:
        self.devices = list(devices)

    def poll(self, timeout: float | None = None) -> FakeDevice | None:
        return self.devices.pop(0) if self.devices else None


@pytest.mark.parametrize(("devices", "changed"), [
    ([FakeDevice("remove", "10DE:1EB8")], True),
    ([FakeDevice("add", "10de:1eb8")], True),
    ([FakeDevice("unbind", "10DE:20B5")], True),
    ([FakeDevice("change", "10DE:1EB8")], False),  # not a GPU coming or going
    ([FakeDevice("remove", "8086:1572"), FakeDevice("add", "")], False),  # not NVIDIA
    ([FakeDevice("remove", "8086:1572"), FakeDevice("remove", "10DE:1EB8")], True),
], ids=["nvidia-removed", "nvidia-added-lowercase", "nvidia-unbound", "nvidia-changed",
        "other-vendors", "nvidia-among-others"])
def test_only_an_nvidia_pci_function_coming_or_going_starts_a_pass(
        devices: list[FakeDevice], changed: bool) -> None:
    monitor = FakeMonitor(*devices)
    assert daemon._nvidia_events(monitor) is changed
    assert monitor.devices == []  # every waiting event is read
