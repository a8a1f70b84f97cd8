"""Hostile inputs of `gpunode image bake`, round 3: an image whose small files or links cannot
be written, an os-release whose VERSION is no version, and sources the bake cannot fetch as
written. Each is refused before anything is placed: the image root stays exactly as it was."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from helpers.bake import make_inputs
from helpers.raw_server import Answer, drip, raw_server, send
from hostile.support import Cli, check_refusal


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _not_utf8(path: Path) -> None:
    path.write_bytes(b"nvidia-drivers-550\n\xff\xfe\n")


def _file(path: Path) -> None:
    path.write_text("not a directory\n")


def _link_out(path: Path) -> None:
    path.symlink_to("../" * 30 + "tmp")


# What stands where the bake must write a small file or a link → the refusal it must give.
# Each used to leave the artifacts renamed into place and no baked.json (exit 1).
UNWRITABLE: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "enabled-sysext-a-fifo": ("etc/flatcar/enabled-sysext.conf", _fifo, r"FIFO"),
    "enabled-sysext-a-directory": ("etc/flatcar/enabled-sysext.conf", _directory,
                                   r"directory"),
    "enabled-sysext-not-utf8": ("etc/flatcar/enabled-sysext.conf", _not_utf8, r"UTF-8"),
    "wants-a-file": ("etc/systemd/system/multi-user.target.wants", _file,
                     r"multi-user\.target\.wants.*not a directory"),
    "nvidia-service-a-directory": ("etc/systemd/system/nvidia.service", _directory,
                                   r"nvidia\.service.*directory"),
    "extensions-a-link-out": ("etc/extensions", _link_out, r"climbs above the root"),
    "manifest-a-directory": ("etc/gpunode/baked.json", _directory, r"baked\.json.*directory"),
    "blacklist-a-fifo": ("etc/modprobe.d/blacklist-nouveau.conf", _fifo, r"FIFO"),
}


@pytest.mark.parametrize("case", UNWRITABLE, ids=UNWRITABLE.keys())
def test_a_bake_that_cannot_write_a_small_file_or_link_places_nothing(
        make_host: HostFactory, tmp_path: Path, cli: Cli, case: str) -> None:
    where, make, pattern = UNWRITABLE[case]
    root = make_host("nc4as-t4-v3", "driver").root
    path = root / where
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        path.rmdir()
    make(path)
    config = make_inputs(tmp_path / "in").config()
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  1, pattern)
    assert not (root / "opt/extensions").exists()


def test_a_bake_refused_while_placing_puts_back_everything_it_changed(
        make_host: HostFactory, tmp_path: Path, cli: Cli,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second bake (a new gpunode image, another driver branch) whose last write fails
    leaves the first bake's image exactly: files, links, the old artifacts, the manifest."""
    from gpunode.bake import image
    from gpunode.errors import HostError

    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "in")
    assert cli("image", "bake", "--root", str(root), "--config", str(inputs.config())).code == 0
    inputs.add("gpunode-0.3.0-x86-64.raw", b"hsqs newer gpunode\n" * 100)
    inputs.add("flatcar-nvidia-drivers-570.raw", b"proprietary\n" * 100)
    config = inputs.config(gpunode="gpunode-0.3.0-x86-64.raw",
                           driver="flatcar-nvidia-drivers-570.raw")
    config.write_text(config.read_text().replace('name = "nvidia-drivers-570-open"',
                                                 'name = "nvidia-drivers-570"'))

    def full_disk(*args: object, **kwargs: object) -> bytes:
        raise HostError("write", f"{root}/etc/gpunode/baked.json", "No space left on device")

    monkeypatch.setattr(image, "render_manifest", full_disk)
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  1, r"baked\.json.*No space left")


# An image file whose values would go into file names and URLs → the refusal (exit 2): the
# root is not a Flatcar image gpunode can bake. VERSION="../../../../tmp/x" used to place the
# driver at R/etc/tmp/x.raw, and "1\n2" a name with a literal backslash-n.
BAD_IMAGE_VALUES: dict[str, tuple[str, str, str]] = {
    "version-climbs": ("etc/os-release", 'VERSION="../../../../tmp/x"',
                       r"VERSION='\.\./\.\./\.\./\.\./tmp/x', which is not a Flatcar version"),
    "version-backslash-n": ("etc/os-release", 'VERSION="1\\n2"', r"VERSION='1\\\\n2'"),
    "version-with-a-tab": ("etc/os-release", 'VERSION="4459\t2"', r"VERSION='4459\\t2'"),
    "version-with-a-slash": ("etc/os-release", "VERSION=4459/2", r"VERSION='4459/2'"),
    "board-climbs": ("etc/os-release", 'FLATCAR_BOARD="../amd64-usr"',
                     r"FLATCAR_BOARD='\.\./amd64-usr', which is not a Flatcar board"),
    "group-with-a-query": ("etc/flatcar/update.conf", "GROUP=stable?x=1",
                           r"update\.conf says GROUP='stable\?x=1'"),
}


