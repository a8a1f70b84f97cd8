"""/dev/kmsg followed by the watch daemon: the records as the kernel hands them out, in
bounded batches, never blocking.

The kernel's interface (Documentation/ABI/testing/dev-kmsg): open() starts at the first record
still in the ring buffer, so the daemon sees what this boot logged before it started; every
read() returns exactly one record (8 KiB holds any: CONSOLE_EXT_LOG_MAX), fails with EPIPE when
the next record was overwritten meanwhile (the following read() returns the oldest one still
there), and with O_NONBLOCK with EAGAIN once none is left; poll() reports POLLIN when one is
there. The descriptor comes from Host.open_records (the --root boundary).

In /dev/kmsg's place a FIFO (the tests' stand-in) gives lines, not records: they are split
here, a line of more than MAX_LINE bytes cut. A writer that closes it leaves poll() reporting
POLLHUP for ever, so the stream opens the FIFO again: the new descriptor waits for the next
writer (Linux's pipe_poll reports a hang-up only after a writer came and went since the
open). A regular file (a saved log under --root) is read as it grows, on every tick.
"""

from __future__ import annotations

import errno
import os

from gpunode.errors import HostError
from gpunode.platform.host import Host

READ_SIZE = 8192  # one /dev/kmsg record at most (CONSOLE_EXT_LOG_MAX)
MAX_LINE = 8192  # of a FIFO's or a file's line
BATCH_RECORDS = 4096  # one batch is one pass of decide: memory stays bounded in a flood
BATCH_BYTES = 1 << 20


class RecordStream:
    """The records of `path`, read in batches: `read()` returns what is there now."""

    def __init__(self, host: Host, path: str) -> None:
        self.host = host
        self.path = path
        self.fd, self.kind = host.open_records(path)
        self.lost = 0  # records overwritten before they could be read
        self.more = False  # the last read() stopped at the batch limit: read again at once
        self._partial = b""
        self._queue: list[bytes] = []  # lines read but not handed out: one read's worth

    def fileno(self) -> int | None:
        """The descriptor to wait on; None for a regular file (read on every tick)."""
        return None if self.kind == "file" else self.fd

    def read(self) -> list[str]:
        try:
            return self._records() if self.kind == "device" else self._lines()
        except OSError as exc:
            raise HostError("read", self.host.display(self.path),
                            exc.strerror or str(exc)) from exc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _records(self) -> list[str]:
        records: list[str] = []
        total = 0
        self.more = False
        while True:
            if len(records) >= BATCH_RECORDS or total >= BATCH_BYTES:
                self.more = True
                return records
            try:
                data = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                return records
            except OSError as exc:
                if exc.errno != errno.EPIPE:
                    raise
                self.lost += 1  # overwritten: the next read() has the oldest one left
                continue
            if not data:
                return records
            total += len(data)
            records.append(data.decode(errors="replace"))

    def _lines(self) -> list[str]:
        total = 0
        while len(self._queue) < BATCH_RECORDS and total < BATCH_BYTES:
            try:
                data = os.read(self.fd, READ_SIZE * 8)
            except BlockingIOError:
                break
            if not data:
                if self._partial:  # a last line without its newline
                    self._queue.append(self._partial)
                    self._partial = b""
                if self.kind == "fifo":  # the writer closed it: wait for the next one
                    self._reopen()
                break
            total += len(data)
            parts = (self._partial + data).split(b"\n")
            self._partial = parts.pop()
            if len(self._partial) > MAX_LINE:
                parts.append(self._partial[:MAX_LINE])
                self._partial = b""
            self._queue.extend(p for p in parts if p)
        batch, self._queue = self._queue[:BATCH_RECORDS], self._queue[BATCH_RECORDS:]
        self.more = bool(self._queue) or total >= BATCH_BYTES
        return [line.decode(errors="replace") for line in batch]

    def _reopen(self) -> None:
        fd, kind = self.host.open_records(self.path)
        os.close(self.fd)
        self.fd, self.kind = fd, kind
