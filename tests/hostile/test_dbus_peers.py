"""gpunode's systemd adapter (gpunode/platform/systemd.py, pystemd's sd-bus underneath) against
peers that misbehave: each gets one clear outcome of the right kind — nobody sane to ask
(Unavailable: status says "unknown", boot goes on) or a refusal or a peer that does not answer
in time (SystemdError naming the unit) — never a traceback, a hang or an allocation the size a
peer claims. The well-behaved peer is a real systemd (tests/integration/test_dbus_systemd.py);
these are sockets served by a child process, spoken to as systemd's private socket is (no
Hello).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpunode.errors import SystemdError, Unavailable
from gpunode.platform import systemd

pytestmark = pytest.mark.integration  # sockets

Serve = Callable[[socket.socket], None]


def _string(data: bytes, order: str = "<") -> bytes:
    return struct.pack(order + "I", len(data)) + data + b"\0"


def message(kind: int, reply_to: int, signature: str, body: bytes, order: str = "<",
            error: str | None = None) -> bytes:
    """A message as a peer sends it: REPLY_SERIAL, SIGNATURE (and ERROR_NAME) fields."""
    fields = struct.pack("BB", 5, 1) + b"u\0" + struct.pack(order + "I", reply_to)
    if signature:
        fields += b"\0" * (-len(fields) % 8) + struct.pack("BB", 8, 1) + b"g\0" + \
            struct.pack("B", len(signature)) + signature.encode() + b"\0"
    if error:
        fields += b"\0" * (-len(fields) % 8) + struct.pack("BB", 4, 1) + b"s\0" + \
            _string(error.encode(), order)
    head = (b"l" if order == "<" else b"B") + struct.pack(order + "BBBIII", kind, 0, 1,
                                                          len(body), 99, len(fields)) + fields
    return head + b"\0" * (-len(head) % 8) + body


def variant_string(text: str, order: str = "<") -> bytes:
    return b"\1s\0\0" + _string(text.encode(), order)


def _until_begin(conn: socket.socket) -> bytes | None:
    """Read the client's authentication up to its BEGIN: what came after it (None: the
    client hung up first)."""
    conn.settimeout(5)
    data = b""
    while b"BEGIN\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return None
        data += chunk
    return data.split(b"BEGIN\r\n", 1)[1]


# What a server answers to sd-bus's "AUTH EXTERNAL" (no initial response), "DATA" (empty),
# "NEGOTIATE_UNIX_FD" and "BEGIN", which sd-bus sends together before any answer.
ACCEPTED = b"DATA\r\nOK 0123456789abcdef0123456789abcdef\r\nAGREE_UNIX_FD\r\n"


def _handshake_and_call(conn: socket.socket) -> None:
    """Accept the authentication, then read the client's one method call whole (so closing
    afterwards is a clean end of stream, not a reset)."""
    data = _until_begin(conn)
    if data is None:
        return
    conn.sendall(ACCEPTED)
    while len(data) < 16 or len(data) < _message_end(data):
        chunk = conn.recv(4096)
        if not chunk:
            return
        data += chunk


def _message_end(data: bytes) -> int:
    """Where the message that starts `data` (at least its 16 fixed bytes) ends."""
    body, _, fields = struct.unpack("<III", data[4:16])
    return 16 + fields + (-(16 + fields) % 8) + body


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[Callable[[Serve], str]]:
    """Start a peer: `serve(conn)` on the one connection it accepts, in a child process
    (pystemd holds the GIL while sd-bus waits for an answer: a thread of this process would
    not run until the call gave up); the socket's path."""
    context = multiprocessing.get_context("fork")
    children: list[multiprocessing.process.BaseProcess] = []

    def start(serve: Serve) -> str:
        path = str(tmp_path / f"bus{len(children)}")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)

        def run() -> None:
            conn, _ = server.accept()
            with conn:
                serve(conn)

        child = context.Process(target=run, daemon=True)
        child.start()
        server.close()  # the child's now
        children.append(child)
        return path

    yield start
    for child in children:
        child.join(timeout=5)
        if child.is_alive():
            child.terminate()
            child.join()


