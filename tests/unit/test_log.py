"""Logging: JSON lines for journald, structlog's console text for people, one event per step."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest

from gpunode import log
from gpunode.errors import HostError


@pytest.fixture(autouse=True)
def _restore_default_logger() -> Iterator[None]:
    yield
    log.configure("json")


def test_json_mode_writes_one_object_per_line() -> None:
    out = io.StringIO()
    log.configure("json", stream=out)
    log.get().info("detect.done", gpus=8)
    log.get().debug("hidden")
    (event,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert event["event"] == "detect.done"
    assert (event["gpus"], event["level"]) == (8, "info")
    assert event["timestamp"].endswith("Z")


def test_debug_level_lets_debug_events_through() -> None:
    out = io.StringIO()
    log.configure("json", level="debug", stream=out)
    log.get().debug("shown")
    assert json.loads(out.getvalue())["event"] == "shown"


def test_format_defaults_to_json_when_not_a_terminal() -> None:
    out = io.StringIO()
    log.configure(None, stream=out)
    log.get().info("x")
    assert json.loads(out.getvalue())["event"] == "x"


def test_console_mode_renders_readable_text_through_structlog() -> None:
    out = io.StringIO()
    log.configure("console", stream=out)
    log.get().info("step.done", step="detect", duration_ms=1.5)
    text = out.getvalue()
    assert "step.done" in text
    assert "step=detect" in text
    assert not text.lstrip().startswith("{")


def test_step_logs_its_duration_and_extra_fields() -> None:
    out = io.StringIO()
    log.configure("json", stream=out)
    with log.step("detect") as fields:
        fields["gpus"] = 1
    event = json.loads(out.getvalue())
    assert (event["event"], event["step"], event["gpus"]) == ("step.done", "detect", 1)
    assert event["duration_ms"] >= 0


def test_failed_step_logs_the_error_once_and_reraises() -> None:
    out = io.StringIO()
    log.configure("json", stream=out)
    with pytest.raises(HostError) as info, log.step("driver"):
        raise HostError("read", "/proc/modules", "Permission denied")
    (event,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert event["event"] == "step.failed"
    assert event["error"] == "Failed to read '/proc/modules': Permission denied"
    assert event["error_type"] == "HostError"
    assert log.LOGGED in info.value.__notes__
