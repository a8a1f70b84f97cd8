"""The containerd step on fixture hosts: where it writes, what it keeps, when it restarts,
how it rolls back, and what revert undoes. The systemd boundary here is a recording fake;
tests/integration/test_containerd_systemd.py runs the same step against a real systemd, and
tests/integration/test_containerd_step_real.py runs it on a read-only mount, through GNU patch
and through real containerd."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import pytest

from conftest import HostFactory, in_place_host, with_runtime_binary
from gpunode.config import ContainerdConfig
from gpunode.containerd import revert, step
from gpunode.containerd.edit import EditError
from gpunode.containerd.probe import NoProbe
from gpunode.platform import nodelock
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from gpunode_testing import fixtures
from helpers import fake_containerd
from helpers.fake_containerd import RecordingSystemd

CONFIG = ContainerdConfig()


def listen(host: Host) -> None:
    """containerd's socket answering for the rest of the session."""
    SERVERS.append(fake_containerd.listen(host))


SERVERS: list[object] = []




def test_read_only_config_gets_a_writable_copy_and_a_dropin(flatcar: Host) -> None:
    the_plan = step.plan(flatcar, CONFIG, NoSystemd())
    outcome = step.apply(flatcar, the_plan, NoSystemd(), 5)
    assert (outcome.changed, outcome.restarted) == (True, False)
    copy = (flatcar.root / "etc/containerd/config.toml").read_text()
    assert copy.startswith(fixtures.FLATCAR_CONTAINERD_CONFIG)
    assert "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]" in copy
    dropin = (flatcar.root / "etc/systemd/system/containerd.service.d/10-gpunode.conf")
    assert dropin.read_text().endswith(
        "[Service]\nEnvironment=CONTAINERD_CONFIG=/etc/containerd/config.toml\n")
    assert (flatcar.root / "usr/share/containerd/config.toml").read_text() == \
        fixtures.FLATCAR_CONTAINERD_CONFIG


def test_second_run_writes_nothing_and_restarts_nothing(flatcar: Host) -> None:
    step.apply(flatcar, step.plan(flatcar, CONFIG, NoSystemd()), NoSystemd(), 5)
    files = {p: p.stat().st_mtime_ns for p in flatcar.root.rglob("*") if p.is_file()}
    fake = RecordingSystemd(host=flatcar)
    the_plan = step.plan(flatcar, CONFIG, NoSystemd())
    outcome = step.apply(flatcar, the_plan, fake, 5)
    assert not the_plan.changed
    assert (outcome.changed, outcome.restarted, fake.calls) == (False, False, [])
    assert {p: p.stat().st_mtime_ns for p in flatcar.root.rglob("*") if p.is_file()} == files


def test_config_in_etc_is_edited_in_place_with_a_backup_kept_once(
    make_host: HostFactory,
) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    original = fixtures.FLATCAR_CONTAINERD_CONFIG
    target.write_text(original)
    os.chmod(target, 0o640)
    step.apply(host, step.plan(host, CONFIG, NoSystemd()), NoSystemd(), 5)
    assert (host.root / "etc/containerd/config.toml.gpunode-orig").read_text() == original
    assert target.stat().st_mode & 0o777 == 0o640
    again = ContainerdConfig(enable_cdi=True)
    step.apply(host, step.plan(host, again, NoSystemd()), NoSystemd(), 5)
    assert (host.root / "etc/containerd/config.toml.gpunode-orig").read_text() == original


def test_restart_happens_once_only_when_containerd_runs(flatcar: Host) -> None:
    listen(flatcar)
    fake = RecordingSystemd(host=flatcar)
    outcome = step.apply(flatcar, step.plan(flatcar, CONFIG, NoSystemd()), fake, 5)
    assert outcome.restarted
    assert fake.calls == ["daemon-reload", "restart containerd.service"]


def test_containerd_not_running_is_not_started(flatcar: Host) -> None:
    fake = RecordingSystemd(state="inactive", host=flatcar)
    outcome = step.apply(flatcar, step.plan(flatcar, CONFIG, NoSystemd()), fake, 5)
    assert (outcome.changed, outcome.restarted) == (True, False)
    assert fake.calls == ["daemon-reload"]


