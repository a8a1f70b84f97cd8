"""The host boundary: paths resolve inside the root, and writes are atomic and faithful."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import pytest

from gpunode import safeio
from gpunode.errors import HostError
from gpunode.host import Host
from gpunode.integers import MAX_MAJOR, MAX_MINOR, parse_int, parse_uint


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "usr/share/containerd").mkdir(parents=True)
    (tmp_path / "usr/share/containerd/config.toml").write_text("version = 2\n")
    (tmp_path / "etc").mkdir()
    return tmp_path


def test_absolute_symlink_is_followed_inside_the_root(root: Path) -> None:
    (root / "etc/containerd").symlink_to("/usr/share/containerd")
    assert Host(root).read_text("/etc/containerd/config.toml") == "version = 2\n"


def test_relative_symlink_that_climbs_out_of_the_root_is_refused(root: Path) -> None:
    (root / "etc/escape").symlink_to("../../../../../../../../etc/passwd")
    with pytest.raises(HostError, match="climbs above the root"):
        Host(root).read_text("/etc/escape")


def test_symlink_loop_is_refused_not_followed_forever(root: Path) -> None:
    (root / "etc/a").symlink_to("/etc/b")
    (root / "etc/b").symlink_to("/etc/a")
    with pytest.raises(HostError, match="too many levels"):
        Host(root).read_text("/etc/a")


def test_errors_name_the_path_under_the_root(root: Path) -> None:
    with pytest.raises(HostError) as info:
        Host(root).read_text("/etc/missing.toml")
    assert str(info.value) == f"Failed to read '{root}/etc/missing.toml': No such file or directory"


def test_missing_optional_file_reads_as_none(root: Path) -> None:
    assert Host(root).read_optional("/etc/gpunode/config.toml") is None


def test_write_atomic_creates_file_with_requested_mode(root: Path) -> None:
    Host(root).write_atomic("/etc/new.toml", b"a = 1\n", mode=0o600)
    assert (root / "etc/new.toml").read_bytes() == b"a = 1\n"
    assert (root / "etc/new.toml").stat().st_mode & 0o777 == 0o600


def test_write_atomic_keeps_mode_and_owner_of_existing_file(root: Path) -> None:
    target = root / "etc/config.toml"
    target.write_text("old\n")
    target.chmod(0o640)
    if os.geteuid() == 0:
        os.chown(target, 1234, 5678)
    Host(root).write_atomic("/etc/config.toml", b"new\n")
    st = target.stat()
    assert target.read_text() == "new\n"
    assert st.st_mode & 0o777 == 0o640
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (1234, 5678)


def test_write_through_symlink_replaces_the_target_inside_the_root(root: Path) -> None:
    (root / "etc/link.toml").symlink_to("/usr/share/containerd/config.toml")
    Host(root).write_atomic("/etc/link.toml", b"version = 3\n")
    assert (root / "usr/share/containerd/config.toml").read_text() == "version = 3\n"
    assert (root / "etc/link.toml").is_symlink()


def test_failed_write_leaves_original_bytes_and_no_temp_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = root / "etc/config.toml"
    target.write_bytes(b"original\n")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(HostError, match="No space left on device"):
        Host(root).write_atomic("/etc/config.toml", b"new content\n")
    assert target.read_bytes() == b"original\n"
    assert sorted(p.name for p in (root / "etc").iterdir()) == ["config.toml"]


def test_write_refuses_to_replace_a_directory(root: Path) -> None:
    with pytest.raises(HostError, match=r"'.*/usr/share/containerd': is a directory, not a "
                       r"regular file$"):
        Host(root).write_atomic("/usr/share/containerd", b"x")


def test_directory_entries_are_read_without_following_a_final_symlink(root: Path) -> None:
    device = root / "sys/devices/pci0000:00/0000:00:01.0"
    device.mkdir(parents=True)
    (device / "vendor").symlink_to("/etc/passwd")
    with pytest.raises(HostError, match="is a symlink where a file was expected"):
        Host(root).directory("/sys/devices/pci0000:00/0000:00:01.0").read("vendor")


def test_live_host_uses_paths_as_they_are() -> None:
    assert Host().path("/proc/modules") == Path("/proc/modules")


@pytest.mark.parametrize(("text", "value"), [
    ("195", 195), (" 7\n", 7), ("0", 0), ("²", None), ("¹⁹⁵", None), ("٣", None), ("1_000", None),
    ("", None), ("-1", None), ("+1", None), ("0x10", None), ("7\u3000", None), ("9" * 41, None),
])
def test_integers_are_ascii_digits_only(text: str, value: int | None) -> None:
    assert parse_uint(text) == value


def test_integers_above_a_bound_are_refused() -> None:
    assert (parse_uint("4095", MAX_MAJOR), parse_uint("4096", MAX_MAJOR)) == (4095, None)
    assert (parse_uint("1048575", MAX_MINOR), parse_uint("99999999999", MAX_MINOR)) == (
        1048575, None)


@pytest.mark.parametrize(("text", "value"), [("-1", -1), ("3", 3), ("- 1", None), ("-²", None),
                                             ("--1", None), ("-", None)])
def test_signed_integers_take_one_leading_minus(text: str, value: int | None) -> None:
    assert parse_int(text, minimum=-1) == value


def test_a_device_number_the_kernel_cannot_have_is_a_host_error(root: Path) -> None:
    with pytest.raises(HostError, match=r"Failed to create device .*: 195:99999999999 is not a "
                       r"device number"):
        Host(root).make_char_device("/dev/nvidia0", 195, 99999999999, 0o666)
    assert not (root / "dev/nvidia0").exists()


def test_links_and_device_nodes_made_at_once_by_many_callers_all_succeed(root: Path) -> None:
    """Unique temp names: no 'File exists' from a neighbour's temp, and none left behind."""
    errors: list[BaseException] = []

    def work() -> None:
        host = Host(root)
        try:
            for _ in range(20):
                host.symlink("/dev/char/195:255", "../nvidiactl")
                if os.geteuid() == 0:
                    host.make_char_device("/dev/nvidiactl", 195, 255, 0o666)
        except BaseException as exc:  # collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert os.readlink(root / "dev/char/195:255") == "../nvidiactl"
    assert not [p for p in (root / "dev").rglob("*") if p.name.endswith(".gpunode-tmp")]
    if os.geteuid() == 0:
        st = (root / "dev/nvidiactl").lstat()
        assert (stat.S_ISCHR(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev),
                stat.S_IMODE(st.st_mode)) == (True, 195, 255, 0o666)


