"""The host boundary: paths resolve inside the root, and writes are atomic and faithful."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.errors import HostError, LockTimeout
from gpunode.platform import safeio
from gpunode.platform.host import Host
from gpunode.platform.integers import MAX_MAJOR, MAX_MINOR, parse_int, parse_uint


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


# -- what the rest of gpunode needs instead of touching files itself ---------------------------


def test_write_atomic_makes_missing_parents_when_asked(root: Path) -> None:
    Host(root).write_atomic("/var/lib/gpunode/state.json", b"{}\n", make_parents=True)
    assert (root / "var/lib/gpunode/state.json").read_bytes() == b"{}\n"


def test_write_atomic_without_make_parents_refuses_a_missing_directory(root: Path) -> None:
    with pytest.raises(HostError, match=r"Failed to write '.*/var/x/f': No such file"):
        Host(root).write_atomic("/var/x/f", b"")
    assert not (root / "var").exists()


def test_write_atomic_streams_chunks_into_place(root: Path) -> None:
    Host(root).write_atomic("/etc/big", (bytes([i]) * 1000 for i in range(5)))
    assert (root / "etc/big").read_bytes() == b"".join(bytes([i]) * 1000 for i in range(5))


def test_an_error_of_the_chunks_passes_through_and_leaves_the_old_file(root: Path) -> None:
    (root / "etc/f").write_bytes(b"old\n")

    def chunks() -> Iterator[bytes]:
        yield b"half"
        raise TimeoutError("the download stalled")

    with pytest.raises(TimeoutError, match="the download stalled"):
        Host(root).write_atomic("/etc/f", chunks())
    assert (root / "etc/f").read_bytes() == b"old\n"
    assert sorted(p.name for p in (root / "etc").iterdir()) == ["f"]


def _fail_directory_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize(("path", "synced"), [
    ("/etc/containerd/config.toml", 2), ("/var/lib/gpunode/containerd.json", 2),
    ("/run/gpunode/state.json", 0), ("/var/run/cdi/nvidia.yaml", 0), ("/runner/x", 2),
    ("/run/../etc/cdi/nvidia.yaml", 2)])
def test_a_file_under_run_is_replaced_atomically_without_fsync(
    root: Path, monkeypatch: pytest.MonkeyPatch, path: str, synced: int
) -> None:
    """/run no crash outlives: its files are replaced as atomically, not made durable; every
    other file and its directory are fsynced."""
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    host = Host(root)
    (root / "run").mkdir(exist_ok=True)
    host.write_atomic(path, b"old\n", make_parents=True)
    host.write_atomic(path, b"new\n")
    assert (root / path.lstrip("/")).read_bytes() == b"new\n"
    assert sorted(p.name for p in (root / path.lstrip("/")).parent.iterdir()) == [
        path.rpartition("/")[2]]
    assert len(calls) == 2 * synced


@pytest.mark.parametrize("op", ["write", "remove", "remove directory", "rename", "remove tree"])
def test_a_failed_directory_sync_is_a_host_error_naming_the_path(
    root: Path, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    (root / "etc/f").write_bytes(b"x")
    (root / "etc/d").mkdir()
    host = Host(root)
    _fail_directory_fsync(monkeypatch)
    act, verb, path = {
        "write": (lambda: host.write_atomic("/etc/f", b"y"), "write", "/etc/f"),
        "remove": (lambda: host.remove("/etc/f"), "remove", "/etc/f"),
        "remove directory": (lambda: host.remove_dir("/etc/d"), "remove directory", "/etc/d"),
        "rename": (lambda: host.rename("/etc/f", "/etc/g"), "rename", "/etc/f"),
        "remove tree": (lambda: host.remove_tree("/etc/d"), "remove", "/etc/d"),
    }[op]
    with pytest.raises(HostError, match=rf"^Failed to {verb} '{root}{path}.*': Input/output "
                       r"error \(syncing its directory\)$"):
        act()


def test_rename_moves_a_directory_and_a_symlink_itself(root: Path) -> None:
    host = Host(root)
    (root / "etc/stage").mkdir()
    (root / "etc/stage/a.ko").write_bytes(b"a")
    (root / "etc/link").symlink_to("/usr/share/containerd")
    host.rename("/etc/stage", "/etc/entry")
    host.rename("/etc/link", "/etc/moved")
    assert (root / "etc/entry/a.ko").read_bytes() == b"a" and not (root / "etc/stage").exists()
    assert os.readlink(root / "etc/moved") == "/usr/share/containerd"
    assert (root / "usr/share/containerd/config.toml").exists()  # the target did not move


def test_rename_of_something_absent_names_both_paths(root: Path) -> None:
    with pytest.raises(HostError, match=rf"^Failed to rename '{root}/etc/a to {root}/etc/b': "
                       "No such file or directory$"):
        Host(root).rename("/etc/a", "/etc/b")


def test_remove_tree_removes_links_inside_without_following_them(root: Path) -> None:
    tree = root / "opt/cache/k"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub/f").write_bytes(b"x")
    (tree / "escape").symlink_to(root / "usr")  # even a link straight at a real directory
    Host(root).remove_tree("/opt/cache/k")
    assert not tree.exists()
    assert (root / "usr/share/containerd/config.toml").exists()


def test_remove_tree_of_a_symlink_removes_only_the_link(root: Path) -> None:
    (root / "etc/k").symlink_to("/usr/share")
    Host(root).remove_tree("/etc/k")
    assert not (root / "etc/k").is_symlink() and (root / "usr/share/containerd").is_dir()


def test_remove_tree_of_something_absent_is_fine(root: Path) -> None:
    Host(root).remove_tree("/opt/never/there")


@pytest.mark.parametrize("algorithm", ["sha256", "sha512"])
def test_digest_is_hashlibs_of_the_content(root: Path, algorithm: str) -> None:
    data = os.urandom(3 * (1 << 20) + 7)  # more than one chunk
    (root / "etc/blob").write_bytes(data)
    assert Host(root).digest("/etc/blob", algorithm) == hashlib.new(algorithm, data).hexdigest()


def test_digest_of_a_fifo_is_refused_without_blocking(root: Path) -> None:
    os.mkfifo(root / "etc/fifo")
    with pytest.raises(HostError, match=r"Failed to read '.*/etc/fifo': is a FIFO"):
        Host(root).digest("/etc/fifo")


def test_digest_of_a_missing_file_is_a_host_error(root: Path) -> None:
    with pytest.raises(HostError, match=r"Failed to read '.*/etc/none': No such file"):
        Host(root).digest("/etc/none")


def test_fsync_takes_files_and_directories_and_names_a_missing_one(root: Path) -> None:
    host = Host(root)
    host.fsync("/usr/share/containerd/config.toml")
    host.fsync("/usr/share/containerd")
    with pytest.raises(HostError, match=r"Failed to sync '.*/etc/none': No such file"):
        host.fsync("/etc/none")


def test_glob_matches_under_the_root_never_the_machines_own_slash(root: Path) -> None:
    (root / "etc/conf.d").mkdir()
    for name in ("a.toml", "b.toml", ".hidden.toml", "c.txt"):
        (root / "etc/conf.d" / name).write_text("")
    (root / "etc/up").symlink_to("/")  # the root's own /, not the machine's
    host = Host(root)
    assert host.glob("/etc/conf.d/*.toml") == [
        "/etc/conf.d/.hidden.toml", "/etc/conf.d/a.toml", "/etc/conf.d/b.toml"]
    assert host.glob("/*") == ["/etc", "/usr"]
    assert host.glob("/etc/up/*") == ["/etc/up/etc", "/etc/up/usr"]
    assert host.glob("/etc/conf.d/none.toml") == []
    assert host.glob("/etc/conf.d/c.txt") == ["/etc/conf.d/c.txt"]


def test_glob_takes_the_callers_matcher(root: Path) -> None:
    (root / "etc/x").write_text("")
    assert Host(root).glob("/etc/?", lambda part, name: name == "x") == ["/etc/x"]


def test_glob_refuses_a_relative_pattern(root: Path) -> None:
    with pytest.raises(HostError, match=r"Failed to glob 'etc/\*': host paths must be absolute"):
        Host(root).glob("etc/*")


def test_a_lock_excludes_another_holder_until_released(root: Path) -> None:
    order: list[str] = []
    first_holds = threading.Event()

    def first() -> None:
        with Host(root).lock("/run/x/lock") as held:
            held.write("first\n")
            first_holds.set()
            time.sleep(0.3)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    assert first_holds.wait(5)
    notes: list[str] = []
    with Host(root).lock("/run/x/lock", on_wait=notes.append):
        order.append("second holds")
    thread.join(5)
    assert order == ["first done", "second holds"]
    assert notes == ["first\n"]  # told once, with the holder's note
    assert stat.S_IMODE((root / "run/x/lock").stat().st_mode) == 0o600


def test_a_lock_waited_for_past_its_bound_names_the_holder(root: Path) -> None:
    host = Host(root)
    with host.lock("/run/x/lock") as held:
        held.write("4242 boot\n")
        assert host.lock_holder("/run/x/lock") == "4242 boot\n"
        started = time.monotonic()
        with pytest.raises(LockTimeout, match=r"^Failed to lock '.*/run/x/lock': another "
                           r"process \(4242 boot\) holds it; gave up after waiting 0.2 s$"
                           ) as info, Host(root).lock("/run/x/lock", wait=0.2):
            pass
        assert time.monotonic() - started >= 0.2
        assert info.value.note == "4242 boot\n"
    assert host.lock_holder("/run/x/lock") is None


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_not_made(root: Path) -> None:
    (root / "run").mkdir()
    (root / "run/lock").symlink_to("/etc/made")
    with pytest.raises(HostError, match="is a symlink, not the lock file"), \
            Host(root).lock("/run/lock"):
        pass
    assert not (root / "etc/made").exists()
    assert Host(root).lock_holder("/run/lock") is None


def test_an_error_inside_a_held_lock_passes_through_as_it_is(root: Path) -> None:
    with pytest.raises(FileNotFoundError), Host(root).lock("/run/lock"):
        raise FileNotFoundError("the block's own")


def test_no_lock_file_has_no_holder_and_is_not_created(root: Path) -> None:
    assert Host(root).lock_holder("/run/gpunode/lock") is None
    assert not (root / "run").exists()


def test_records_of_a_regular_file_are_its_lines(root: Path) -> None:
    (root / "dev").mkdir()
    (root / "dev/kmsg").write_text("6,1,2,-;NVRM: one\n6,2,3,-;two\n")
    assert Host(root).read_records("/dev/kmsg") == ["6,1,2,-;NVRM: one", "6,2,3,-;two"]


def test_records_of_a_fifo_are_refused(root: Path) -> None:
    (root / "dev").mkdir()
    os.mkfifo(root / "dev/kmsg")
    with pytest.raises(HostError, match="is a FIFO, not a record device or a regular file"):
        Host(root).read_records("/dev/kmsg")


def test_connect_reaches_a_listening_socket_under_a_long_root(tmp_path: Path) -> None:
    root = tmp_path / ("r" * 100)  # longer than sun_path's 108 bytes with the socket's name
    (root / "run/containerd").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        directory = os.open(root / "run/containerd", os.O_PATH)
        try:
            server.bind(f"/proc/self/fd/{directory}/containerd.sock")
        finally:
            os.close(directory)
        server.listen(1)
        Host(root).connect("/run/containerd/containerd.sock")


def test_connect_to_nothing_is_a_host_error(root: Path) -> None:
    with pytest.raises(HostError, match=r"Failed to connect to '.*/run/c.sock': No such file"):
        Host(root).connect("/run/c.sock")


NUL_CALLS = {
    "read_text": lambda h, p: h.read_text(p),
    "read_optional": lambda h, p: h.read_optional(p),
    "read_optional_bytes": lambda h, p: h.read_optional_bytes(p),
    "read_chunks": lambda h, p: list(h.read_chunks(p)),
    "digest": lambda h, p: h.digest(p),
    "read_records": lambda h, p: h.read_records(p),
    "read_link": lambda h, p: h.read_link(p),
    "list_dir": lambda h, p: h.list_dir(p),
    "stat": lambda h, p: h.stat(p),
    "lstat": lambda h, p: h.lstat(p),
    "glob": lambda h, p: h.glob(p),
    "write_atomic": lambda h, p: h.write_atomic(p, b"x", make_parents=True),
    "make_dirs": lambda h, p: h.make_dirs(p),
    "make_char_device": lambda h, p: h.make_char_device(p, 195, 0, 0o666),
    "symlink": lambda h, p: h.symlink(p, "/x"),
    "remove": lambda h, p: h.remove(p),
    "remove_dir": lambda h, p: h.remove_dir(p),
    "remove_tree": lambda h, p: h.remove_tree(p),
    "rename from": lambda h, p: h.rename(p, "/etc/b"),
    "rename to": lambda h, p: h.rename("/usr/share/containerd/config.toml", p),
    "fsync": lambda h, p: h.fsync(p),
    "lock": lambda h, p: h.lock(p).__enter__(),
    "lock_holder": lambda h, p: h.lock_holder(p),
    "connect": lambda h, p: h.connect(p),
}


@pytest.mark.parametrize("path", ["/etc/a\0b", "/etc\0/b"], ids=["in-name", "in-parent"])
@pytest.mark.parametrize("call", NUL_CALLS.values(), ids=NUL_CALLS.keys())
def test_every_host_method_refuses_a_path_the_os_cannot_take_with_a_host_error(
    root: Path, call: Any, path: str
) -> None:
    """The OS answers a NUL byte with ValueError, not OSError: each method says HostError."""
    with pytest.raises(HostError, match="a path cannot contain a NUL byte"):
        call(Host(root), path)
    assert (root / "usr/share/containerd/config.toml").exists()


def test_a_directory_entry_the_os_cannot_name_is_a_host_error(root: Path) -> None:
    directory = Host(root).directory("/etc")
    for read in (directory.read, directory.read_link):
        with pytest.raises(HostError, match="a path cannot contain a NUL byte"):
            read("a\0b")
