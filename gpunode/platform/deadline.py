"""An overall deadline for what gpunode does over HTTP(S): a bake's download, a Kubernetes API
call.

A socket timeout bounds each single wait, not the whole: a server that sends one byte every
0.4 s never trips it, in a header line, a TLS handshake or a body. So every socket a
`Connection` opens is registered with a `Deadline`, which shuts all of them down (on a dup of
the descriptor, so the owner's object is never touched from another thread) the moment it
passes; whatever call is blocked on one returns at once, and `Deadline.expired` tells the
caller why. One Deadline may span several connections: a download's redirects and retries.

`Connection` is http.client's own connection with the connect step made here: the TCP
connection (each wait bounded by the stall timeout and what is left of the deadline), an HTTP
proxy's CONNECT tunnel when urllib asks for one (its `set_tunnel`), then TLS with the caller's
context. `urlopen()` is urllib's with the HTTP and HTTPS handlers that use it, so proxies from
the environment and redirects work as urllib does them, under the one deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl
    import urllib.request


class Deadline:
    """Seconds from now; every socket watched is shut down when they have passed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._watched: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def timeout(self, stall: float) -> float:
        """A single wait's timeout: the stall timeout, or what is left if that is less."""
        left = self.remaining()
        if left <= 0:
            self.expired = True
            raise TimeoutError(f"the deadline of {self.seconds:g} s passed")
        return min(stall, left)

    def watch(self, sock: socket.socket) -> None:
        """Shut `sock` down when the deadline passes (at once, if it has)."""
        dup = sock.dup()
        with self._lock:
            if not self.expired:
                self._watched.append(dup)
                return
        with contextlib.suppress(OSError):
            dup.shutdown(socket.SHUT_RDWR)
        dup.close()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for dup in self._watched:
                with contextlib.suppress(OSError):
                    dup.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop the timer and let go of the watched sockets (their owners close their own)."""
        self._timer.cancel()
        with self._lock:
            for dup in self._watched:
                dup.close()
            self._watched.clear()

    def __enter__(self) -> Deadline:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Connection(http.client.HTTPConnection):
    """http.client's connection whose sockets live under a Deadline; TLS when given a context."""

    def __init__(self, host: str, port: int | None = None, *, timeout: float,
                 deadline: Deadline, context: ssl.SSLContext | None = None) -> None:
        self.default_port = 443 if context is not None else 80  # read by the host:port parse
        super().__init__(host, port, timeout=timeout)
        self.deadline = deadline
        self.context = context
        self.tunnel: tuple[str, int, dict[str, str]] | None = None

    def set_tunnel(self, host: str, port: int | None = None,
                   headers: dict[str, str] | None = None) -> None:
        """urllib asks for a CONNECT tunnel through its proxy (this connection's host)."""
        name, _, given = host.rpartition(":") if host.rpartition(":")[2].isdigit() else \
            (host, "", "")
        self.tunnel = (name.strip("[]"), port or int(given or 443), dict(headers or {}))

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port),
                                        self.deadline.timeout(self.timeout))
        try:
            self.deadline.watch(sock)
            server = self.host
            if self.tunnel is not None:
                server = self._through_tunnel(sock, *self.tunnel)
            sock.settimeout(self.deadline.timeout(self.timeout))
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=server)
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def _through_tunnel(self, sock: socket.socket, host: str, port: int,
                        headers: dict[str, str]) -> str:
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}",
                 *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        sock.sendall("\r\n".join(lines).encode("latin-1"))
        response = http.client.HTTPResponse(sock, method="CONNECT")
        try:
            response.begin()
        finally:
            response.close()
        if response.status != 200:
            raise OSError(f"the proxy refused the tunnel to {target}: {response.status} "
                          f"{response.reason}")
        return host


def urlopen(request: urllib.request.Request, timeout: float, deadline: Deadline) -> Any:
    """urllib's urlopen (proxies from the environment, http(s) redirects; no ftp, no file)
    with every connection under `deadline` and each wait bounded by `timeout`."""
    import ssl
    import urllib.request

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(_factory(deadline, None), req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(_factory(deadline, ssl.create_default_context()), req)

    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPRedirectHandler(), urllib.request.HTTPErrorProcessor(),
                    Http(), Https()):
        opener.add_handler(handler)
    return opener.open(request, timeout=timeout)


def _factory(deadline: Deadline, context: ssl.SSLContext | None) -> Any:
    def make(host: str, timeout: float = 60.0, **_: object) -> Connection:
        return Connection(host, timeout=timeout, deadline=deadline, context=context)

    return make
