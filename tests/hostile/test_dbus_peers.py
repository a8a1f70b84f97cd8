"""gpunode's D-Bus client (gpunode/dbus.py) against peers that misbehave: each gets one clear
error of the right kind — BusUnreachable (nobody sane to ask: status says "unknown", boot goes
on) or BusError (a refusal, a peer that does not answer in time) — never a traceback, a hang or
an allocation the size a peer claims. The well-behaved peer is a real systemd
(tests/integration/test_dbus_systemd.py); these are sockets served by a thread."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpunode import dbus
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


def _handshake_and_call(conn: socket.socket) -> None:
    """Answer the authentication with OK, then read the client's one method call whole (so
    closing afterwards is a clean end of stream, not a reset)."""
    data = _until_begin(conn)
    if data is None:
        return
    conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
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
    threads: list[threading.Thread] = []
    servers: list[socket.socket] = []

    def start(serve: Serve) -> str:
        path = str(tmp_path / f"bus{len(servers)}")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        servers.append(server)

        def run() -> None:
            conn, _ = server.accept()
            with conn:
                serve(conn)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        return path

    yield start
    for server in servers:
        server.close()
    for thread in threads:
        thread.join(timeout=5)


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


def read(path: str) -> object:
    return dbus._open(path, None).get_property("/org/freedesktop/systemd1/unit/x", "I", "P")


def test_a_well_formed_reply_in_either_byte_order(peer: Callable[[Serve], str]) -> None:
    assert read(peer(answering(message(2, 1, "v", variant_string("active"))))) == "active"
    big = message(2, 1, "v", variant_string("active", ">"), order=">")
    assert read(peer(answering(big))) == "active"


def test_the_server_s_data_challenge_is_answered(peer: Callable[[Serve], str]) -> None:
    """sd-bus and dbus-daemon answer an EXTERNAL without initial response with DATA first."""

    def serve(conn: socket.socket) -> None:
        conn.sendall(b"DATA\r\n")
        answering(message(2, 1, "v", variant_string("active")))(conn)

    assert read(peer(serve)) == "active"


def test_a_signal_before_the_reply_is_skipped(peer: Callable[[Serve], str]) -> None:
    signal = message(4, 0, "s", _string(b":1.1"))
    assert read(peer(answering(signal, message(2, 1, "v", variant_string("ok"))))) == "ok"


@pytest.mark.parametrize(("serve", "kind", "words"), [
    (answering_auth(b"REJECTED EXTERNAL\r\n"), dbus.BusUnreachable,
     "refused gpunode's authentication (REJECTED EXTERNAL)"),
    (answering_auth(b"x" * 5000), dbus.BusUnreachable,
     "no authentication answer in the first 4096 bytes"),
    # a peer that hangs up at once: "no answer", or a reset, as the race falls; the path either way
    (lambda conn: None, dbus.BusUnreachable, "/bus0: "),
    (answering(b"HTTP/1.1 400 Bad Request\r\n\r\n"), dbus.BusUnreachable,
     "not a D-Bus message"),
    (answering(), dbus.BusUnreachable, "closed the connection"),
    (answering(b"l\2\0\1" + struct.pack("<III", 0xFFFFFFF0, 1, 0xFFFFFFF0)),
     dbus.BusUnreachable, "size limit"),
    (answering(message(2, 1, "v", b"\1s\0\0" + struct.pack("<I", 1000) + b"short\0")),
     dbus.BusUnreachable, "malformed"),
    (answering(message(2, 1, "v", b"\2ss\0" + _string(b"a") + _string(b"b"))),
     dbus.BusUnreachable, "malformed"),
    (answering(message(2, 1, "v", b"\1s\0\0" + _string(b"\xff\xfe"))),
     dbus.BusUnreachable, "malformed"),
    (answering(message(2, 1, "q", b"\0")), dbus.BusUnreachable, "malformed"),
    (answering(message(3, 1, "s", _string(b"Access denied"),
                       error="org.freedesktop.DBus.Error.AccessDenied")),
     dbus.BusError, "Access denied"),
    (answering(message(3, 1, "s", _string(b"gone"),
                       error="org.freedesktop.DBus.Error.ServiceUnknown")),
     dbus.BusUnreachable, "gone"),
], ids=["auth-rejected", "auth-endless-line", "auth-silence", "garbage", "hang-up",
        "huge-claim", "short-string", "two-in-a-variant", "not-utf8", "truncated", "refused",
        "service-unknown"])
def test_a_misbehaving_peer_is_one_clear_error(peer: Callable[[Serve], str], serve: Serve,
                                                kind: type[Exception], words: str) -> None:
    with pytest.raises(kind) as caught:
        read(peer(serve))
    assert type(caught.value) is kind
    assert words in str(caught.value)


def test_a_silent_peer_is_a_timeout_not_a_hang(peer: Callable[[Serve], str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dbus, "TIMEOUT_SECONDS", 0.3)
    connection = dbus._open(peer(answering(then_wait=True)), None)
    with pytest.raises(dbus.BusError) as caught:
        connection.get_property("/org/freedesktop/systemd1/unit/x", "I", "P")
    connection.close()
    assert type(caught.value) is dbus.BusError
    assert "did not answer within 0.3 s" in str(caught.value)


@pytest.mark.parametrize("make", ["missing", "file", "fifo", "listening-nobody"])
def test_a_socket_path_that_is_no_bus_is_unreachable(tmp_path: Path, make: str) -> None:
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
    with pytest.raises(dbus.BusUnreachable) as caught:
        dbus._open(str(path), None)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(("address", "expected"), [
    ("unix:path=/run/x%2dy/bus", "/run/x-y/bus"),
    ("tcp:host=a,port=1;unix:path=/run/bus", "/run/bus"),
    ("", dbus.SYSTEM_BUS_SOCKET),
])
def test_the_system_bus_address(monkeypatch: pytest.MonkeyPatch, address: str,
                                expected: str) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", address)
    assert dbus._system_bus_path() == expected


@pytest.mark.parametrize("address", ["tcp:host=a,port=1", "unix:abstract=x", "garbage"])
def test_an_address_without_a_socket_path_is_unreachable(monkeypatch: pytest.MonkeyPatch,
                                                         address: str) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", address)
    with pytest.raises(dbus.BusUnreachable, match="names no unix:path= socket"):
        dbus._system_bus_path()


def test_the_adapter_says_unknown_and_warns_once(peer: Callable[[Serve], str],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """What status and boot make of a peer that is no systemd: state unknown, nothing asked
    again, one warning; a refusal is a SystemdError naming the unit."""
    path = peer(answering(b"garbage that is no message"))
    monkeypatch.setattr(dbus, "connect_systemd", lambda: dbus._open(path, None))
    monkeypatch.setattr(systemd.DbusSystemd, "warned", False)
    from gpunode import log

    log.configure("json")
    manager = systemd.DbusSystemd()
    assert manager.active_state("containerd.service") == systemd.UNKNOWN
    assert manager.exec_start("containerd.service") is None
    assert not manager.available and "not a D-Bus message" in str(manager.unavailable_reason)
    with pytest.raises(Unavailable):
        manager.restart("containerd.service", 1)
    assert capsys.readouterr().err.count("systemd.unavailable") == 1

    refusing = peer(answering(message(3, 1, "s", _string(b"Unit x.service not loaded."),
                                      error="org.freedesktop.systemd1.NoSuchUnit")))
    monkeypatch.setattr(dbus, "connect_systemd", lambda: dbus._open(refusing, None))
    with pytest.raises(SystemdError) as caught:
        systemd.DbusSystemd().main_process("x.service")
    assert type(caught.value) is SystemdError
    assert "x.service" in str(caught.value) and "not loaded" in str(caught.value)


def test_after_a_timeout_the_adapter_asks_on_a_new_connection(
        peer: Callable[[Serve], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply that comes late must not be read as the next call's: the connection that
    timed out is dropped."""
    monkeypatch.setattr(dbus, "TIMEOUT_SECONDS", 0.3)
    paths = iter([peer(answering(then_wait=True)),
                  peer(answering(message(2, 1, "v", variant_string("active"))))])
    monkeypatch.setattr(dbus, "connect_systemd", lambda: dbus._open(next(paths), None))
    manager = systemd.DbusSystemd()
    with pytest.raises(SystemdError, match=r"did not answer within 0\.3 s"):
        manager.main_process("containerd.service")
    assert manager.active_state("containerd.service") == "active"
    assert manager.available


