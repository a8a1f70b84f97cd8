"""The real fetcher and builder that driver/build.py's `build()` is given.

The real downloads (`UrlFetcher`) and the real compiler (`NspawnBuilder`, the Flatcar developer
container under systemd-nspawn, running build.sh) cannot run in this project's test
environment: no network to Flatcar's or NVIDIA's servers, no Flatcar image, no GPU. Tests use
file:// URLs, a local HTTP server and a fake builder; NspawnBuilder's argv is pinned by tests,
and build.sh (package data, gpunode/driver/build.sh) is checked by `bash -n` and shellcheck.

Both are adapters: they get real paths (build() resolved them through its Host) and write them
through the live Host, which takes a real path as it is; a file:// source is a *host* path,
read under the fetcher's Host. The compiler runs through gpunode.platform.command.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from gpunode import log
from gpunode.driver.build import INSTALLER_NAME, fill
from gpunode.errors import DriverBuildError, HostError
from gpunode.platform import command
from gpunode.platform.host import CHUNK, Host

if TYPE_CHECKING:
    from gpunode.config import BuildConfig

BUILD_SCRIPT = "build.sh"

# The live host: the paths adapters are given are real ones already.
_REAL = Host()


@cache
def build_script() -> str:
    """build.sh, as shipped in the package (and the sysext bundle) beside this module."""
    from importlib import resources  # only a build reads it

    return (resources.files("gpunode.driver") / BUILD_SCRIPT).read_text(encoding="utf-8")


@dataclass(frozen=True)
class UrlFetcher:
    """Downloads with urllib: http(s) URLs, file:// URLs and absolute paths (a local mirror).

    file:// URLs and paths are *host* paths, read under `host`'s root like every other path.
    The content streams into a temporary file next to `dest_path`, renamed into place when
    complete (Host.write_atomic). `timeout` bounds each network read; `deadline` the whole
    download.
    """

    host: Host = field(default_factory=Host)
    timeout: float = 60.0
    deadline: float = 1800.0

    def fetch(self, url: str, dest_path: Path) -> None:
        # A failure to read the source is the download's; one to write dest_path is the Host's.
        _REAL.write_atomic(str(dest_path), self._chunks(url), mode=0o644)

    def _chunks(self, url: str) -> Iterator[bytes]:
        try:
            local = _local_path(url)
            if local is not None:
                yield from self.host.read_chunks(local)
                return
            yield from self._download(url)
        except HostError as exc:
            raise DriverBuildError("download", url, exc.reason, hint=_HINT) from exc
        except ValueError as exc:  # a file:// URL of another host
            raise DriverBuildError("download", url, str(exc), hint=_HINT) from exc

    def _download(self, url: str) -> Iterator[bytes]:
        import http.client  # only a build that downloads needs the network side
        import urllib.request

        from gpunode.platform.deadline import Deadline, urlopen

        request = urllib.request.Request(url, headers={"User-Agent": "gpunode"})
        with Deadline(self.deadline) as overall:
            try:
                with urlopen(request, self.timeout, overall) as source:
                    while chunk := source.read(CHUNK):
                        yield chunk
            except (OSError, http.client.HTTPException, ValueError) as exc:
                if not overall.expired:
                    raise DriverBuildError("download", url, _reason(exc), hint=_HINT) from exc
            if overall.expired:  # its sockets shut down under the read: no end of the file
                raise DriverBuildError("download", url, f"not complete within the deadline of "
                                       f"{self.deadline:.0f} s", hint=_HINT)


_HINT = "check the node's network (or the mirror) and the URL in driver.build"


def _local_path(url: str) -> str | None:
    """The host path a file:// URL or a plain path names; None for a network URL."""
    if url.startswith("/"):
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "file":
        return None
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file:// URL names another host ({parts.netloc})")
    return urllib.parse.unquote(parts.path)


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "code", None)  # urllib.error.HTTPError, not imported up front
    if isinstance(code, int):
        return f"HTTP {code} {getattr(exc, 'reason', '')}".rstrip()
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    reason = getattr(exc, "reason", None)  # urllib.error.URLError
    return str(reason) if reason is not None else str(exc) or type(exc).__name__


DEFAULT_NSPAWN_COMMAND: tuple[str, ...] = (
    "systemd-nspawn", "--quiet", "--image={dev_container}", "--bind={workdir}:/work",
    "--bind={out_dir}:/out", "/bin/bash", f"/work/{BUILD_SCRIPT}", "{kernel}", "{flavour}",
)


@dataclass(frozen=True)
class NspawnBuilder:
    """Compiles the modules in the Flatcar developer container with systemd-nspawn.

    `command` is an argv template (no shell) with placeholders {workdir}, {dev_container},
    {driver_installer}, {kernel}, {flavour} and {out_dir}; the default runs build.sh.
    It needs root, systemd-nspawn, loop devices and the developer container of the node's own
    Flatcar release (its kernel build tree must be the running kernel's): it runs on a Flatcar
    node only, never in this project's tests, which pin its argv and script instead.
    """

    command: Sequence[str] = DEFAULT_NSPAWN_COMMAND
    timeout: float = 3600.0  # Flatcar's own nvidia.service takes 5-10 min; slow disks more

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command or DEFAULT_NSPAWN_COMMAND))
        self.argv(Path("/w"), Path("/d"), Path("/i"), "k", "f", Path("/o"))  # refuse typos now

    def argv(self, workdir: Path, dev_container: Path, driver_installer: Path, kernel: str,
             flavour: str, out_dir: Path) -> list[str]:
        values = {"workdir": str(workdir), "dev_container": str(dev_container),
                  "driver_installer": str(driver_installer), "kernel": kernel,
                  "flavour": flavour, "out_dir": str(out_dir)}
        return [fill(arg, values, "use builder command argument",
                     hint="set driver.build.command with those placeholders only")
                for arg in self.command]

    def build(self, workdir: Path, dev_container: Path, driver_installer: Path, kernel: str,
              flavour: str, out_dir: Path) -> None:
        if driver_installer != workdir / INSTALLER_NAME:
            raise DriverBuildError("build", str(driver_installer), "build.sh expects the "
                                   f"installer at /work/{INSTALLER_NAME}")
        _REAL.write_atomic(str(workdir / BUILD_SCRIPT), build_script().encode(), mode=0o755)
        argv = self.argv(workdir, dev_container, driver_installer, kernel, flavour, out_dir)
        log.get().info("driver.build.compile", argv=argv, timeout_s=self.timeout)
        command.run(argv, timeout=self.timeout)


def default_adapters(config: BuildConfig,
                     host: Host | None = None) -> tuple[UrlFetcher, NspawnBuilder]:
    """The real fetcher and builder for `driver.build` (an empty `command`: systemd-nspawn).
    Pass the Host so file:// mirrors resolve under --root; without it they are live paths."""
    return UrlFetcher(host or Host()), NspawnBuilder(command=config.command)
