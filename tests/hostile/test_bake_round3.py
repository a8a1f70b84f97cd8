"""Hostile inputs of `gpunode image bake`, round 3: an image whose small files or links cannot
be written, an os-release whose VERSION is no version, and sources the bake cannot fetch as
written. Each is refused before anything is placed: the image root stays exactly as it was."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from helpers.bake import make_inputs
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
