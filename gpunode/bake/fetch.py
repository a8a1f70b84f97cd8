"""An artifact's bytes from its source, verified as they are written: `stage()`.

A URL is fetched with the standard library (urllib: proxies from the environment, http(s)
redirects), each wait bounded by a stall timeout and all of it — every attempt and pause —
by an overall deadline (platform/deadline.py: a server dripping one byte at a time never trips a
stall timeout), up to `attempts` tries with a short pause between them (a refused connection, a
reset, a 5xx or 429 answer is worth another try; a 404, a redirect elsewhere than http(s), an
answer that is not HTTP or a wrong digest is not). A file is read through the
Host boundary (a FIFO, a device or a directory is refused, never read). The bytes stream into a
temporary file beside the target; the sha512 is checked at the end of the stream, before the
temporary file is renamed into its stage name, so a corrupt or truncated artifact never gets a
name anything reads.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

from gpunode import log
from gpunode.bake.config import DEFAULT_DEADLINE, Source
from gpunode.errors import BakeError, HostError
from gpunode.platform.deadline import Deadline, urlopen
from gpunode.platform.host import CHUNK, Host

RETRY_PAUSE_SECONDS = 1.0
MAX_ARTIFACT_BYTES = 4 << 30  # a driver sysext is ~400 MB; nothing gpunode bakes is 4 GiB


class _Transient(Exception):
    """A failed attempt worth repeating: the reason."""


class _Refused(Exception):
    """The server's final answer (a 404): the reason; not worth another try."""


def stage(host: Host, path: str, source: Source, sha512: str, what: str, timeout: int,
          attempts: int, deadline: int = DEFAULT_DEADLINE) -> None:
    """Write the artifact to the host path `path`, whole and verified, or raise BakeError
    (nothing left at `path` or beside it). `timeout`: seconds a download may stall;
    `deadline`: seconds for all its attempts together, pauses included."""
    with Deadline(deadline) as overall:
        for attempt in range(1, attempts + 1):
            try:
                host.write_atomic(path, _verified(_chunks(source, timeout, overall), sha512,
                                                  what, source))
                return
            except _Transient as exc:
                if overall.expired or overall.remaining() < RETRY_PAUSE_SECONDS * attempt:
                    raise _past_deadline(what, source, deadline, str(exc)) from None
                if attempt == attempts:
                    raise BakeError(what, source.shown, f"{exc} (tried {attempts} times)",
                                    "check that the source is reachable from this machine, "
                                    "or raise [download] attempts and timeout") from None
                log.get().warning("bake.retry", what=what, source=source.shown,
                                  attempt=attempt, reason=str(exc))
                time.sleep(RETRY_PAUSE_SECONDS * attempt)
            except _Refused as exc:
                raise BakeError(what, source.shown, str(exc), "check the URL (a driver's "
                                "{version} is the image's Flatcar version)") from None
            except HostError as exc:
                if source.path is not None and source.path in exc.path:
                    raise BakeError(what, source.shown, exc.reason, "give a regular file") \
                        from None
                raise


def _past_deadline(what: str, source: Source, deadline: int, last: str) -> BakeError:
    return BakeError(what, source.shown, f"not fetched within the deadline of {deadline} s "
                     f"([download] deadline; last: {last})", "a slow or stalling server: "
                     "raise [download] deadline, or fetch it from a mirror nearer this machine")


def _verified(chunks: Iterator[bytes], sha512: str, what: str, source: Source
              ) -> Iterator[bytes]:
    hasher = hashlib.sha512()
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > MAX_ARTIFACT_BYTES:
            raise BakeError(what, source.shown, f"larger than {MAX_ARTIFACT_BYTES >> 30} GiB")
        hasher.update(chunk)
        yield chunk
    got = hasher.hexdigest()
    if got != sha512:
        raise BakeError(what, source.shown, f"its sha512 is {got[:16]}…, not the {sha512[:16]}… "
                        "the bake config pins; nothing was placed",
                        "a corrupt or different artifact: check the source, or pin the sha512 "
                        "its publisher gives (Flatcar: the release's .DIGESTS file)")


def _chunks(source: Source, timeout: int, overall: Deadline) -> Iterator[bytes]:
    if source.path is not None:
        yield from Host().read_chunks(source.path)
        return
    yield from _download(str(source.url), timeout, overall)


def _download(url: str, timeout: int, overall: Deadline) -> Iterator[bytes]:
    """The bytes at `url` through urllib (proxies from the environment, redirects), every
    connection under `overall`. A refused connection, a reset, a stall, a 5xx or 429 is
    _Transient; a 4xx, an answer that is not HTTP, or a redirect elsewhere than http(s) is
    _Refused."""
    import http.client
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"User-Agent": "gpunode-image-bake"})
    try:
        response = urlopen(request, timeout, overall)
    except urllib.error.HTTPError as exc:
        exc.close()
        reason = " ".join(str(exc.reason).split())[:300]
        if exc.code >= 500 or exc.code == 429:
            raise _Transient(f"HTTP {exc.code} {reason}") from None
        if 300 <= exc.code < 400:  # urllib follows http(s) redirects, up to 10
            location = (exc.headers.get("Location") if exc.headers else None) or ""
            to = f" to {location[:200]!r}" if location else ""
            raise _Refused(f"HTTP {exc.code}: a redirect{to} that is not followed ({reason})") \
                from None
        raise _Refused(f"HTTP {exc.code} {reason}") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError is an OSError
        raise _failure(exc, overall) from None
    with response:
        while True:
            try:
                chunk = response.read(CHUNK)
            except (OSError, ValueError, http.client.HTTPException) as exc:  # a stall, a reset
                if overall.expired:
                    raise _Transient("the deadline passed") from None
                raise _Transient(f"the download broke off: {exc or type(exc).__name__}") \
                    from None
            if not chunk:
                break
            yield chunk
    if overall.expired:  # the sockets were shut down under the read: no end of the file
        raise _Transient("the deadline passed")


def _failure(exc: Exception, overall: Deadline) -> Exception:
    """Why the request got no answer: _Transient (worth another try) or _Refused."""
    import http.client
    import urllib.error

    reason = getattr(exc, "reason", exc) if isinstance(exc, urllib.error.URLError) else exc
    if overall.expired:
        return _Transient("the deadline passed")
    if isinstance(reason, http.client.RemoteDisconnected):
        return _Transient(f"the server closed the connection: {reason}")
    if isinstance(reason, http.client.HTTPException):
        return _Refused(_not_http(reason))
    if isinstance(reason, OSError):
        return _Transient(f"cannot connect: {reason or type(reason).__name__}")
    return _Refused(f"cannot fetch it: {reason}")  # "unknown url type: ftp", a bad redirect


def _not_http(exc: Exception) -> str:
    """http.client's complaint about an answer (a bad status line, a header line over 64 KiB,
    more than 100 headers) as the refusal says it."""
    import http.client

    text = str(exc) if not isinstance(exc, http.client.BadStatusLine) else \
        f"a bad status line {str(exc)[:80]!r}"
    return f"the server's answer is not HTTP as gpunode reads it: {text or type(exc).__name__}"
