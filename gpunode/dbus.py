"""A small D-Bus client: method calls to systemd and their replies, nothing else.

gpunode asks systemd for a few unit properties and, rarely, a reload or a restart. pystemd
(the binding gpunode used before) costs ~20 ms to import (it parses every unit's introspection
XML with lxml) and ~5 ms a unit; on the boot path, which every GPU node waits for, that was a
fifth of gpunode's time. This module speaks the wire protocol (the D-Bus specification,
"Message Protocol") for exactly what gpunode sends: method calls whose arguments are strings,
and replies of any type.

Where it connects: as root, systemd's own private socket /run/systemd/private (what systemctl
uses as root: no dbus-daemon in between, which early in a boot may not be running yet); else,
or where that socket is missing, the system bus ($DBUS_SYSTEM_BUS_ADDRESS, unix:path=… only,
else /run/dbus/system_bus_socket) with its Hello. Authentication is EXTERNAL (the kernel
tells the peer who connects), as sd-bus's own client does it.

Errors: `BusUnreachable` where nobody can be asked (no socket, refused, the peer hung up, no
systemd on the bus), `BusError` for a refusal (the D-Bus error name and message) or a peer that
did not answer in time.
"""

from __future__ import annotations

# socket's own C module, whose socket type has every method used here (connect, sendall,
# recv, settimeout, close): `import socket` adds selectors and four enum conversions of the
# module's constants, ~3.5 ms of the first boot's critical path, where gpunode asks systemd
# where containerd's config is.
import _socket
import os
import struct
import time
from typing import Any

PRIVATE_SOCKET = "/run/systemd/private"
SYSTEM_BUS_SOCKET = "/run/dbus/system_bus_socket"
BUS_NAME = "org.freedesktop.DBus"
TIMEOUT_SECONDS = 25.0  # sd-bus's default method call timeout
# D-Bus errors that mean nobody is there to answer, not a refusal by somebody who is.
UNREACHABLE_ERRORS = ("org.freedesktop.DBus.Error.ServiceUnknown",
                      "org.freedesktop.DBus.Error.NameHasNoOwner",
                      "org.freedesktop.DBus.Error.Disconnected",
                      "org.freedesktop.DBus.Error.NoServer")
MAX_MESSAGE = 128 * 1024 * 1024  # the specification's limit on a whole message

_METHOD_CALL, _METHOD_RETURN, _ERROR = 1, 2, 3
_PATH, _INTERFACE, _MEMBER, _ERROR_NAME, _REPLY_SERIAL, _DESTINATION, _SIGNATURE = (
    1, 2, 3, 4, 5, 6, 8)
_FIXED = {"y": ("B", 1), "b": ("I", 4), "n": ("h", 2), "q": ("H", 2), "i": ("i", 4),
          "u": ("I", 4), "x": ("q", 8), "t": ("Q", 8), "d": ("d", 8), "h": ("I", 4)}
_BASIC = "ybnqiuxtdhsog"  # the types a dict entry's key may be
_ALIGN = {**{code: size for code, (_, size) in _FIXED.items()},
          "s": 4, "o": 4, "g": 1, "a": 4, "(": 8, "{": 8, "v": 1}


