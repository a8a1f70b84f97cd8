"""`gpunode watch`, the daemon of gpunode-watch.service: /dev/kmsg followed, udev's NVIDIA PCI
events heard, a periodic check, and every change made by the same pass as `--once`.

One loop around one poll(): on /dev/kmsg (kmsg.py: from the start of the ring buffer, in
bounded batches), on udev's monitor when there is one (pyudev, imported only here; NVIDIA PCI
functions added or removed start a pass at once), and on a pipe that SIGTERM writes to
(signal.set_wakeup_fd: a clean exit 0). Its timeout is the next of: the periodic check, the
watchdog's keep-alive, the next attempt to reach the API server. Every pass is once.run with the
records read since the last one, so the daemon decides exactly as `--once` does and remembers
what it reported in the same state file; a restart reads the ring buffer again and skips what
the state says was read.

The periodic check, every TICK_SECONDS (30 s): a pass with no new records, which counts the
GPUs against the boot's detection (and whatever else once.run checks). It is what finds a
GPU gone where udev says nothing (no udev under --root, in a container, or with
detect.source = "sysfs"); 30 s is well inside the minutes a lost GPU takes to matter (a pod
scheduled onto it fails, the device plugin's own health check), and a pass reads a few dozen
small files (a few milliseconds), so the idle daemon costs next to nothing. Nothing polls
faster: between events the process sleeps in poll().

The API server (Unsent, below): a pass whose changes are not accepted keeps only the latest
desired state — the state file records what was read but not the condition, so the next pass
decides the GPUReady to send again from what is true then, and at most once.MAX_EVENTS Events
wait in memory — and tries again after a bounded exponential backoff (BACKOFF_FIRST doubling
to BACKOFF_CAP); meanwhile passes go on reading and deciding but contact nothing. An error is
logged once (with its hint: NodeRestriction's for a 403), not on every attempt.
"""

from __future__ import annotations

import math
import os
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpunode import log
from gpunode.config import AgentConfig
from gpunode.errors import GpunodeError, UsageError
from gpunode.platform.host import Host
from gpunode.watch import kmsg, notify, once
from gpunode.watch import state as watchstate

TICK_SECONDS = 30.0  # the periodic check (see above)
BACKOFF_FIRST = 2.0  # seconds before the API server is tried again after a failure
BACKOFF_CAP = 60.0
NVIDIA_PCI_ID = "10DE:"  # the kernel's PCI_ID uevent property: vendor:device, upper case
UDEV_ACTIONS = ("add", "remove", "bind", "unbind")

Wait = Callable[[list[int], float], list[int]]


def poll_wait(fds: list[int], timeout: float) -> list[int]:
    """The descriptors of `fds` that are readable (or hung up) within `timeout` seconds."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLPRI)
    return [fd for fd, _ in poller.poll(max(0, math.ceil(timeout * 1000)))]


class Unsent:
    """What the API server has not accepted yet: passed to once.run, which hands it the
    decision instead of sending it itself."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.events: deque[dict[str, Any]] = deque(maxlen=once.MAX_EVENTS)
        self.dropped = 0  # Events pushed out while the API server was away
        self.retry_at = 0.0
        self.backoff = 0.0
        self.error: GpunodeError | None = None
        self.condition_pending = False
        self.reports = 0  # passes whose changes were accepted
        self._said: str | None = None

    @property
    def waiting(self) -> bool:
        """Something to send once the backoff is over."""
        return self.error is not None and (self.condition_pending or bool(self.events))

    def send(self, host: Host, config: AgentConfig, decision: once.Decision,
             api_factory: Callable[[], Any] | None) -> None:
        condition = [c for c in decision.changes if c["kind"] == "condition"]
        events = [c for c in decision.changes if c["kind"] != "condition"]
        self.dropped += max(0, len(self.events) + len(events) - once.MAX_EVENTS)
        self.events.extend(events)
        changes = condition + list(self.events)
        if not changes:
            self.condition_pending = False
            return
        if self.clock() < self.retry_at:
            self._keep(host, decision, bool(condition))
            return
        from gpunode.watch import report

        try:
            report.apply(host, config, changes, api_factory, retry_seconds=0)
        except GpunodeError as exc:
            self._failed(exc)
            self._keep(host, decision, bool(condition))
            return
        if self.error is not None:
            log.get().info("watch.report_resumed", dropped_events=self.dropped,
                           note="the API server took the latest state")
        self.events.clear()
        self.error, self._said = None, None
        self.backoff = self.retry_at = 0.0
        self.dropped = 0
        self.condition_pending = False
        self.reports += 1

    def _keep(self, host: Host, decision: once.Decision, condition: bool) -> None:
        """Remember what was read, but not the GPUReady that was not sent: the next pass
        decides it again, from what is true then."""
        previous, _ = watchstate.read(host)
        same_boot = previous is not None and previous.boot_id == decision.state.boot_id
        decision.state.condition = previous.condition if same_boot and previous else None
        self.condition_pending = self.condition_pending or condition

    def _failed(self, exc: GpunodeError) -> None:
        self.error = exc
        self.backoff = min(BACKOFF_CAP, self.backoff * 2 if self.backoff else BACKOFF_FIRST)
        self.retry_at = self.clock() + self.backoff
        said = f"{exc.code}: {exc}"
        if said != self._said:  # once per distinct error, not once per attempt
            self._said = said
            log.get().error("watch.report_failed", exc=exc, retry_in_s=self.backoff,
                            note="the latest GPUReady is kept and sent when the API server "
                            f"takes it (tried again with backoff up to {BACKOFF_CAP:g} s; "
                            "this error is said once)")
        else:
            log.get().debug("watch.report_failed_again", error_code=exc.code,
                            retry_in_s=self.backoff)


