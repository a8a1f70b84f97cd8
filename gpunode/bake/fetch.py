"""An artifact's bytes from its source, verified as they are written: `stage()`.

A URL is fetched with the standard library (urllib), each attempt bounded by a stall timeout,
up to `attempts` tries with a short pause between them (a refused connection, a reset, a 5xx or
429 answer is worth another try; a 404 or a wrong digest is not). A file is read through the
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
from gpunode.bake.config import Source
from gpunode.errors import BakeError, HostError
from gpunode.platform.host import CHUNK, Host

RETRY_PAUSE_SECONDS = 1.0
MAX_ARTIFACT_BYTES = 4 << 30  # a driver sysext is ~400 MB; nothing gpunode bakes is 4 GiB


class _Transient(Exception):
    """A failed attempt worth repeating: the reason."""


class _Refused(Exception):
    """The server's final answer (a 404): the reason; not worth another try."""


def stage(host: Host, path: str, source: Source, sha512: str, what: str, timeout: int,
          attempts: int) -> None:
    """Write the artifact to the host path `path`, whole and verified, or raise BakeError
    (nothing left at `path` or beside it)."""
    for attempt in range(1, attempts + 1):
        try:
            host.write_atomic(path, _verified(_chunks(source, timeout), sha512, what, source))
            return
        except _Transient as exc:
            if attempt == attempts:
                raise BakeError(what, source.shown, f"{exc} (tried {attempts} times)",
                                "check that the source is reachable from this machine, or "
                                "raise [download] attempts and timeout") from None
            log.get().warning("bake.retry", what=what, source=source.shown, attempt=attempt,
                              reason=str(exc))
            time.sleep(RETRY_PAUSE_SECONDS * attempt)
        except _Refused as exc:
            raise BakeError(what, source.shown, str(exc), "check the URL (a driver's "
                            "{version} is the image's Flatcar version)") from None
        except HostError as exc:
            if source.path is not None and source.path in exc.path:
                raise BakeError(what, source.shown, exc.reason, "give a regular file") from None
            raise


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


def _chunks(source: Source, timeout: int) -> Iterator[bytes]:
    if source.path is not None:
        yield from Host().read_chunks(source.path)
        return
    yield from _download(str(source.url), timeout)


def _download(url: str, timeout: int) -> Iterator[bytes]:
    import http.client
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"User-Agent": "gpunode-image-bake"})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code >= 500 or exc.code == 429:
            raise _Transient(f"HTTP {exc.code} {exc.reason}") from None
        raise _Refused(f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Transient(f"cannot connect: {reason}") from None
    with response:
        while True:
            try:
                chunk = response.read(CHUNK)
            except (OSError, ValueError, http.client.HTTPException) as exc:  # a stall, a reset
                raise _Transient(f"the download broke off: {exc or type(exc).__name__}") \
                    from None
            if not chunk:
                return
            yield chunk