@pytest.mark.parametrize("case", BAD_IMAGE_VALUES, ids=BAD_IMAGE_VALUES.keys())
def test_an_image_value_that_is_no_plain_name_is_refused(
        make_host: HostFactory, tmp_path: Path, cli: Cli, case: str) -> None:
    where, line, pattern = BAD_IMAGE_VALUES[case]
    root = make_host("nc4as-t4-v3", "driver").root
    path = root / where
    path.parent.mkdir(parents=True, exist_ok=True)
    key = line.partition("=")[0]
    kept = [x for x in (path.read_text().splitlines() if path.exists() else [])
            if not x.startswith(f"{key}=")]
    path.write_text("\n".join([*kept, line]) + "\n")
    config = make_inputs(tmp_path / "in").config()
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  2, pattern)


@pytest.mark.parametrize("kind", ["fifo", "directory", "not-utf8"])
def test_an_unreadable_os_release_is_refused_as_a_missing_one_is(
        make_host: HostFactory, tmp_path: Path, cli: Cli, kind: str) -> None:
    """The same exit code (2) as a root without an os-release; it used to be 1."""
    root = make_host("nc4as-t4-v3", "driver").root
    path = root / "etc/os-release"
    path.unlink()
    {"fifo": _fifo, "directory": _directory, "not-utf8": _not_utf8}[kind](path)
    config = make_inputs(tmp_path / "in").config()
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  2, r"os-release: .*(FIFO|directory|UTF-8)")


def test_a_version_placeholder_of_an_image_that_is_not_flatcar_names_the_key(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    """Debian's VERSION="12 (bookworm)" cannot fill {version} of a toolkit source."""
    from helpers.bake_extras import TOOLKIT_FILE

    root = make_host("nc4as-t4-v3", "driver").root
    (root / "etc/os-release").write_text('ID=debian\nVERSION="12 (bookworm)"\n')
    config = make_inputs(tmp_path / "in").config(
        driver=None, extra=f'\n[toolkit]\nsource = "https://h/{{version}}/{TOOLKIT_FILE}"\n'
        f'sha512 = "{"0" * 128}"\n')
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  2, r"key 'toolkit.source': \{version\} cannot be filled: the image says "
                  r"VERSION='12 \(bookworm\)', which is no plain name")


@pytest.mark.parametrize("source", ["flatcar-{name.raw", "flatcar-name}.raw",
                                    "https://h/{version/flatcar-{name}.raw"])
def test_a_brace_that_opens_no_placeholder_is_a_usage_error(
        make_host: HostFactory, tmp_path: Path, cli: Cli, source: str) -> None:
    """It used to be taken literally (exit 1, 'No such file')."""
    root = make_host("nc4as-t4-v3", "driver").root
    config = make_inputs(tmp_path / "in").config(driver=source, driver_sha="0" * 128)
    result = check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                       str(config)], 2,
                           r"key 'driver\[1\].source'.*opens or closes no placeholder")
    assert result.errors[0]["error_code"] == "bake-config-invalid"


# -- sources the bake cannot fetch as written (exit 2, before anything is fetched) -----------

BAD_URLS: dict[str, tuple[str, str]] = {
    # used to pass config validation, then http.client.InvalidURL (a traceback)
    "space-in-path": ("https://h/a b/gpunode-0.2.0-x86-64.raw", r"holds ' '.*%20"),
    # used to be "cannot connect: ordinal not in range(128) (tried 3 times)"
    "non-ascii-path": ("https://h/é/gpunode-0.2.0-x86-64.raw", r"holds 'é'.*percent-encode"),
    "idna-host": ("https://bücher.example/gpunode-0.2.0-x86-64.raw",
                  r"host holds 'ü'.*xn--"),
    # used to be "Name or service not known": urllib takes no credentials from a URL
    "credentials": ("http://user:secret@h/gpunode-0.2.0-x86-64.raw",
                    r"a user or password in the URL: gpunode sends no credentials"),
    "user-only": ("http://user@h/gpunode-0.2.0-x86-64.raw", r"a user or password in the URL"),
}


@pytest.mark.parametrize("case", BAD_URLS, ids=BAD_URLS.keys())
def test_a_source_url_that_cannot_be_fetched_as_written_is_refused_clearly(
        make_host: HostFactory, tmp_path: Path, cli: Cli, case: str) -> None:
    url, pattern = BAD_URLS[case]
    root = make_host("nc4as-t4-v3", "driver").root
    config = make_inputs(tmp_path / "in").config(gpunode=url, gpunode_sha="0" * 128)
    result = check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                       str(config)], 2, rf"key 'gpunode.source'.*{pattern}")
    assert "secret" not in result.err + result.out