class _Keepalive:
    """The API client with a watchdog keep-alive before every request: a pass that waits for
    a slow API server (at most kubernetes.request_timeout a request) is alive, not hung."""

    def __init__(self, api: Any, ping: Callable[[], None]) -> None:
        self._api = api
        self._ping = ping

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._api, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self._ping()
            return value(*args, **kwargs)
        return call


class Daemon:
    def __init__(self, host: Host, config: AgentConfig, notifier: notify.Notifier, *,
                 clock: Callable[[], float] = time.monotonic, wait: Wait = poll_wait,
                 api_factory: Callable[[], Any] | None = None, wake_fd: int | None = None,
                 use_udev: bool = True, tick: float = TICK_SECONDS,
                 run: Callable[..., Any] = once.run) -> None:
        self.host, self.config, self.notifier = host, config, notifier
        self.clock, self.wait, self.wake_fd, self.tick = clock, wait, wake_fd, tick
        self.use_udev = use_udev
        self._run = run
        self._api_factory = api_factory
        self.unsent = Unsent(clock)
        self.stopping = False
        self.backlog: list[str] = []  # records of a pass that failed, tried again first
        self.records = 0
        self.passes = 0
        self._next_ping = math.inf
        self._pass_error: str | None = None
        self._metrics_due = False  # a pass ran since the metrics file was written
        self._metrics_at = -math.inf

    def request_stop(self, *_: Any) -> None:
        self.stopping = True

    def run(self) -> int:
        stream = kmsg.RecordStream(self.host, once.KMSG)
        monitor = self._udev_monitor() if self.use_udev else None
        interval = self.notifier.watchdog_interval
        try:
            self._next_ping = self.clock() + interval if interval else math.inf
            self._catch_up(stream)
            self.notifier.ready(self._status())
            log.get().info("watch.started", kmsg=self.host.display(once.KMSG),
                           kmsg_kind=stream.kind, records=self.records, udev=monitor is not None,
                           tick_s=self.tick, watchdog_s=interval)
            next_tick = self.clock() + self.tick
            while not self.stopping:
                if self._metrics_due and not (stream.more or self.backlog):
                    self._write_metrics(stream)
                fds = [fd for fd in (None if self.backlog else stream.fileno(),
                                     monitor.fileno() if monitor is not None else None,
                                     self.wake_fd) if fd is not None]
                deadline = min(next_tick, self._next_ping,
                               self.unsent.retry_at if self.unsent.waiting else math.inf)
                if stream.more and not self.backlog:  # a batch is waiting already
                    deadline = 0.0
                ready = self.wait(fds, max(0.0, deadline - self.clock()))
                if self.wake_fd is not None and self.wake_fd in ready:
                    _drain(self.wake_fd)
                if self.stopping:
                    break
                now = self.clock()
                tick_due = now >= next_tick
                gpus_changed = monitor is not None and monitor.fileno() in ready \
                    and _nvidia_events(monitor)
                if self.backlog:  # a failed pass's records: again at the periodic check
                    records, due = self.backlog, tick_due
                else:
                    records = stream.read() if (stream.fileno() in ready or stream.more or (
                        stream.kind == "file" and tick_due)) else []
                    retry_due = self.unsent.waiting and now >= self.unsent.retry_at
                    due = bool(records) or gpus_changed or tick_due or retry_due
                if due:
                    self._pass(records)
                if tick_due:
                    next_tick = now + self.tick
                self.ping()
            self.notifier.stopping("stopping")
            log.get().info("watch.stopped", records=self.records, passes=self.passes)
            return 0
        finally:
            stream.close()

    def ping(self) -> None:
        """WATCHDOG=1 when half of WATCHDOG_USEC has passed since the last one."""
        now = self.clock()
        if now >= self._next_ping:
            self.notifier.watchdog()
            interval = self.notifier.watchdog_interval
            self._next_ping = now + interval if interval else math.inf

    def _catch_up(self, stream: kmsg.RecordStream) -> None:
        """What the ring buffer holds now, a batch a pass, before READY=1."""
        while True:
            records = stream.read()
            self._pass(records)
            self.ping()
            if not stream.more or self.backlog:
                return

    def _write_metrics(self, stream: kmsg.RecordStream) -> None:
        """The metrics file, after a pass; while kernel records already wait they are read
        and reported first (a burst of Xids gets its PATCHes before any file is written), but
        the file is never older than one periodic check."""
        fd = stream.fileno()
        if fd is not None and self.clock() - self._metrics_at < self.tick \
                and poll_wait([fd], 0):
            return
        from gpunode.metrics import textfile

        textfile.write(self.host, self.config)
        self._metrics_due, self._metrics_at = False, self.clock()

    def _pass(self, records: list[str]) -> None:
        try:
            self._run(self.host, self.config, False, self._api, kmsg=records,
                      unsent=self.unsent, metrics=False)
        except GpunodeError as exc:
            self.backlog = records  # bounded: one batch; the kernel keeps the rest meanwhile
            said = f"{exc.code}: {exc}"
            if said != self._pass_error:
                self._pass_error = said
                log.get().error("watch.pass_failed", exc=exc, retry_in_s=self.tick,
                                note="tried again at the next periodic check; said once")
            self.notifier.status(self._status())
            return
        if self.backlog or self._pass_error:
            self._pass_error = None
        self.backlog = []
        self.records += len(records)
        self.passes += 1
        self._metrics_due = True
        self.notifier.status(self._status())

    def _api(self) -> Any:
        if self._api_factory is not None:
            return _Keepalive(self._api_factory(), self.ping)
        from gpunode.kube.client import NodeApi, read_kubeconfig

        k = self.config.kubernetes
        return _Keepalive(NodeApi(read_kubeconfig(self.host, k.kubeconfig), k.request_timeout),
                          self.ping)

    def _status(self) -> str:
        words = f"{self.records} kmsg records read, {self.passes} passes"
        if self._pass_error is not None:
            words += f"; the last pass failed ({self._pass_error})"
        if self.unsent.error is not None:
            wait = max(0.0, self.unsent.retry_at - self.clock())
            words += (f"; API server: {self.unsent.error.code}, trying again in {wait:.0f} s"
                      if self.unsent.waiting else f"; API server: {self.unsent.error.code}")
        return words

    def _udev_monitor(self) -> Any:
        """udev's monitor of PCI devices, or None (said once: the periodic check stands in)."""
        reason = None
        if not self.host.is_live:
            reason = "under --root the root's devices send no udev events"
        elif self.config.detect.use_udev is False:  # "auto" (None) tries udev
            reason = "the agent config reads devices from sysfs (detect.source)"
        else:
            try:
                import pyudev

                monitor = pyudev.Monitor.from_netlink(pyudev.Context())
                monitor.filter_by("pci")
                monitor.start()
                return monitor
            except (ImportError, OSError, ValueError) as exc:  # no libudev, no netlink socket
                reason = f"no udev monitor ({exc})"
        log.get().info("watch.udev_unavailable", reason=reason,
                       note=f"a GPU that goes is found by the periodic check, every "
                       f"{self.tick:g} s")
        return None