def test_failed_restart_restores_every_file_and_restarts_again(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    listen(host)
    target = host.root / "etc/containerd/config.toml"
    before = target.read_bytes()
    fake = RecordingSystemd(host=host, broken={"enable_cdi"})
    the_plan = step.plan(host, ContainerdConfig(enable_cdi=True), NoSystemd())
    with pytest.raises(step.ContainerdStepError, match="previous config was restored and "
                       "containerd is running with it again"):
        step.apply(host, the_plan, fake, 5)
    assert target.read_bytes() == before
    assert not (host.root / "var/lib/gpunode/containerd.json").exists()
    assert fake.calls == ["restart containerd.service", "restart containerd.service"]


def test_missing_runtime_binary_is_refused_unless_forced(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    with pytest.raises(step.ContainerdStepError, match="is not an executable file"):
        step.plan(host, CONFIG, NoSystemd())
    assert step.plan(host, CONFIG, NoSystemd(), force=True).changed


def test_existing_unrelated_etc_config_is_not_overwritten(flatcar: Host) -> None:
    (flatcar.root / "etc/containerd").mkdir(parents=True)
    (flatcar.root / "etc/containerd/config.toml").write_text("version = 2\n# someone's\n")
    with pytest.raises(step.ContainerdStepError, match="will not overwrite it"):
        step.plan(flatcar, CONFIG, NoSystemd())


@pytest.mark.parametrize("content", [b"\xff\xfe garbage", b"", b"version = 2\nversion = 3\n",
                                     b"[plugins\n"], ids=["bytes", "empty", "dup", "unclosed"])
def test_bad_config_leaves_every_file_untouched(make_host: HostFactory, content: bytes) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    target.write_bytes(content)
    before = {p: p.read_bytes() for p in host.root.rglob("*") if p.is_file()}
    try:
        the_plan = step.plan(host, CONFIG, NoSystemd())
        step.apply(host, the_plan, NoSystemd(), 5)
    except (EditError, step.ContainerdStepError):
        pass
    else:
        assert content == b"", "only an empty file is a valid (v1) config"
        return
    assert {p: p.read_bytes() for p in host.root.rglob("*") if p.is_file()} == before


def test_disk_full_while_writing_leaves_the_config_byte_identical(
    make_host: HostFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    target.write_text(fixtures.FLATCAR_CONTAINERD_CONFIG)
    before = target.read_bytes()
    the_plan = step.plan(host, CONFIG, NoSystemd())
    real_fsync = os.fsync
    calls = {"n": 0}

    def fsync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the backup is written; the config write runs out of space
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(Exception, match="No space left on device"):
        step.apply(host, the_plan, NoSystemd(), 5)
    assert target.read_bytes() == before
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".gpunode-tmp")]


def test_revert_of_a_writable_copy_removes_the_copy_and_the_dropin(flatcar: Host) -> None:
    step.apply(flatcar, step.plan(flatcar, CONFIG, NoSystemd()), NoSystemd(), 5)
    outcome = revert.revert(flatcar, NoSystemd(), 5)
    assert outcome.changed
    assert not (flatcar.root / "etc/containerd/config.toml").exists()
    assert not (flatcar.root / "etc/systemd/system/containerd.service.d/10-gpunode.conf").exists()
    assert not (flatcar.root / "var/lib/gpunode/containerd.json").exists()


def test_revert_of_an_in_place_edit_restores_the_bytes(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    text = "# mine\n" + fixtures.FLATCAR_CONTAINERD_CONFIG
    target.write_text(text)
    step.apply(host, step.plan(host, ContainerdConfig(set_as_default=True), NoSystemd()),
               NoSystemd(), 5)
    revert.revert(host, NoSystemd(), 5)
    assert target.read_text() == text
    assert not (host.root / "etc/containerd/config.toml.gpunode-orig").exists()


def test_revert_after_someone_else_edited_keeps_their_change(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    target.write_text(fixtures.FLATCAR_CONTAINERD_CONFIG)
    step.apply(host, step.plan(host, CONFIG, NoSystemd()), NoSystemd(), 5)
    target.write_text(target.read_text().replace("oom_score = -999", "oom_score = -500"))
    revert.revert(host, NoSystemd(), 5)
    after = target.read_text()
    assert "oom_score = -500" in after
    assert "runtimes.nvidia" not in after


def test_revert_of_another_file_than_gpunode_changed_is_refused(flatcar: Host) -> None:
    step.apply(flatcar, step.plan(flatcar, CONFIG, NoSystemd()), NoSystemd(), 5)
    with pytest.raises(step.ContainerdStepError, match=re.escape(
            "gpunode changed /etc/containerd/config.toml, not /srv/other.toml")):
        revert.revert(flatcar, NoSystemd(), 5, "/srv/other.toml")


def test_revert_without_ledger_does_nothing(flatcar: Host) -> None:
    outcome = revert.revert(flatcar, NoSystemd(), 5)
    assert not outcome.changed


def test_plain_exec_start_gets_an_exec_start_override(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver"))
    unit = host.root / "usr/lib/systemd/system/containerd.service"
    unit.write_text(unit.read_text().replace(
        "--config ${CONTAINERD_CONFIG}",
        "--config /usr/share/containerd/config.toml --log-level info"))
    the_plan = step.plan(host, CONFIG, NoSystemd())
    assert the_plan.dropin_text is not None
    assert the_plan.dropin_text.endswith(
        "ExecStart=\nExecStart=/usr/bin/containerd --config /etc/containerd/config.toml "
        "--log-level info\n")


def test_dry_run_diff_shows_the_copy_against_its_original(flatcar: Host) -> None:
    diff = step.plan(flatcar, CONFIG, NoSystemd()).diff()
    assert diff.startswith("--- /usr/share/containerd/config.toml\n+++ /etc/containerd/config.toml")
    assert "+BinaryName = \"/usr/bin/nvidia-container-runtime\"" in diff
    assert "+++ /etc/systemd/system/containerd.service.d/10-gpunode.conf" in diff


def test_ledger_records_what_was_done(flatcar: Host) -> None:
    step.apply(flatcar, step.plan(flatcar, ContainerdConfig(enable_cdi=True), NoSystemd()),
               NoSystemd(), 5)
    ledger = json.loads((flatcar.root / "var/lib/gpunode/containerd.json").read_text())
    assert ledger["copied_from"] == "/usr/share/containerd/config.toml"
    assert ledger["added_runtime"] == "nvidia"
    cri = ["plugins", "io.containerd.grpc.v1.cri"]
    assert ledger["changes"] == [
        {"path": [*cri, "containerd", "runtimes", "nvidia"], "before": None,
         "after": {"runtime_type": "io.containerd.runc.v2",  # runc's own is left to defaults
                   "options": {"SystemdCgroup": True,
                               "BinaryName": "/usr/bin/nvidia-container-runtime"}}},
        {"path": [*cri, "enable_cdi"], "before": None, "after": True}]


@dataclass
class VersionProbe(NoProbe):
    """A containerd that reports `reported` and cannot dump (the file's own runc is copied)."""

    reported: tuple[int, int] | None

    def version(self, binary: str) -> tuple[int, int] | None:
        return self.reported

    def dump(self, binary: str, path: str) -> None:
        return None


def etc_config_host(make_host: HostFactory) -> Host:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    (host.root / "etc/containerd/config.toml").write_text(fixtures.FLATCAR_CONTAINERD_CONFIG)
    return host


def test_dropin_mode_writes_an_imported_file_on_containerd_2_1(make_host: HostFactory) -> None:
    host = etc_config_host(make_host)
    config = ContainerdConfig(mode="drop-in")
    the_plan = step.plan(host, config, NoSystemd(), probe=VersionProbe((2, 1)))
    step.apply(host, the_plan, NoSystemd(), 5)
    main = (host.root / "etc/containerd/config.toml").read_text()
    imported = (host.root / "etc/containerd/conf.d/99-gpunode-nvidia.toml").read_text()
    assert 'imports = ["/etc/containerd/conf.d/99-gpunode-nvidia.toml"]' in main
    assert "runtimes.nvidia" not in main
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in imported
    again = step.plan(host, config, NoSystemd(), probe=VersionProbe((2, 1)))
    assert not again.changed
    revert.revert(host, NoSystemd(), 5)
    assert (host.root / "etc/containerd/config.toml").read_text() == \
        fixtures.FLATCAR_CONTAINERD_CONFIG
    assert not (host.root / "etc/containerd/conf.d/99-gpunode-nvidia.toml").exists()


@pytest.mark.parametrize(("reported", "reason"), [
    ((1, 7), "containerd 1.7 lets an imported file replace the main file's whole CRI plugin "
             "table"),
    ((2, 0), "containerd 2.0 lets an imported file replace"),
    (None, "is unknown"),
], ids=["1.7", "2.0", "unknown"])
def test_dropin_mode_falls_back_to_in_place_with_the_reason_logged(
    make_host: HostFactory, capsys: pytest.CaptureFixture[str],
    reported: tuple[int, int] | None, reason: str,
) -> None:
    host = etc_config_host(make_host)
    the_plan = step.plan(host, ContainerdConfig(mode="drop-in"), NoSystemd(),
                         probe=VersionProbe(reported))
    assert the_plan.import_text is None
    assert the_plan.edit.added_runtime == "nvidia"  # in place
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    (refusal,) = [e for e in events if e["event"] == "containerd.dropin_refused"]
    assert reason in refusal["reason"]
    assert refusal["fallback"] == "in-place"


def test_config_that_is_a_symlink_out_of_the_root_is_refused(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    target.unlink()
    target.symlink_to("../../../../../../../../../etc/containerd/config.toml")
    with pytest.raises(step.ContainerdStepError, match="a symlink climbs above the root"):
        step.plan(host, CONFIG, NoSystemd())
    assert target.is_symlink()


# -- the write protocol: any prefix of a transaction is rolled back ------------------------------


class Crash(BaseException):
    """A SIGKILL at this point: nothing after it runs, no handler sees it."""


def crash_at(monkeypatch: pytest.MonkeyPatch, k: int) -> list[str]:
    """Make the k-th file operation of Host "kill" the process (a write leaves its temp file)."""
    calls: list[str] = []
    real = {name: getattr(Host, name) for name in ("write_atomic", "remove", "make_dirs",
                                                   "remove_dir")}

    def wrap(name: str):  # type: ignore[no-untyped-def]
        def operation(self: Host, path: str, *args: object, **kwargs: object) -> object:
            calls.append(f"{name} {path}")
            if len(calls) == k:
                if name == "write_atomic":
                    real_path = self.path(path)
                    if real_path.parent.exists():
                        (real_path.parent / f".{real_path.name}.x1y2.gpunode-tmp").write_text("")
                raise Crash(f"killed at {name} {path}")
            return real[name](self, path, *args, **kwargs)
        return operation

    for name in real:
        monkeypatch.setattr(Host, name, wrap(name))
    return calls


def layout_host(make_host: HostFactory, layout: str) -> tuple[Host, ContainerdConfig, VersionProbe]:
    if layout == "flatcar-copy":
        return with_runtime_binary(make_host("nc4as-t4-v3", "driver")), CONFIG, VersionProbe(None)
    host = etc_config_host(make_host)  # a drop-in (not gpunode's) points containerd there
    if layout == "in-place":
        return host, ContainerdConfig(enable_cdi=True), VersionProbe(None)
    return host, ContainerdConfig(mode="drop-in"), VersionProbe((2, 1))


def configure_now(host: Host, config: ContainerdConfig, probe: VersionProbe) -> None:
    """What `containerd configure` does: takes the node lock (which sweeps stale temps), rolls
    an interrupted change back, plans and applies."""
    with nodelock.held(host, "containerd configure", 1):
        step.recover(host, NoSystemd())
        step.apply(host, step.plan(host, config, NoSystemd(), probe=probe), NoSystemd(), 5)


@pytest.mark.parametrize("command", ["configure", "revert"])
@pytest.mark.parametrize("layout", ["flatcar-copy", "in-place", "drop-in"])
def test_a_kill_after_any_step_of_the_write_is_rolled_back_by_the_next_run(
    make_host: HostFactory, monkeypatch: pytest.MonkeyPatch, layout: str, command: str,
) -> None:
    """Every prefix of configure's and revert's file operations, cut by a kill (and a temp file
    left inside the write it hit): the next configure gives the configured node, the next revert
    the untouched one, file for file, mode and owner included, no temp file left."""
    from hostile.support import snapshot

    host, config, probe = layout_host(make_host, layout)
    (host.root / "var/lib").mkdir(parents=True, exist_ok=True)
    with nodelock.held(host, "containerd configure", 1):
        pass  # the lock file stays: part of the node from here on
    pristine = snapshot(host.root)
    configure_now(host, config, probe)
    configured = snapshot(host.root)
    revert.revert(host, NoSystemd(), 5)
    assert snapshot(host.root) == pristine
    k = 1
    while True:
        if command == "revert":
            configure_now(host, config, probe)
        with monkeypatch.context() as patch:
            calls = crash_at(patch, k)
            try:
                if command == "configure":
                    configure_now(host, config, probe)
                else:
                    revert.revert(host, NoSystemd(), 5)
            except Crash:
                pass
            else:
                break
        configure_now(host, config, probe)
        assert snapshot(host.root) == configured, (k, calls)
        revert.revert(host, NoSystemd(), 5)
        assert snapshot(host.root) == pristine, (k, calls)
        k += 1
    assert k > 4, calls  # the journal, the files, the ledger, the commit were each cut


def interrupt_before_the_dropin(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A configure on the Flatcar layout killed after the copy, before the drop-in."""
    real = Host.write_atomic

    def killed_at_the_dropin(self: Host, path: str, *args: object, **kwargs: object) -> None:
        if path == step.DROPIN:
            raise Crash("killed before the drop-in was written")
        real(self, path, *args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(Host, "write_atomic", killed_at_the_dropin)
        with pytest.raises(Crash):
            configure_now(host, CONFIG, VersionProbe(None))


def test_an_interrupted_change_is_not_rolled_back_over_someone_elses_edit(
    flatcar: Host, monkeypatch: pytest.MonkeyPatch,
) -> None:
    interrupt_before_the_dropin(flatcar, monkeypatch)
    copy = flatcar.root / "etc/containerd/config.toml"
    copy.write_text("version = 2\n# mine now\n")
    with pytest.raises(step.ContainerdStepError, match="has been changed by someone else since"):
        step.recover(flatcar, NoSystemd())
    assert copy.read_text() == "version = 2\n# mine now\n"


def test_a_failed_write_puts_every_file_back_at_once(
    make_host: HostFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error inside the transaction (not a kill) rolls it back before the error is shown."""
    from gpunode.errors import HostError
    from hostile.support import snapshot

    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver"))  # no /var at all
    before = snapshot(host.root)
    real = Host.write_atomic

    def failing(self: Host, path: str, *args: object, **kwargs: object) -> None:
        if path == step.DROPIN:
            raise HostError("write", path, "No space left on device")
        real(self, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Host, "write_atomic", failing)
    with pytest.raises(HostError, match="No space left"):
        step.apply(host, step.plan(host, CONFIG, NoSystemd()), NoSystemd(), 5)
    assert snapshot(host.root) == before


# -- modes and owners ----------------------------------------------------------------------------


def test_backup_keeps_the_configs_private_mode_and_owner(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    target.write_text(fixtures.FLATCAR_CONTAINERD_CONFIG + '# registry password = "s3cret"\n')
    os.chown(target, 1234, 4321)
    os.chmod(target, 0o600)
    step.apply(host, step.plan(host, CONFIG, NoSystemd()), NoSystemd(), 5)
    for path in (target, host.root / "etc/containerd/config.toml.gpunode-orig"):
        st = path.stat()
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o600, 1234, 4321), path
    ledger = (host.root / "var/lib/gpunode/containerd.json").stat()
    assert ledger.st_mode & 0o777 == 0o600


def test_writable_copy_and_imported_file_keep_their_sources_mode_and_owner(
    make_host: HostFactory,
) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver"))
    original = host.root / "usr/share/containerd/config.toml"
    os.chown(original, 1234, 4321)
    os.chmod(original, 0o640)
    step.apply(host, step.plan(host, CONFIG, NoSystemd()), NoSystemd(), 5)
    st = (host.root / "etc/containerd/config.toml").stat()
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o640, 1234, 4321)

    other = etc_config_host(make_host)
    main = other.root / "etc/containerd/config.toml"
    os.chown(main, 1234, 4321)
    os.chmod(main, 0o600)
    step.apply(other, step.plan(other, ContainerdConfig(mode="drop-in"), NoSystemd(),
                                probe=VersionProbe((2, 1))), NoSystemd(), 5)
    st = (other.root / "etc/containerd/conf.d/99-gpunode-nvidia.toml").stat()
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o600, 1234, 4321)


def test_hard_linked_config_is_refused_with_its_link_count(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    target = host.root / "etc/containerd/config.toml"
    os.link(target, host.root / "etc/containerd/config-link.toml")
    with pytest.raises(step.ContainerdStepError, match=re.escape(
            f"{target} has 2 hard links")) as refused:
        step.plan(host, ContainerdConfig(enable_cdi=True), NoSystemd())
    assert "a file of its own" in refused.value.hint


# -- revert undoes only gpunode's values ---------------------------------------------------------


def test_revert_keeps_edits_made_between_two_configures(make_host: HostFactory) -> None:
    host, target = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    step.apply(host, step.plan(host, CONFIG, NoSystemd()), NoSystemd(), 5)
    target.write_text(target.read_text().replace("oom_score = -999", "oom_score = -500"))
    step.apply(host, step.plan(host, ContainerdConfig(enable_cdi=True), NoSystemd()),
               NoSystemd(), 5)
    outcome = revert.revert(host, NoSystemd(), 5)
    assert target.read_text() == fixtures.FLATCAR_CONTAINERD_CONFIG.replace(
        "oom_score = -999", "oom_score = -500")
    backup = host.root / "etc/containerd/config.toml.gpunode-orig"
    assert backup.read_text() == fixtures.FLATCAR_CONTAINERD_CONFIG
    assert any(line.startswith("keep /etc/containerd/config.toml.gpunode-orig: ")
               for line in outcome.descriptions)


def test_revert_keeps_a_runtime_whose_values_were_changed_and_says_so(
    make_host: HostFactory,
) -> None:
    host, target = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    step.apply(host, step.plan(host, CONFIG, NoSystemd()), NoSystemd(), 5)
    edited = target.read_text().replace('BinaryName = "/usr/bin/nvidia-container-runtime"',
                                        'BinaryName = "/opt/my/runtime"')
    target.write_text(edited)
    outcome = revert.revert(host, NoSystemd(), 5)
    assert target.read_text() == edited
    assert any("kept the table" in line and "options.BinaryName" in line
               for line in outcome.descriptions), outcome.descriptions


def test_revert_keeps_a_comment_added_after_gpunodes_block(make_host: HostFactory) -> None:
    host, target = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    step.apply(host, step.plan(host, CONFIG, NoSystemd()), NoSystemd(), 5)
    target.write_text(target.read_text() + "# my own note, last line\n")
    outcome = revert.revert(host, NoSystemd(), 5)
    assert target.read_text() == fixtures.FLATCAR_CONTAINERD_CONFIG + "# my own note, last line\n"
    # the backup is a safety copy: it differs from the reverted file, so it stays, and is named
    assert (host.root / "etc/containerd/config.toml.gpunode-orig").exists()
    assert any(line.startswith("keep /etc/containerd/config.toml.gpunode-orig")
               for line in outcome.descriptions)


def test_revert_removes_only_the_import_gpunode_added(make_host: HostFactory) -> None:
    host = etc_config_host(make_host)
    step.apply(host, step.plan(host, ContainerdConfig(mode="drop-in"), NoSystemd(),
                               probe=VersionProbe((2, 1))), NoSystemd(), 5)
    target = host.root / "etc/containerd/config.toml"
    target.write_text(target.read_text().replace(
        'imports = ["/etc/containerd/conf.d/99-gpunode-nvidia.toml"]',
        'imports = ["/etc/containerd/conf.d/99-gpunode-nvidia.toml", "/etc/mine.toml"]'))
    revert.revert(host, NoSystemd(), 5)
    assert 'imports = ["/etc/mine.toml"]' in target.read_text()
    assert not (host.root / "etc/containerd/conf.d").exists()  # gpunode made it; now empty


def test_revert_removes_the_directories_it_created_once_empty(flatcar: Host) -> None:
    step.apply(flatcar, step.plan(flatcar, CONFIG, NoSystemd()), NoSystemd(), 5)
    (flatcar.root / "etc/containerd/mine.toml").write_text("")
    outcome = revert.revert(flatcar, NoSystemd(), 5)
    assert not (flatcar.root / "etc/systemd/system/containerd.service.d").exists()
    assert not (flatcar.root / "var/lib/gpunode").exists()
    assert (flatcar.root / "etc/containerd/mine.toml").exists()  # not empty: kept
    assert "remove /var/lib/gpunode (gpunode created it; now empty)" in outcome.descriptions


def test_revert_of_an_edited_copy_keeps_it_and_its_dropin(flatcar: Host) -> None:
    step.apply(flatcar, step.plan(flatcar, CONFIG, NoSystemd()), NoSystemd(), 5)
    copy = flatcar.root / "etc/containerd/config.toml"
    copy.write_text(copy.read_text().replace("oom_score = -999", "oom_score = -1"))
    outcome = revert.revert(flatcar, NoSystemd(), 5)
    assert copy.read_text() == fixtures.FLATCAR_CONTAINERD_CONFIG.replace(
        "oom_score = -999", "oom_score = -1")
    assert (flatcar.root / "etc/systemd/system/containerd.service.d/10-gpunode.conf").exists()
    assert any(line.startswith("keep /etc/containerd/config.toml and ")
               for line in outcome.descriptions)


def test_status_names_an_interrupted_change_until_the_next_configure_rolls_it_back(
    flatcar: Host, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpunode.config import AgentConfig
    from gpunode.status import evaluate, observe

    interrupt_before_the_dropin(flatcar, monkeypatch)

    def runtime_check() -> tuple[str, str, str | None]:
        c = next(c for c in evaluate(observe(flatcar, AgentConfig())).checks
                 if c.name == "containerd_runtime")
        return c.state, c.detail, c.hint

    state, detail, hint = runtime_check()
    assert state in ("warn", "fail")
    assert "an interrupted gpunode change to containerd's config is pending" in detail
    assert hint is not None and "rolls the interrupted change back first" in hint
    configure_now(flatcar, CONFIG, VersionProbe(None))
    assert "interrupted" not in runtime_check()[1]


def test_a_failed_restart_on_flatcar_leaves_the_tree_as_it_was_no_empty_directory(
    flatcar: Host,
) -> None:
    """The copy's directory and the drop-in's, made by the change, go with its rollback."""
    from hostile.support import snapshot

    listen(flatcar)
    (flatcar.root / "var/lib").mkdir(parents=True, exist_ok=True)
    assert not (flatcar.root / "etc/systemd/system/containerd.service.d").exists()
    before = snapshot(flatcar.root)
    fake = RecordingSystemd(host=flatcar, broken={"nvidia"})
    with pytest.raises(step.ContainerdStepError, match="previous config was restored"):
        step.configure(flatcar, CONFIG, fake, 5)
    assert snapshot(flatcar.root) == before
    assert fake.calls.count("restart containerd.service") == 2


def test_status_says_a_change_is_running_now_while_a_gpunode_command_holds_the_lock(
    flatcar: Host, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpunode.config import AgentConfig
    from gpunode.status import evaluate, observe

    real = Host.write_atomic
    seen: list[tuple[str, str, str | None]] = []

    def status_at_the_dropin(self: Host, path: str, *args: object, **kwargs: object) -> None:
        if path == step.DROPIN and not seen:
            c = next(c for c in evaluate(observe(flatcar, AgentConfig())).checks
                     if c.name == "containerd_runtime")
            seen.append((c.state, c.detail, c.hint))
        real(self, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Host, "write_atomic", status_at_the_dropin)
    configure_now(flatcar, CONFIG, VersionProbe(None))
    ((state, detail, hint),) = seen
    assert state in ("warn", "fail"), detail
    assert re.search(rf"a gpunode command \(pid {os.getpid()}, gpunode containerd configure\) "
                     "is changing containerd's config right now", detail), detail
    assert hint is not None and "wait for it to finish" in hint


def test_the_lock_probe_creates_no_lock_file_and_sees_no_holder_when_none(flatcar: Host) -> None:
    assert nodelock.probe(flatcar) is None
    assert not (flatcar.root / "run/gpunode/lock").exists()
    with nodelock.held(flatcar, "boot", 1):
        assert nodelock.probe(flatcar) == f"pid {os.getpid()}, gpunode boot"
    assert nodelock.probe(flatcar) is None