def answering(*replies: bytes, then_wait: bool = False) -> Serve:
    def serve(conn: socket.socket) -> None:
        _handshake_and_call(conn)
        for reply in replies:
            conn.sendall(reply)
        if then_wait:  # until the client gives up and closes
            with contextlib.suppress(OSError):
                conn.recv(1)

    return serve


def answering_auth(reply: bytes) -> Serve:
    """A server that reads the client's authentication, answers `reply` and waits for the
    client to hang up (so the client reads the answer, not a reset)."""

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if _until_begin(conn) is None:
                return
            conn.sendall(reply)
            while conn.recv(4096):
                pass

    return serve


def adapter(path: str) -> systemd.DbusSystemd:
    return systemd.DbusSystemd(f"unix:path={path}", direct=True)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's adapter may say once that systemd is unavailable; sd-bus gives a call
    2 s here instead of 25 (a test that needs less sets less)."""
    monkeypatch.setattr(systemd.DbusSystemd, "warned", False)
    monkeypatch.setenv("SYSTEMD_BUS_TIMEOUT", "2")


def unavailable(path: str) -> str:
    """Why the adapter, asked for a unit's state by a peer, found nobody sane to ask."""
    manager = adapter(path)
    assert manager.active_state("containerd.service") == systemd.UNKNOWN
    assert not manager.available
    return str(manager.unavailable_reason)


def refused(path: str) -> SystemdError:
    with pytest.raises(SystemdError) as caught:
        adapter(path).active_state("containerd.service")
    assert type(caught.value) is SystemdError  # not Unavailable: somebody refused
    return caught.value


def test_a_well_formed_reply_in_either_byte_order(peer: Callable[[Serve], str]) -> None:
    little = message(2, 1, "v", variant_string("active"))
    assert adapter(peer(answering(little))).active_state("x.service") == "active"
    big = message(2, 1, "v", variant_string("active", ">"), order=">")
    assert adapter(peer(answering(big))).active_state("x.service") == "active"


def test_a_signal_before_the_reply_is_skipped(peer: Callable[[Serve], str]) -> None:
    signal = message(4, 0, "s", _string(b":1.1"))
    reply = message(2, 1, "v", variant_string("ok"))
    assert adapter(peer(answering(signal, reply))).active_state("x.service") == "ok"


@pytest.mark.parametrize("serve", [
    answering_auth(b"REJECTED EXTERNAL\r\n"),
    answering_auth(b"x" * 70000),
    lambda conn: None,  # hangs up at once
    answering(b"HTTP/1.1 400 Bad Request\r\n\r\n"),
    answering(),  # hangs up after the call
    answering(b"l\2\0\1" + struct.pack("<III", 0xFFFFFFF0, 1, 0xFFFFFFF0)),
    answering(message(2, 1, "v", b"\1s\0\0" + struct.pack("<I", 1000) + b"short\0")),
    answering(message(2, 1, "v", b"\2ss\0" + _string(b"a") + _string(b"b"))),
    answering(message(2, 1, "v", b"\1s\0\0" + _string(b"\xff\xfe"))),
    answering(message(2, 1, "q", b"\0")),
    answering(message(3, 1, "s", _string(b"gone"),
                      error="org.freedesktop.DBus.Error.ServiceUnknown")),
], ids=["auth-rejected", "auth-endless-line", "auth-silence", "garbage", "hang-up",
        "huge-claim", "short-string", "two-in-a-variant", "not-utf8", "truncated",
        "service-unknown"])
def test_a_peer_that_is_no_systemd_is_unavailable(peer: Callable[[Serve], str],
                                                  serve: Serve) -> None:
    """Nobody sane to ask: the state is "unknown", and the reason says what went wrong."""
    reason = unavailable(peer(serve))
    assert reason.startswith("no systemd on the system bus (unix:path=")