def _nvidia_events(monitor: Any) -> bool:
    """Whether the events waiting on udev's monitor include an NVIDIA PCI function coming or
    going (the kernel's PCI_ID property, which a removed device still carries)."""
    changed = False
    while True:
        device = monitor.poll(timeout=0)
        if device is None:
            return changed
        pci_id = str(device.properties.get("PCI_ID", "")).upper()
        if pci_id.startswith(NVIDIA_PCI_ID) and device.action in UDEV_ACTIONS:
            log.get().info("watch.udev_event", action=device.action, address=device.sys_name)
            changed = True


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def command(host: Host, config: AgentConfig, dry_run: bool) -> int:
    """`gpunode watch` without --once: runs until SIGTERM or SIGINT, then exits 0."""
    if dry_run:
        raise UsageError("gpunode watch --dry-run needs --once: the daemon reports what it "
                         "finds, and a dry run has nothing to remember between passes",
                         "run 'gpunode watch --once --dry-run' to see what would be reported")
    notifier = notify.Notifier()
    notify.forget_environment()
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    daemon = Daemon(host, config, notifier, wake_fd=read_end)
    previous = {s: signal.signal(s, daemon.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    old_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    try:
        return daemon.run()
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for number, handler in previous.items():
            signal.signal(number, handler)
        os.close(read_end)
        os.close(write_end)
        notifier.close()