class BusError(Exception):
    """The peer refused (its D-Bus error name and message), or did not answer in time."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class BusUnreachable(BusError):
    """Nobody to ask: no socket, a refused or closed connection, no systemd on the bus."""


class Connection:
    """One authenticated connection; method calls are answered in order (no signals asked)."""

    def __init__(self, sock: _socket.socket, destination: str | None) -> None:
        self._sock = sock
        self._destination = destination  # None on systemd's private (peer-to-peer) socket
        self._serial = 0
        self._buffer = bytearray()
        self._deadline = 0.0  # of the call being answered (time.monotonic)

    def call(self, path: str, interface: str, member: str, signature: str = "",
             args: tuple[str, ...] = (), destination: str | None = None) -> list[Any]:
        """The reply's values; `signature` is made of "s" only (all gpunode sends)."""
        if set(signature) - {"s"} or len(signature) != len(args):
            raise ValueError(f"unsupported call signature {signature!r} for {len(args)} args")
        self._serial += 1
        body = _strings(args)
        fields = [(_PATH, "o", path), (_INTERFACE, "s", interface), (_MEMBER, "s", member)]
        target = destination or self._destination
        if target is not None:
            fields.append((_DESTINATION, "s", target))
        if signature:
            fields.append((_SIGNATURE, "g", signature))
        self._deadline = time.monotonic() + TIMEOUT_SECONDS  # the whole call, not each read
        self._send(_header(self._serial, len(body), fields) + body)
        return self._reply(self._serial, f"{interface}.{member}")

    def get_property(self, path: str, interface: str, name: str) -> Any:
        """org.freedesktop.DBus.Properties.Get: the property's value."""
        (value,) = self.call(path, "org.freedesktop.DBus.Properties", "Get", "ss",
                             (interface, name))
        return value

    def close(self) -> None:
        self._sock.close()

    def _send(self, data: bytes) -> None:
        try:
            self._sock.settimeout(TIMEOUT_SECONDS)
            self._sock.sendall(data)
        except TimeoutError:
            raise BusError(f"the bus took no message within {TIMEOUT_SECONDS:g} s") from None
        except OSError as exc:
            raise BusUnreachable(f"the connection to the bus failed ({exc})") from None

    def _reply(self, serial: int, what: str) -> list[Any]:
        while True:
            kind, fields, body, order = self._message()
            if fields.get(_REPLY_SERIAL) != serial or kind not in (_METHOD_RETURN, _ERROR):
                continue  # a signal (NameAcquired after Hello)
            values = _parse(body, order, str(fields.get(_SIGNATURE, "")))
            if kind == _METHOD_RETURN:
                return values
            name = str(fields.get(_ERROR_NAME, ""))
            detail = values[0] if values and isinstance(values[0], str) else name
            error = BusUnreachable if name in UNREACHABLE_ERRORS else BusError
            raise error(f"{what}: {detail}", name)

    def _message(self) -> tuple[int, dict[int, Any], bytes, str]:
        start = self._read(16)
        if start[:1] not in (b"l", b"B"):
            raise BusUnreachable("the bus sent something that is not a D-Bus message")
        order = "<" if start[:1] == b"l" else ">"
        body_length, _, fields_length = struct.unpack(order + "III", start[4:16])
        if body_length + fields_length > MAX_MESSAGE:
            raise BusUnreachable("the bus sent a message over the D-Bus size limit")
        padded = fields_length + _pad(16 + fields_length, 8)
        rest = self._read(padded + body_length)
        (pairs,) = _parse(start + rest[:fields_length], order, "a(yv)", offset=12)
        return start[1], dict(pairs), rest[padded:], order

    def _read(self, size: int) -> bytes:
        while len(self._buffer) < size:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise BusError(f"systemd did not answer within {TIMEOUT_SECONDS:g} s")
            try:
                self._sock.settimeout(left)
                chunk = self._sock.recv(max(65536, size - len(self._buffer)))
            except TimeoutError:
                raise BusError(f"systemd did not answer within {TIMEOUT_SECONDS:g} s") \
                    from None
            except OSError as exc:
                raise BusUnreachable(f"the connection to the bus failed ({exc})") from None
            if not chunk:
                raise BusUnreachable("the bus closed the connection")
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data


def connect_systemd() -> Connection:
    """A connection to systemd (PID 1): its private socket as root, else the system bus."""
    if os.geteuid() == 0 and os.path.exists(PRIVATE_SOCKET):
        try:
            return _open(PRIVATE_SOCKET, None)
        except BusUnreachable:
            pass  # e.g. a systemd that no longer listens there: the system bus may still work
    return _open(_system_bus_path(), "org.freedesktop.systemd1", hello=True)


def _system_bus_path() -> str:
    address = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS", "")
    for entry in address.split(";"):
        transport, _, params = entry.partition(":")
        keys = dict(param.partition("=")[::2] for param in params.split(","))
        if transport == "unix" and keys.get("path"):
            try:
                return _unescape(keys["path"])
            except (ValueError, UnicodeDecodeError):
                raise BusUnreachable(f"DBUS_SYSTEM_BUS_ADDRESS={address!r}: the path's % "
                                     "escapes are not valid") from None
    if address:
        raise BusUnreachable(f"DBUS_SYSTEM_BUS_ADDRESS={address!r} names no unix:path= "
                             "socket (the one transport gpunode speaks)")
    return SYSTEM_BUS_SOCKET


def _open(path: str, destination: str | None, hello: bool = False) -> Connection:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    sock.settimeout(TIMEOUT_SECONDS)
    try:
        sock.connect(path)
        _authenticate(sock, path)
    except TimeoutError:
        sock.close()
        raise BusError(f"{path}: no answer within {TIMEOUT_SECONDS:g} s") from None
    except OSError as exc:
        sock.close()
        raise BusUnreachable(f"{path}: {exc.strerror or exc}") from None
    except BusUnreachable:
        sock.close()
        raise
    connection = Connection(sock, destination)
    if hello:
        connection.call("/org/freedesktop/DBus", BUS_NAME, "Hello", destination=BUS_NAME)
    return connection


def _authenticate(sock: _socket.socket, path: str) -> None:
    """EXTERNAL, as sd-bus's own client does it: every line at once, BEGIN included, then
    the answers. The first message goes out only after the server's OK, so it never arrives
    in the same read as BEGIN: systemd's private socket (sd-bus as a server) leaves a message
    that does unanswered until something else wakes it up (seen here: 4 of 5 calls)."""
    sock.sendall(b"\0AUTH EXTERNAL\r\nDATA\r\nBEGIN\r\n")
    answer = b""
    deadline = time.monotonic() + TIMEOUT_SECONDS  # a peer that drips bytes is no faster
    while len(answer) < 4096:
        lines = answer.split(b"\r\n")
        for line in lines[:-1]:
            if line.startswith(b"OK "):
                return
            if line != b"DATA":  # REJECTED, ERROR: what the server says is why
                shown = line.decode(errors="replace").strip() or "an empty line"
                raise BusUnreachable(f"{path}: the bus refused gpunode's authentication "
                                     f"({shown})")
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(4096)
        if not chunk:
            raise BusUnreachable(f"{path}: the bus closed the connection during "
                                 "authentication")
        answer += chunk
    raise BusUnreachable(f"{path}: no authentication answer in the first 4096 bytes")