def test_resolving_for_the_fast_path_matches_the_host(root: Path) -> None:
    (root / "etc/containerd").symlink_to("/usr/share/containerd")
    assert safeio.resolve(str(root), "/etc/containerd/config.toml") == str(
        Host(root).path("/etc/containerd/config.toml"))
    assert safeio.resolve(str(root), "/etc/containerd", follow=False) == f"{root}/etc/containerd"
    (root / "etc/up").symlink_to("../../..")
    with pytest.raises(safeio.Refused, match="climbs above the root"):
        safeio.resolve(str(root), "/etc/up/x")


def test_an_entry_of_no_known_kind_is_named_not_a_regular_file_once() -> None:
    assert safeio.kind(0) == "is not a regular file"
    assert safeio.kind(stat.S_IFIFO) == "is a FIFO, not a regular file"


def test_optional_bytes_are_none_for_a_missing_file_and_the_bytes_otherwise(root: Path) -> None:
    host = Host(root)
    assert host.read_optional_bytes("/etc/absent") is None
    assert host.read_optional_bytes("/usr/share/containerd/config.toml") == b"version = 2\n"


def test_optional_bytes_refuse_a_symlink_to_a_missing_file(root: Path) -> None:
    (root / "etc/dangling").symlink_to("/etc/absent")
    with pytest.raises(HostError, match="is a symlink to a file that does not exist"):
        Host(root).read_optional_bytes("/etc/dangling")


def test_optional_bytes_are_capped_at_the_limit_given(root: Path) -> None:
    (root / "etc/big").write_bytes(b"x" * 65)
    with pytest.raises(HostError, match="is larger than 64 bytes"):
        Host(root).read_optional_bytes("/etc/big", limit=64)


def test_text_that_is_not_utf8_is_refused_naming_its_line_and_byte_offset(root: Path) -> None:
    (root / "etc/x").write_bytes(b"a\nb\n\xff\n")
    with pytest.raises(HostError, match=r"invalid byte 0xff at line 3, byte offset 4\)"):
        Host(root).read_text("/etc/x")
