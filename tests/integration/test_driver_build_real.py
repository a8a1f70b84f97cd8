"""The driver build with real processes and sockets: two processes building at once compile
once, the real fetcher downloads from a local HTTP server, build.sh passes `bash -n` and
shellcheck, and NspawnBuilder's command template runs for real with a stand-in program. The
build on fixture hosts with a fake compiler: tests/unit/test_driver_build.py.
"""

from __future__ import annotations

import http.server
import mimetypes
import multiprocessing
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode import command
from gpunode.driver import build as b
from gpunode.driver import builders, cache
from gpunode.host import Host
from helpers.driver_build import (
    BUILD_SH,
    DRIVER,
    FACTS,
    INSTALLER,
    KERNEL,
    FakeBuilder,
    inputs,
    mirror_host,
    sha,
)


@pytest.fixture
def host(make_host: HostFactory) -> Host:
    return mirror_host(make_host)


# -- concurrent builds ---------------------------------------------------------------------------


def _build_in_process(root: str, sleep: float, queue: multiprocessing.Queue) -> None:
    host = Host(Path(root))
    builder = FakeBuilder(sleep=sleep)
    result = b.build(host, inputs(), builders.UrlFetcher(host), builder, FACTS)
    queue.put((result.cache_hit, builder.calls))


def test_two_processes_building_at_once_compile_once(host: Host) -> None:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_build_in_process, args=(str(host.root), 1.0, queue))
                 for _ in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(30)
    outcomes = sorted(queue.get(timeout=5) for _ in processes)
    assert outcomes == [(False, 1), (True, 0)]
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is not None


# -- the real fetcher over HTTP (a local server thread: sockets, no process) -----------------------


@pytest.fixture
def http_mirror(tmp_path: Path) -> Iterator[str]:
    served = tmp_path / "served"
    served.mkdir()
    (served / "NVIDIA.run").write_bytes(INSTALLER)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(served), **kwargs)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# a real HTTP server on loopback: sockets
@pytest.mark.allow_paths(*mimetypes.knownfiles)  # read by http.server's handler
def test_url_fetcher_streams_an_http_download_into_place(http_mirror: str,
                                                         tmp_path: Path) -> None:
    dest = tmp_path / "nvidia-installer.run"
    builders.UrlFetcher(Host(tmp_path)).fetch(f"{http_mirror}/NVIDIA.run", dest)
    assert dest.read_bytes() == INSTALLER
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvidia-installer.run", "served"]


# a real HTTP server on loopback: sockets
@pytest.mark.allow_paths(*mimetypes.knownfiles)  # read by http.server's handler
def test_url_fetcher_reports_an_http_error_and_leaves_no_partial_file(http_mirror: str,
                                                                      tmp_path: Path) -> None:
    dest = tmp_path / "out" / "nvidia-installer.run"
    dest.parent.mkdir()
    with pytest.raises(b.DriverBuildError, match=r"Failed to download .*: HTTP 404"):
        builders.UrlFetcher(Host(tmp_path)).fetch(f"{http_mirror}/missing.run", dest)
    assert list(dest.parent.iterdir()) == []


# -- NspawnBuilder's build.sh and command template, run for real -----------------------------------


def test_build_sh_is_valid_bash() -> None:
    command.run(["bash", "-n", str(BUILD_SH)], timeout=10)


def test_build_sh_passes_shellcheck() -> None:
    """shellcheck (Debian's package; `make setup` installs it) finds nothing, info level too."""
    command.run(["shellcheck", "--shell=bash", "--severity=info", str(BUILD_SH)], timeout=60)


def test_a_configured_builder_command_runs_for_real_through_the_whole_build(host: Host) -> None:
    """The argv template with a stand-in program (cp) instead of systemd-nspawn."""
    builder = builders.NspawnBuilder(command=["cp", "{driver_installer}", "{out_dir}/nvidia.ko"])
    result = b.build(host, inputs(), builders.UrlFetcher(host), builder, FACTS)
    assert (host.path(result.entry.path) / "nvidia.ko").read_bytes() == INSTALLER
    assert result.entry.manifest["modules"] == {"nvidia.ko": sha(INSTALLER, "sha256")}