def _unescape(value: str) -> str:
    """A D-Bus address value with its %XX escapes undone."""
    out, i = bytearray(), 0
    raw = value.encode()
    while i < len(raw):
        if raw[i] == ord("%"):
            out += bytes.fromhex(raw[i + 1:i + 3].decode())
            i += 3
        else:
            out.append(raw[i])
            i += 1
    return out.decode()


# -- marshalling: little-endian out, either byte order in ------------------------------------


def _pad(offset: int, align: int) -> int:
    return -offset % align


def _strings(args: tuple[str, ...]) -> bytes:
    out = b""
    for arg in args:
        out += b"\0" * _pad(len(out), 4)
        data = arg.encode()
        out += struct.pack("<I", len(data)) + data + b"\0"
    return out


def _header(serial: int, body_length: int, fields: list[tuple[int, str, str]]) -> bytes:
    """The fixed header and its fields (each a struct (yv), 8-aligned), padded to 8."""
    array = b""
    for code, kind, value in fields:
        array += b"\0" * _pad(len(array), 8)
        data = value.encode()
        size = struct.pack("<B" if kind == "g" else "<I", len(data))
        array += struct.pack("<B", code) + b"\1" + kind.encode() + b"\0" + size + data + b"\0"
    header = struct.pack("<cBBBIII", b"l", _METHOD_CALL, 0, 1, body_length, serial,
                         len(array)) + array
    return header + b"\0" * _pad(len(header), 8)


def _parse(data: bytes, order: str, signature: str, offset: int = 0) -> list[Any]:
    """The values of `signature` in `data` from `offset`; a malformed message is the bus's
    fault, told as BusUnreachable (nothing it says can be trusted any more)."""
    reader = _Reader(data, order, offset)
    try:
        values, i = [], 0
        while i < len(signature):
            end = _complete(signature, i)
            values.append(reader.value(signature[i:end]))
            i = end
        return values
    except (struct.error, IndexError, KeyError, ValueError, UnicodeDecodeError,
            RecursionError) as exc:
        raise BusUnreachable(f"the bus sent a malformed message ({exc})") from None


def _complete(signature: str, i: int) -> int:
    """The end of the complete type that starts at `i`."""
    code = signature[i]
    if code == "a":
        return _complete(signature, i + 1)
    if code in "({":
        close, j, members = ")" if code == "(" else "}", i + 1, 0
        while signature[j] != close:
            if code == "{" and members == 0 and signature[j] not in _BASIC:
                raise ValueError(f"a dict entry whose key {signature[j]!r} is not a basic type")
            j = _complete(signature, j)
            members += 1
        if members == 0 or (code == "{" and members != 2):
            raise ValueError(f"{signature[i:j + 1]!r} is not a valid struct or dict entry")
        return j + 1
    if code not in _ALIGN:
        raise ValueError(f"unknown type code {code!r}")
    return i + 1


class _Reader:
    def __init__(self, data: bytes, order: str, offset: int) -> None:
        self.data, self.order, self.offset = data, order, offset

    def _align(self, align: int) -> None:
        self.offset += _pad(self.offset, align)
        if self.offset > len(self.data):
            raise IndexError("past the end of the message")

    def _unpack(self, fmt: str, size: int) -> Any:
        self._align(size)
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += size
        return value

    def _text(self, length: int) -> str:
        end = self.offset + length
        if end >= len(self.data) or self.data[end] != 0:
            raise ValueError("a string without its terminating NUL")
        text = self.data[self.offset:end].decode()
        self.offset = end + 1
        return text

    def value(self, kind: str) -> Any:
        code = kind[0]
        if code in _FIXED:
            fmt, size = _FIXED[code]
            number = self._unpack(fmt, size)
            return bool(number) if code == "b" else number
        if code in "so":
            return self._text(self._unpack("I", 4))
        if code == "g":
            return self._text(self._unpack("B", 1))
        if code == "v":
            inner = self._text(self._unpack("B", 1))
            if _complete(inner, 0) != len(inner):
                raise ValueError(f"a variant of signature {inner!r}")
            return self.value(inner)
        if code == "a":
            length = self._unpack("I", 4)
            element = kind[1:]
            self._align(_ALIGN[element[0]])
            end = self.offset + length
            if end > len(self.data):
                raise IndexError("an array past the end of the message")
            items = []
            while self.offset < end:
                items.append(self.value(element))
            return dict(items) if element[0] == "{" else items
        self._align(8)  # a struct or a dict entry
        fields, j = [], 1
        while j < len(kind) - 1:
            end = _complete(kind, j)
            fields.append(self.value(kind[j:end]))
            j = end
        return tuple(fields)
