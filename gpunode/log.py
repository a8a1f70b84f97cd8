"""Logging: one structured event per step, JSON lines for journald, readable text on a TTY.

Events are dicts shaped by processors with structlog's signature (logger, method, event_dict).
On a TTY they run inside structlog and its ConsoleRenderer. In JSON mode (journald, i.e. every
boot) the same processors run in a ten-line chain here and json.dumps renders them: structlog
imports asyncio and ssl, which a boot has no other use for.
Logs go to stderr; stdout is for the command's own output (tables, --json documents).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TextIO

from gpunode.errors import GpunodeError
from gpunode.platform import timestamps

EventDict = MutableMapping[str, Any]
Processor = Callable[[Any, str, EventDict], EventDict]

LOGGED = "gpunode: already logged"

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def add_timestamp(_logger: Any, _method: str, event: EventDict) -> EventDict:
    event["timestamp"] = timestamps.utc_timestamp()
    return event


def add_level(_logger: Any, method: str, event: EventDict) -> EventDict:
    event["level"] = method
    return event


def render_errors(_logger: Any, _method: str, event: EventDict) -> EventDict:
    """An exception becomes its message, type and stable code: the step, not the traceback, is
    the story."""
    error = event.pop("exc", None)
    if isinstance(error, BaseException):
        event["error"] = str(error)
        event["error_type"] = type(error).__name__
        if isinstance(error, GpunodeError):
            event["error_code"] = error.code
            if error.hint:
                event.setdefault("hint", error.hint)
    return event


PROCESSORS: tuple[Processor, ...] = (add_level, add_timestamp, render_errors)


class Logger:
    """The only logger gpunode code talks to: `log.info("event", key=value)`."""

    def __init__(self, emit: Callable[[str, EventDict], None], min_level: int) -> None:
        self._emit = emit
        self._min = min_level

    def _log(self, method: str, event: str, fields: dict[str, Any]) -> None:
        if LEVELS[method] >= self._min:
            self._emit(method, {"event": event, **fields})

    def debug(self, event: str, **fields: Any) -> None:
        self._log("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log("error", event, fields)


def _json_emitter(stream: TextIO | None) -> Callable[[str, EventDict], None]:
    def emit(method: str, event: EventDict) -> None:
        for processor in PROCESSORS:
            event = processor(None, method, event)
        out = stream or sys.stderr  # looked up per event: sys.stderr may be replaced (tests)
        out.write(json.dumps(dict(event), default=str, separators=(",", ":")) + "\n")
        out.flush()

    return emit


def _console_emitter(stream: TextIO, colors: bool) -> Callable[[str, EventDict], None]:
    import structlog  # only an interactive terminal pays for it

    structlog.configure(
        processors=[*PROCESSORS, structlog.dev.ConsoleRenderer(colors=colors)],
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    bound = structlog.get_logger()

    def emit(method: str, event: EventDict) -> None:
        name = event.pop("event")
        getattr(bound, method)(name, **event)

    return emit


_logger = Logger(_json_emitter(None), LEVELS["info"])


FORMATS = ("console", "json")


def configure(log_format: str | None, level: str = "info", stream: TextIO | None = None) -> None:
    """`log_format` None picks console on a TTY, JSON otherwise (so journald gets JSON lines)."""
    global _logger
    tty = (stream or sys.stderr).isatty()
    chosen = log_format or ("console" if tty else "json")
    if chosen == "console":
        emit = _console_emitter(stream or sys.stderr, colors=tty)
    else:
        emit = _json_emitter(stream)
    _logger = Logger(emit, LEVELS[level])


def get() -> Logger:
    return _logger


@contextmanager
def step(name: str, **fields: Any) -> Iterator[dict[str, Any]]:
    """Log one event when a step ends, with its duration; the caller may add fields to it."""
    extra: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        yield extra
    except Exception as exc:
        get().error("step.failed", step=name, duration_ms=_ms_since(start), exc=exc,
                    **fields, **extra)
        if isinstance(exc, GpunodeError):  # main() turns it into an exit code, not a 2nd report
            exc.add_note(LOGGED)
        raise
    get().info("step.done", step=name, duration_ms=_ms_since(start), **fields, **extra)


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)