def test_a_build_url_with_credentials_is_refused(make_host: HostFactory, tmp_path: Path,
                                                 cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    (tmp_path / "in").mkdir()
    (tmp_path / "in/pinned.toml").write_text('[driver]\nflavour = "open"\n')
    config = make_inputs(tmp_path / "in").config(
        driver=None, extra='\n[agent]\nconfig = "pinned.toml"\n[build]\nenabled = true\n'
        f'driver_sha256 = "{"0" * 64}"\ndev_container_sha512 = "{"0" * 128}"\n'
        'driver_url = "https://u:secret@h/NVIDIA-{driver}.run"\n')
    result = check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                       str(config)], 2,
                           r"key 'build.driver_url'.*a user or password in the URL")
    assert "secret" not in result.err + result.out


# -- servers that answer badly or slowly (a socket on 127.0.0.1) ------------------------------

HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\nConnection: close\r\n\r\n"
# A server's answer → the refusal (exit 1, bake-failed). The drips never trip the stall
# timeout of 2 s: only the deadline of 2 s ends them (they used to hang for ever).
BAD_SERVERS: dict[str, tuple[Answer, str]] = {
    "drips-the-body": (drip(HEAD, b"x" * 100000, 0.3),
                       r"not fetched within the deadline of 2 s \(\[download\] deadline"),
    "drips-a-header": (drip(b"HTTP/1.1 200 OK\r\nX-Slow: ", b"y" * 100000, 0.3),
                       r"not fetched within the deadline of 2 s"),
    # http.client's errors, which used to escape as tracebacks
    "bad-status-line": (send(b"garbage\r\n\r\n"),
                        r"the server's answer is not HTTP.*bad status line 'garbage"),
    "header-line-too-long": (send(b"HTTP/1.1 200 OK\r\nX-Long: " + b"z" * 70000 + b"\r\n\r\n"),
                             r"the server's answer is not HTTP.*line"),
    "more-than-100-headers": (send(b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n"),
                              r"the server's answer is not HTTP.*more than 100 headers"),
    "redirect-to-ftp": (send(b"HTTP/1.1 302 Found\r\nLocation: ftp://h/x.raw\r\n"
                              b"Content-Length: 0\r\n\r\n"),
                        r"HTTP 302: a redirect to 'ftp://h/x\.raw' that is not followed"),
    "redirect-with-a-space": (send(b"HTTP/1.1 302 Found\r\nLocation: /a b\r\n"
                                    b"Content-Length: 0\r\n\r\n"),
                              r"HTTP 302: a redirect to '/a b' that is not followed \(.*loop"),
}


@pytest.mark.integration  # a socket on 127.0.0.1
@pytest.mark.parametrize("case", BAD_SERVERS, ids=BAD_SERVERS.keys())
def test_a_server_that_answers_badly_or_slowly_is_refused_within_the_deadline(
        make_host: HostFactory, tmp_path: Path, cli: Cli, case: str) -> None:
    answer, pattern = BAD_SERVERS[case]
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "in")
    with raw_server(answer) as url:
        config = inputs.config(base=url + "/", driver=None, extra="\n[download]\nattempts = 2\n"
                               "timeout = 2\ndeadline = 2\n")
        started = time.monotonic()
        result = check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                           str(config)], 1, pattern)
    assert time.monotonic() - started < 6
    assert result.errors[0]["error_code"] == "bake-failed"


@pytest.mark.integration  # a socket on 127.0.0.1
def test_a_build_download_that_drips_ends_at_its_deadline(tmp_path: Path) -> None:
    """driver.build's fetcher (a [build] and a node's own build): it used to check its
    deadline between 64 KiB reads, which a dripping server never completes."""
    from gpunode.driver.builders import UrlFetcher
    from gpunode.errors import DriverBuildError

    with raw_server(drip(HEAD, b"x" * 100000, 0.3)) as url:
        started = time.monotonic()
        with pytest.raises(DriverBuildError, match="not complete within the deadline of 2 s"):
            UrlFetcher(timeout=2, deadline=2).fetch(url + "/NVIDIA.run", tmp_path / "out")
    assert time.monotonic() - started < 5
    assert list(tmp_path.iterdir()) == []


LONG_NAME = "nvidia-drivers-" + "5" * 5000  # past int()'s conversion limit of 4300 digits


def test_a_driver_name_of_5000_digits_is_refused_not_a_traceback(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    config = make_inputs(tmp_path / "in").config()
    config.write_text(config.read_text().replace('name = "nvidia-drivers-570-open"',
                                                 f'name = "{LONG_NAME}"'))
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  2, r"key 'driver\[1\].name': 'nvidia-drivers-5+' is not a Flatcar driver")