def conversation(seen: list[str], *replies: Callable[[int], bytes] | None) -> Serve:
    """A peer that authenticates, then answers each call it reads with the next reply (made
    for the call's serial; None: hang up instead), recording the member names it was asked
    for."""

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            data = _until_begin(conn)
            if data is None:
                return
            conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
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
                seen.append(member.decode())
                data = data[end:]
                if reply is None:
                    return
                conn.sendall(reply(serial))

    return serve


def test_a_restart_is_sent_once_on_a_new_connection(peer: Callable[[Serve], str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Not on the connection kept from the reads before it, where a drop after the request
    went out would have it sent twice (once more on reconnecting)."""
    first: list[str] = []
    second: list[str] = []
    state = lambda text: lambda serial: message(2, serial, "v", variant_string(text))  # noqa: E731
    job = lambda serial: message(2, serial, "v", b"\x04(uo)\x00" + b"\x00" * 2  # noqa: E731
                                 + struct.pack("<I", 0) + _string(b"/"))
    paths = iter([peer(conversation(first, state("loaded"), None)),
                  peer(conversation(second, lambda serial: message(2, serial, "o", _string(
                      b"/org/freedesktop/systemd1/job/7")), job, state("active")))])
    monkeypatch.setattr(dbus, "connect_systemd", lambda: dbus._open(next(paths), None))
    manager = systemd.DbusSystemd()
    assert manager._unit_state("containerd.service", "LoadState") == "loaded"
    manager.restart("containerd.service", 5)
    assert first == ["Get"]
    assert second == ["Restart", "Get", "Get"]


@pytest.mark.parametrize(("signature", "body"), [
    ("a()", struct.pack("<I", 8) + b"\0" * 12),
    ("a{}", struct.pack("<I", 8) + b"\0" * 12),
    ("a{ass}", struct.pack("<I", 16) + b"\0" * 4 + struct.pack("<I", 0) + b"\0" * 4
     + _string(b"v")),
    ("a{vs}", struct.pack("<I", 16) + b"\0" * 4 + b"\x02as\x00" + struct.pack("<I", 0)
     + _string(b"v")),
])
def test_a_signature_dbus_does_not_allow_is_malformed(peer: Callable[[Serve], str],
                                                      signature: str, body: bytes) -> None:
    """Empty structs and dict entries (whose elements would take no bytes: an endless
    array), and a dict entry whose key is not a basic type (not hashable)."""
    with pytest.raises(dbus.BusUnreachable, match="malformed"):
        dbus._open(peer(answering(message(2, 1, signature, body))), None).call("/", "I", "M")


def test_a_peer_that_drips_its_answer_times_out_on_the_whole_call(
        peer: Callable[[Serve], str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dbus, "TIMEOUT_SECONDS", 0.5)

    def drip(conn: socket.socket) -> None:
        _handshake_and_call(conn)
        with contextlib.suppress(OSError):
            for byte in message(2, 1, "s", _string(b"x" * 200)):
                conn.sendall(bytes([byte]))
                time.sleep(0.05)

    connection = dbus._open(peer(drip), None)
    with pytest.raises(dbus.BusError, match=r"did not answer within 0\.5 s"):
        connection.call("/", "I", "M")
    connection.close()


def test_an_address_with_broken_escapes_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    for address in ("unix:path=/run/%zz", "unix:path=/run/%4", "unix:path=/run/%ff"):
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", address)
        with pytest.raises(dbus.BusUnreachable, match="escapes are not valid"):
            dbus._system_bus_path()
