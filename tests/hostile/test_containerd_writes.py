"""Hostile inputs to containerd configure/revert's writes: damaged ledgers and journals, hard
links, private configs, edits gpunode must keep, a file without a final newline, no system bus.

Refusals go through `check_refusal` (exit 1, one JSON error event naming file and key, every
file as it was, no temp file). Inputs that must now *succeed* assert what the user sees.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.containerd import journal
from gpunode.platform import nodelock
from gpunode.platform.systemd_unit import SYSTEM_UNIT_PATHS
from gpunode_testing import fixtures
from hostile.support import Cli, check_refusal

LEDGER = "var/lib/gpunode/containerd.json"
CRI = ["plugins", "io.containerd.grpc.v1.cri"]


def configured_flatcar(make_host: HostFactory, cli: Cli) -> Path:
    """A Flatcar node gpunode has configured: /etc copy, drop-in, ledger."""
    root = make_host("nc4as-t4-v3", "driver").root
    runtime = root / "usr/bin/nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    assert cli("--root", str(root), "containerd", "configure").code == 0
    return root


def good_ledger(root: Path) -> dict[str, object]:
    return json.loads((root / LEDGER).read_text())  # type: ignore[no-any-return]


def without(key: str) -> Callable[[dict[str, object]], object]:
    return lambda d: {k: v for k, v in d.items() if k != key}


def setting(key: str, value: object) -> Callable[[dict[str, object]], object]:
    return lambda d: {**d, key: value}


def first_change(key: str, value: object) -> Callable[[dict[str, object]], object]:
    def mutate(d: dict[str, object]) -> object:
        changes = [dict(c) for c in d["changes"]]  # type: ignore[attr-defined]
        if value is None:
            del changes[0][key]
        else:
            changes[0][key] = value
        return {**d, "changes": changes}
    return mutate


BAD_LEDGERS: dict[str, tuple[Callable[[dict[str, object]], object] | bytes, str]] = {
    "not-json": (b"{not json", r"containerd\.json: not JSON"),
    "not-utf8": (b"\xff\xfe{}", r"containerd\.json: not JSON"),
    "a-list": (lambda d: [d], r"containerd\.json: not a JSON object"),
    "schema-2": (setting("schema_version", 2), r"key 'schema_version' is 2, expected 1"),
    "missing-target": (without("target"), r"key 'target' is missing"),
    "missing-changes": (without("changes"), r"key 'changes' is missing"),
    "missing-written-sha256": (without("written_sha256"), r"key 'written_sha256' is missing"),
    "missing-copied-from": (without("copied_from"), r"key 'copied_from' is missing"),
    "target-number": (setting("target", 7), r"key 'target' is a number \(7\)"),
    "target-relative": (setting("target", "etc/x.toml"), r"key 'target' .*absolute path"),
    "copied-from-list": (setting("copied_from", []), r"key 'copied_from' is a list"),
    "copied-from-outside-usr": (setting("copied_from", "/etc/shadow"),
                                r"key 'copied_from' must be a file under /usr"),
    "backup-elsewhere": (setting("backup", "/etc/passwd"),
                         r"key 'backup' is '/etc/passwd'; gpunode only writes"),
    "dropin-elsewhere": (setting("dropin", "/etc/fstab"), r"key 'dropin' is '/etc/fstab'"),
    "import-file-number": (setting("import_file", 1), r"key 'import_file' is a number"),
    "added-runtime-true": (setting("added_runtime", True), r"key 'added_runtime' is a boolean"),
    "changes-object": (setting("changes", {}), r"key 'changes' is an object, expected a list"),
    "change-a-string": (setting("changes", ["x"]), r"key 'changes\[0\]' is a string"),
    "change-path-string": (first_change("path", "plugins.x"),
                           r"key 'changes\[0\]\.path' is a string"),
    "change-path-empty": (first_change("path", []), r"key 'changes\[0\]\.path' is a list"),
    "change-without-after": (first_change("after", None), r"key 'changes\[0\]\.after' is missing"),
    "sha-number": (setting("written_sha256", 5), r"key 'written_sha256' is a number"),
    "others-edited-text": (setting("others_edited", "yes"), r"key 'others_edited' is a string"),
    "written-list": (setting("written", []), r"key 'written' is a list"),
    "written-foreign-file": (setting("written", {"/etc/passwd": "0"}),
                             r"key 'written' names '/etc/passwd'"),
    "created-dirs-root": (setting("created_dirs", ["/"]), r"key 'created_dirs' names '/'"),
    "created-dirs-foreign": (setting("created_dirs", ["/home"]),
                             r"key 'created_dirs' names '/home'"),
    "hunks-object": (setting("hunks", {}), r"key 'hunks' is an object"),
    "hunk-without-after": (setting("hunks", [[{"context": [], "before": []}]]),
                           r"key 'hunks\[0\]\[0\]' must have context, before and after"),
}


@pytest.mark.parametrize("command", ["configure", "revert"])
@pytest.mark.parametrize("case", sorted(BAD_LEDGERS))
def test_a_damaged_ledger_is_refused_before_anything_is_written(
    make_host: HostFactory, cli: Cli, case: str, command: str,
) -> None:
    root = configured_flatcar(make_host, cli)
    mutation, pattern = BAD_LEDGERS[case]
    data = mutation if isinstance(mutation, bytes) else json.dumps(
        mutation(good_ledger(root))).encode()
    (root / LEDGER).write_bytes(data)
    extra = ["--enable-cdi"] if command == "configure" else []
    check_refusal(cli, root, ["--root", str(root), "containerd", command, *extra], 1, pattern)


def pending_journal(root: Path, record: object) -> None:
    (root / journal.JOURNAL.lstrip("/")).write_bytes(
        record if isinstance(record, bytes) else json.dumps(record).encode())


BAD_JOURNALS: dict[str, tuple[object, str]] = {
    "not-json": (b"\x00garbage", r"containerd-journal: not JSON"),
    "a-number": (3, r"not a gpunode journal"),
    "files-missing": ({"schema_version": 1, "created_dirs": [], "removed_dirs": []},
                      r"key 'files' must be a list"),
    "relative-path": ({"schema_version": 1, "created_dirs": [], "removed_dirs": [],
                       "files": [{"path": "etc/x", "before": None, "after_sha256": None,
                                  "attrs": None}]}, r"key 'files\[0\]\.path'"),
    "bad-attrs": ({"schema_version": 1, "created_dirs": [], "removed_dirs": [],
                   "files": [{"path": "/etc/x", "before": None, "after_sha256": None,
                              "attrs": [1, "root", 0]}]}, r"key 'files\[0\]\.attrs'"),
    "bad-base64": ({"schema_version": 1, "created_dirs": [], "removed_dirs": [],
                    "files": [{"path": "/etc/containerd/config.toml", "before": "%%%",
                               "after_sha256": None, "attrs": None}]}, r"is not base64"),
    "file-changed-since": ({"schema_version": 1, "created_dirs": [], "removed_dirs": [],
                            "files": [{"path": "/etc/containerd/config.toml", "before": None,
                                       "after_sha256": "0" * 64, "attrs": None}]},
                           r"has been changed by someone else since"),
}


@pytest.mark.parametrize("command", ["configure", "revert"])
@pytest.mark.parametrize("case", sorted(BAD_JOURNALS))
def test_a_journal_that_cannot_be_rolled_back_safely_is_refused(
    make_host: HostFactory, cli: Cli, case: str, command: str,
) -> None:
    root = configured_flatcar(make_host, cli)
    record, pattern = BAD_JOURNALS[case]
    pending_journal(root, record)
    check_refusal(cli, root, ["--root", str(root), "containerd", command], 1, pattern)


@pytest.mark.parametrize("linked", ["config", "ledger"])
def test_a_hard_linked_file_is_refused_naming_its_link_count(
    make_host: HostFactory, cli: Cli, linked: str,
) -> None:
    root = configured_flatcar(make_host, cli)
    path = {"config": root / "etc/containerd/config.toml",
            "ledger": root / LEDGER}[linked]
    os.link(path, root / "srv-second-name")
    command = ["--root", str(root), "containerd", "configure", "--enable-cdi"]
    check_refusal(cli, root, command, 1, rf"{path} has 2 hard links.*a file of its own")


def test_configuring_another_file_than_the_ledger_records_is_refused(
    make_host: HostFactory, cli: Cli,
) -> None:
    root = configured_flatcar(make_host, cli)
    (root / "srv").mkdir()
    (root / "srv/other.toml").write_text("version = 2\n")
    check_refusal(cli, root, ["--root", str(root), "containerd", "configure", "--config",
                              "/srv/other.toml"], 1,
                  r"records changes to /etc/containerd/config.toml, not /srv/other.toml.*"
                  r"'gpunode containerd revert' first")


def test_stale_temp_files_of_gpunodes_own_writes_are_swept_and_no_others(
    make_host: HostFactory, cli: Cli,
) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    (root / "var/lib").mkdir(parents=True)
    (root / "etc/containerd").mkdir(parents=True)
    stale = [root / "var/lib/.gpunode.containerd-journal.k9x2.gpunode-tmp",
             root / "etc/containerd/.config.toml.q1w2.gpunode-tmp"]
    foreign = root / "etc/containerd/.someone-elses.toml.a1.gpunode-tmp"
    for path in [*stale, foreign]:
        path.write_text("half")
    result = cli("--root", str(root), "containerd", "configure", "--force")
    assert result.code == 0, result.err
    assert not any(p.exists() for p in stale)
    assert foreign.exists()


STALE_TEMPS = {  # what a kill inside host.Host's atomic writes leaves, in every directory
    "dev/.nvidia0.0a1b2c3d4e5f.gpunode-tmp": "char",  # make_char_device's temp node
    "dev/.nvidiactl.9f8e7d6c5b4a.gpunode-tmp": "file",
    "dev/char/.195:0.0a1b2c3d4e5f.gpunode-tmp": "link",  # symlink's temp link
    "run/gpunode/.state.json.k2j_x9a1.gpunode-tmp": "file",
    "etc/systemd/system/kubelet.service.d/.20-gpunode-registration.conf.ab12cd34.gpunode-tmp":
        "file",
    "etc/systemd/system/containerd.service.d/.10-gpunode.conf.ab12cd34.gpunode-tmp": "file",
    "var/lib/gpunode/.containerd.json.zz99yy88.gpunode-tmp": "file",
}
NOT_OURS = [  # temp-like names gpunode never writes, a directory, and a symlinked directory
    "dev/.sda.0a1b2c3d4e5f.gpunode-tmp", "dev/char/.not-a-device.aa.gpunode-tmp",
    "etc/systemd/system/kubelet.service.d/.10-kubeadm.conf.ab12cd34.gpunode-tmp",
    "run/gpunode/.state.json.dir.gpunode-tmp/", "srv/.state.json.k2j_x9a1.gpunode-tmp",
]


def test_the_next_boot_sweeps_stale_temps_of_gpunodes_writes_from_every_directory(
    make_host: HostFactory, cli: Cli,
) -> None:
    """Device nodes, /dev/char links, the boot record, the stamp, the kubelet drop-in: a kill
    inside any of their writes leaves a temp that the next boot (holding the node lock) removes;
    nothing else is touched, not even through a symlinked directory."""
    root = make_host("nc4as-t4-v3", "driver").root
    for name, kind in STALE_TEMPS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "char":
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        elif kind == "link":
            path.symlink_to("../nvidia0")
        else:
            path.write_text("half")
    for name in NOT_OURS:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if name.endswith("/") else path.write_text("someone else's")
    (root / "srv/kubelet.service.d").mkdir(parents=True)
    decoy = root / "srv/kubelet.service.d/.20-gpunode-registration.conf.ab12cd34.gpunode-tmp"
    decoy.write_text("not under gpunode's directory")
    linked = root / "etc/flatcar"
    assert not linked.exists()
    linked.symlink_to("../srv/kubelet.service.d")  # a symlinked directory: never swept
    (root / "srv/kubelet.service.d/.enabled-sysext.conf.ab12cd34.gpunode-tmp").write_text("x")
    result = cli("--root", str(root), "boot")
    assert not [p for p in STALE_TEMPS if os.path.lexists(root / p)], result.err
    assert all(os.path.lexists(root / p) for p in NOT_OURS)
    assert decoy.exists()
    assert (root / "srv/kubelet.service.d/.enabled-sysext.conf.ab12cd34.gpunode-tmp").exists()
    (swept,) = [e for e in result.events if e["event"] == "lock.stale_temps_removed"]
    assert len(swept["removed"]) == len(STALE_TEMPS)  # type: ignore[arg-type]


def test_a_dry_run_with_an_interrupted_change_pending_says_so_and_writes_nothing(
    make_host: HostFactory, cli: Cli,
) -> None:
    from hostile.support import assert_unchanged, snapshot

    root = configured_flatcar(make_host, cli)
    pending_journal(root, {"schema_version": 1, "files": [], "created_dirs": [],
                           "removed_dirs": []})
    before = snapshot(root)
    result = cli("--root", str(root), "containerd", "configure", "--enable-cdi", "--dry-run")
    assert result.code == 0, result.err
    assert result.out.startswith(f"# roll back the interrupted change recorded in "
                                 f"{journal.JOURNAL}"), result.out
    assert "computed after the rollback" in result.out
    assert_unchanged(root, before)


def test_revert_after_the_copy_was_removed_removes_the_dropin_too(
    make_host: HostFactory, cli: Cli,
) -> None:
    root = configured_flatcar(make_host, cli)
    (root / "etc/containerd/config.toml").unlink()
    result = cli("--root", str(root), "containerd", "revert")
    assert result.code == 0, result.err
    assert not (root / "etc/systemd/system/containerd.service.d/10-gpunode.conf").exists()
    assert not (root / LEDGER).exists()


def test_a_private_config_of_another_user_stays_private_in_its_backup(
    make_host: HostFactory, cli: Cli,
) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    config = root / "etc/containerd/config.toml"
    config.write_text(fixtures.FLATCAR_CONTAINERD_CONFIG
                      + '[plugins."io.containerd.grpc.v1.cri".registry.configs."r".auth]\n'
                      'password = "s3cret"\n')
    os.chown(config, 1234, 4321)
    os.chmod(config, 0o600)
    result = cli("--root", str(root), "containerd", "configure", "--force")
    assert result.code == 0, result.err
    for path in (config, root / "etc/containerd/config.toml.gpunode-orig"):
        st = path.stat()
        assert (oct(st.st_mode & 0o777), st.st_uid, st.st_gid) == ("0o600", 1234, 4321), path


def test_revert_undoes_only_gpunodes_values_and_keeps_the_rest_byte_for_byte(
    make_host: HostFactory, cli: Cli,
) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    config = root / "etc/containerd/config.toml"
    config.write_text(fixtures.FLATCAR_CONTAINERD_CONFIG)
    assert cli("--root", str(root), "containerd", "configure", "--force").code == 0
    mine = config.read_text().replace("oom_score = -999", "oom_score = -1  # mine")
    config.write_text(mine)  # the user's edit between two configures
    assert cli("--root", str(root), "containerd", "configure", "--force",
               "--set-as-default").code == 0
    config.write_text(config.read_text() + "# trailing note\n")
    result = cli("--root", str(root), "containerd", "revert")
    assert result.code == 0, result.err
    assert config.read_text() == fixtures.FLATCAR_CONTAINERD_CONFIG.replace(
        "oom_score = -999", "oom_score = -1  # mine") + "# trailing note\n"
    assert "keep /etc/containerd/config.toml.gpunode-orig" in result.out


def test_dry_run_diff_marks_a_missing_final_newline(make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    config = root / "etc/containerd/config.toml"
    config.write_text(fixtures.FLATCAR_CONTAINERD_CONFIG.rstrip("\n"))
    result = cli("--root", str(root), "containerd", "configure", "--force", "--enable-cdi",
                 "--dry-run")
    assert result.code == 0, result.err
    assert "-SystemdCgroup = true\n\\ No newline at end of file\n+SystemdCgroup = true\n" in \
        result.out


# -- no system bus: the live host, a private mount namespace -------------------------------------


def in_private_mounts(run: Callable[[], object]) -> object:
    """run() in a forked child with its own mount namespace, tmpfs over /var/lib and /run, so
    that gpunode's ledger and journal (and any lock) on the live host path "/" never reach the
    machine; the result comes back as JSON."""
    import ctypes

    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(reader)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
            for argv in (["mount", "--make-rprivate", "/"],
                         ["mount", "-t", "tmpfs", "gpunode-test", "/var/lib"],
                         ["mount", "-t", "tmpfs", "gpunode-test", "/run"]):
                subprocess.run(argv, check=True, capture_output=True)
            payload = {"ok": run()}
        except BaseException as exc:  # reported to the parent, which fails the test
            payload = {"error": repr(exc)}
        os.write(writer, json.dumps(payload, default=str).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    payload = json.loads(data)
    assert "error" not in payload, payload["error"]
    return payload["ok"]


@pytest.mark.integration
# /run and /var/lib are tmpfs in the child's own mount namespace. On the live root, the lock
# holder also looks for its stale temporary files where it writes (nodelock.WRITTEN), and
# without a bus containerd's unit comes from the unit files.
@pytest.mark.allow_paths("/run", "/var/lib", *(directory for directory, _ in nodelock.WRITTEN),
                         *SYSTEM_UNIT_PATHS)
def test_configure_and_revert_without_a_system_bus_write_the_file_and_exit_0(
    cli: Cli, tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    original = fixtures.FLATCAR_CONTAINERD_CONFIG
    config.write_text(original)
    runtime = tmp_path / "nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    ledger_existed = Path("/var/lib/gpunode/containerd.json").exists()

    def both() -> dict[str, object]:
        configured = cli("containerd", "configure", "--config", str(config),
                         "--runtime-path", str(runtime))
        written = config.read_text()
        ledger = Path("/var/lib/gpunode/containerd.json").exists()
        reverted = cli("containerd", "revert", "--config", str(config))
        return {"codes": [configured.code, reverted.code], "written": written,
                "ledger_in_namespace": ledger, "after": config.read_text(),
                "events": [e["event"] for e in [*configured.events, *reverted.events]],
                "err": configured.err + reverted.err}

    seen: dict[str, object] = in_private_mounts(both)  # type: ignore[assignment]
    assert seen["codes"] == [0, 0], seen["err"]
    assert f'BinaryName = "{runtime}"' in str(seen["written"])
    assert seen["ledger_in_namespace"]
    assert seen["after"] == original
    events = list(seen["events"])  # type: ignore[call-overload]
    assert events.count("containerd.unmanaged") == 2, seen["err"]
    assert "Traceback" not in str(seen["err"])
    assert Path("/var/lib/gpunode/containerd.json").exists() == ledger_existed
    assert not Path(journal.JOURNAL).exists()
    assert sys.platform == "linux"