def test_a_refusal_is_a_systemd_error_with_the_peer_s_words(
        peer: Callable[[Serve], str]) -> None:
    error = refused(peer(answering(message(3, 1, "s", _string(b"Access denied"),
                                           error="org.freedesktop.DBus.Error.AccessDenied"))))
    assert str(error) == "Failed to read 'containerd.service': Access denied"


def test_a_silent_peer_is_a_timeout_not_a_hang(peer: Callable[[Serve], str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYSTEMD_BUS_TIMEOUT", "0.3")
    started = time.monotonic()
    error = refused(peer(answering(then_wait=True)))
    assert time.monotonic() - started < 2
    assert "systemd did not answer in time" in str(error)


@pytest.mark.parametrize("make", ["missing", "file", "fifo", "listening-nobody"])
def test_a_socket_path_that_is_no_bus_is_unavailable(tmp_path: Path, make: str) -> None:
    import os

    path = tmp_path / "bus"
    if make == "file":
        path.write_text("not a socket\n")
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "listening-nobody":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.close()  # bound, never listening: connection refused
    assert f"unix:path={path}" in unavailable(str(path))


@pytest.mark.parametrize("address", ["unix:path=PATH", "unix:path=PATH%2dbus"])
def test_the_system_bus_address_names_the_socket(
        peer: Callable[[Serve], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        address: str) -> None:
    """$DBUS_SYSTEM_BUS_ADDRESS, as sd-bus reads it (%-escapes undone), is where a non-root
    gpunode asks, or root where systemd's private socket is missing; the bus is said Hello
    first."""
    seen = tmp_path / "seen"
    path = peer(conversation(seen, lambda serial: message(2, serial, "s", _string(b":1.7")),
                             lambda serial: message(2, serial, "v", variant_string("active"))))
    if "%2d" in address:  # a socket path with a '-', escaped
        Path(path).rename(tmp_path / "the-bus")
        path = str(tmp_path / "the")
    monkeypatch.setattr(systemd, "PRIVATE_SOCKET", str(tmp_path / "no-private-socket"))
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", address.replace("PATH", path))
    assert systemd.DbusSystemd().active_state("x.service") == "active"
    assert seen.read_text().split() == ["Hello", "Get"]


@pytest.mark.parametrize("address", ["garbage", "unix:path=/run/%zz", "unix:path=/run/%4"])
def test_a_system_bus_address_that_names_no_socket_is_unavailable(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, address: str) -> None:
    monkeypatch.setattr(systemd, "PRIVATE_SOCKET", str(tmp_path / "no-private-socket"))
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", address)
    manager = systemd.DbusSystemd()
    assert manager.active_state("x.service") == systemd.UNKNOWN
    assert f"({address}:" in str(manager.unavailable_reason)


def test_the_adapter_says_unknown_and_warns_once(peer: Callable[[Serve], str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """What status and boot make of a peer that is no systemd: state unknown, nothing asked
    again, one warning; a refusal is a SystemdError naming the unit."""
    from gpunode import log

    log.configure("json")
    manager = adapter(peer(answering(b"garbage that is no message")))
    assert manager.active_state("containerd.service") == systemd.UNKNOWN
    assert manager.exec_start("containerd.service") is None
    assert not manager.available
    with pytest.raises(Unavailable):
        manager.restart("containerd.service", 1)
    assert capsys.readouterr().err.count("systemd.unavailable") == 1

    refusing = peer(answering(message(3, 1, "s", _string(b"Unit x.service not loaded."),
                                      error="org.freedesktop.systemd1.NoSuchUnit")))
    with pytest.raises(SystemdError) as caught:
        adapter(refusing).main_process("x.service")
    assert type(caught.value) is SystemdError
    assert "x.service" in str(caught.value) and "not loaded" in str(caught.value)


def test_after_a_timeout_the_adapter_asks_on_a_new_connection(
        peer: Callable[[Serve], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A reply that comes late must not be read as the next call's: the connection that
    timed out is dropped."""
    monkeypatch.setenv("SYSTEMD_BUS_TIMEOUT", "0.3")
    first = peer(answering(then_wait=True))
    second = peer(answering(message(2, 1, "v", variant_string("active"))))
    link = tmp_path / "systemd"  # the one address the adapter knows: first, then second
    link.symlink_to(first)
    manager = adapter(str(link))
    with pytest.raises(SystemdError, match="did not answer in time"):
        manager.main_process("containerd.service")
    link.unlink()
    link.symlink_to(second)
    assert manager.active_state("containerd.service") == "active"
    assert manager.available


def conversation(seen: Path, *replies: Callable[[int], bytes] | None) -> Serve:
    """A peer that authenticates, then answers each call it reads with the next reply (made
    for the call's serial; None: hang up instead), writing the member names it was asked
    for to `seen`, a line each."""

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            data = _until_begin(conn)
            if data is None:
                return
            conn.sendall(ACCEPTED)
            for reply in replies:
                while len(data) < 16 or len(data) < _message_end(data):
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                _, serial, fields = struct.unpack("<III", data[4:16])
                end = _message_end(data)
                header = data[16:16 + fields]
                member = header.split(b"\x03\x01s\x00", 1)[1][4:].split(b"\x00", 1)[0]
                with seen.open("a") as record:
                    record.write(member.decode() + "\n")
                data = data[end:]
                if reply is None:
                    return
                conn.sendall(reply(serial))

    return serve


def test_a_restart_is_sent_once_on_a_new_connection(peer: Callable[[Serve], str],
                                                    tmp_path: Path) -> None:
    """Not on the connection kept from the reads before it, where a drop after the request
    went out would have it sent twice (once more on reconnecting)."""
    first, second = tmp_path / "first", tmp_path / "second"
    state = lambda text: lambda serial: message(2, serial, "v", variant_string(text))  # noqa: E731
    job = lambda serial: message(2, serial, "v", b"\x04(uo)\x00" + b"\x00" * 2  # noqa: E731
                                 + struct.pack("<I", 0) + _string(b"/"))
    link = tmp_path / "systemd"
    link.symlink_to(peer(conversation(first, state("loaded"), None)))
    manager = adapter(str(link))
    assert manager.active_state("containerd.service") == "loaded"  # what the peer says
    link.unlink()
    link.symlink_to(peer(conversation(second, lambda serial: message(2, serial, "o", _string(
        b"/org/freedesktop/systemd1/job/7")), job, state("active"))))
    manager.restart("containerd.service", 5)
    assert first.read_text().split() == ["Get"]
    assert second.read_text().split() == ["Restart", "Get", "Get"]


@pytest.mark.parametrize(("signature", "body"), [
    ("a()", struct.pack("<I", 8) + b"\0" * 12),
    ("a{}", struct.pack("<I", 8) + b"\0" * 12),
    ("a{ass}", struct.pack("<I", 16) + b"\0" * 4 + struct.pack("<I", 0) + b"\0" * 4
     + _string(b"v")),
    ("a{vs}", struct.pack("<I", 16) + b"\0" * 4 + b"\x02as\x00" + struct.pack("<I", 0)
     + _string(b"v")),
])
def test_a_signature_dbus_does_not_allow_is_unavailable(peer: Callable[[Serve], str],
                                                        signature: str, body: bytes) -> None:
    """Empty structs and dict entries (whose elements would take no bytes: an endless
    array), and a dict entry whose key is not a basic type (not hashable)."""
    assert unavailable(peer(answering(message(2, 1, signature, body))))


def test_a_peer_that_drips_its_answer_times_out_on_the_whole_call(
        peer: Callable[[Serve], str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYSTEMD_BUS_TIMEOUT", "0.5")

    def drip(conn: socket.socket) -> None:
        _handshake_and_call(conn)
        with contextlib.suppress(OSError):
            for byte in message(2, 1, "v", variant_string("x" * 200)):
                conn.sendall(bytes([byte]))
                time.sleep(0.05)

    started = time.monotonic()
    assert "did not answer in time" in str(refused(peer(drip)))
    assert time.monotonic() - started < 3
