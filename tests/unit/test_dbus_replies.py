"""gpunode.dbus.Connection.get_properties: several Gets sent at once, each reply matched to its
call by serial whatever order the replies come in, a refusal kept for its caller. The bus is a
list of messages here (a unit test opens no socket); against a real systemd:
tests/integration/test_dbus_systemd.py."""

from __future__ import annotations

from typing import Any

import pytest

from gpunode import dbus

_RETURN, _ERROR = 2, 3
_ERROR_NAME, _REPLY_SERIAL, _SIGNATURE = 4, 5, 8


def string_body(text: str) -> bytes:
    """A variant holding a string, as a Properties.Get reply's body ("v")."""
    encoded = text.encode()
    return b"\x01s\x00\x00" + len(encoded).to_bytes(4, "little") + encoded + b"\x00"


class Replying(dbus.Connection):
    """Sends nowhere; answers with the messages given, in their order."""

    def __init__(self, replies: list[tuple[int, int, str]]) -> None:
        super().__init__(None, None)  # type: ignore[arg-type]  # no socket: nothing is sent
        self.sent: list[bytes] = []
        self.replies = replies  # (kind, reply serial, text)

    def _send(self, data: bytes) -> None:
        self.sent.append(data)

    def _message(self) -> tuple[int, dict[int, Any], bytes, str]:
        if not self.replies:
            raise dbus.BusError("no answer in time")
        kind, serial, text = self.replies.pop(0)
        if kind == _ERROR:
            fields = {_REPLY_SERIAL: serial, _ERROR_NAME: "org.freedesktop.DBus.Error.Unknown",
                      _SIGNATURE: "s"}
            encoded = text.encode()
            return kind, fields, len(encoded).to_bytes(4, "little") + encoded + b"\x00", "<"
        return kind, {_REPLY_SERIAL: serial, _SIGNATURE: "v"}, string_body(text), "<"


NAMES = [("org.freedesktop.systemd1.Unit", "LoadState"),
         ("org.freedesktop.systemd1.Service", "ExecStart"),
         ("org.freedesktop.systemd1.Service", "Environment")]


@pytest.mark.parametrize("order", [[1, 2, 3], [3, 1, 2], [2, 3, 1]])
def test_replies_are_matched_to_their_calls_in_any_order(order: list[int]) -> None:
    bus = Replying([(_RETURN, serial, f"value-{serial}") for serial in order])
    assert bus.get_properties("/u", NAMES) == ["value-1", "value-2", "value-3"]
    assert len(bus.sent) == 1  # all three calls in one write: one round trip


def test_a_refused_property_is_returned_and_the_others_answered() -> None:
    bus = Replying([(_RETURN, 1, "not-found"), (_ERROR, 2, "no such interface"),
                    (_RETURN, 3, "x")])
    load, refused, other = bus.get_properties("/u", NAMES)
    assert (load, other) == ("not-found", "x")
    assert isinstance(refused, dbus.BusError) and "no such interface" in str(refused)


def test_no_answer_in_time_is_raised_not_returned() -> None:
    bus = Replying([(_RETURN, 1, "loaded")])
    with pytest.raises(dbus.BusError, match="no answer in time"):
        bus.get_properties("/u", NAMES)


def test_an_answer_to_an_earlier_call_is_passed_over() -> None:
    bus = Replying([(_RETURN, 1, "stale")])
    assert bus.call("/u", "i", "m") == ["stale"]  # serial 1
    bus.replies = [(_RETURN, 1, "late"), (_RETURN, 2, "a"), (_RETURN, 3, "b"), (_RETURN, 4, "c")]
    assert bus.get_properties("/u", NAMES) == ["a", "b", "c"]
