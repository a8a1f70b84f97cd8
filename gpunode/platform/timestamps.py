"""The one timestamp format of gpunode's records, log lines and Node conditions."""

from __future__ import annotations

import time

TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # RFC 3339 in UTC, to the second


def utc_timestamp(when: float | None = None) -> str:
    """`when` (seconds since the epoch; now when None) as every gpunode record, log line and
    Node condition writes it: 2026-11-29T08:00:00Z."""
    return time.strftime(TIMESTAMP_FORMAT, time.gmtime(when))
