"""A hostile HTTP(S) 'server' for tests: a raw socket on 127.0.0.1 that reads a request and then
answers however a test says (badly formed, dripping, never finishing), as no real server would.

    with raw_server(send(b"garbage")) as url:                     # http://127.0.0.1:PORT
    with raw_server(drip(head, b"x" * 100000, 0.3), tls=context) as url:  # https://…

Each connection is served in a thread of its own; leaving the block stops every answer still
running (a drip checks between bytes) and waits for them.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

# What the server does with a connection once it has read the request; the event is set when
# the server stops, for an answer that would otherwise run for hours.
Answer = Callable[[socket.socket, threading.Event], None]


@contextlib.contextmanager
def raw_server(answer: Answer, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """Serve `answer` on 127.0.0.1 (over TLS with `tls`); its base URL, with no trailing '/'."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    served: list[threading.Thread] = []

    def serve(connection: socket.socket) -> None:
        with contextlib.suppress(OSError), connection:
            connection.settimeout(5)
            if tls is None:
                connection.recv(65536)
                answer(connection, stop)
                return
            with tls.wrap_socket(connection, server_side=True) as wrapped:
                wrapped.recv(65536)
                answer(wrapped, stop)

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=serve, args=(connection,), daemon=True)
            thread.start()
            served.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    scheme = "http" if tls is None else "https"
    try:
        yield f"{scheme}://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join()
        for thread in served:
            thread.join()
        listener.close()


def drip(head: bytes, body: bytes, every: float) -> Answer:
    """Send `head` at once, then `body` one byte every `every` seconds until the server stops."""
    def answer(connection: socket.socket, stop: threading.Event) -> None:
        connection.sendall(head)
        for byte in body:
            if stop.is_set():
                return
            connection.sendall(bytes([byte]))
            time.sleep(every)

    return answer


def send(data: bytes) -> Answer:
    """Send `data` at once."""
    return lambda connection, stop: connection.sendall(data)
