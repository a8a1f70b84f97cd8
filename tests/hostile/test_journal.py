"""Hostile undo journals: a damaged /var/lib/gpunode.containerd-journal that names a file or
directory gpunode does not own (/etc/passwd) is refused before anything is written, by the same
path policy as the ledger (ledger.owned_paths); and what `plan` and `--dry-run` say while a
real interrupted change is pending.

Each journal here is crafted so that everything but the path would pass: the foreign file's
`after_sha256` is the digest of what it holds now, exactly what a rollback would overwrite.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.containerd import journal
from gpunode.platform.host import Host
from hostile.support import Cli, check_refusal

CONFIG = "/etc/containerd/config.toml"
PASSWD = "/etc/passwd"


def configured_flatcar(make_host: HostFactory, cli: Cli) -> Path:
    """A Flatcar node gpunode has configured (/etc copy, drop-in, ledger), with an /etc/passwd."""
    root = make_host("nc4as-t4-v3", "driver").root
    runtime = root / "usr/bin/nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    assert cli("--root", str(root), "containerd", "configure").code == 0
    return root


def entry(root: Path, path: str) -> dict[str, object]:
    """A journal entry for `path` whose rollback would write 'pwned' over what it holds now."""
    now = (root / path.lstrip("/")).read_bytes()
    return {"path": path, "before": base64.b64encode(b"pwned\n").decode(),
            "after_sha256": hashlib.sha256(now).hexdigest(), "attrs": [0o644, 0, 0]}


def record(files: list[dict[str, object]], **keys: object) -> dict[str, object]:
    return {"schema_version": 1, "files": files, "created_dirs": [], "removed_dirs": [],
            **keys}


CASES = {
    # A file beside the config's own entries that is not gpunode's to write.
    "a-foreign-file": (lambda r: record([entry(r, CONFIG), entry(r, PASSWD)], target=CONFIG),
                       r"names '/etc/passwd', which is not a file gpunode writes for "
                       r"/etc/containerd/config.toml.*check that file by hand, then remove "
                       r".*gpunode\.containerd-journal"),
    # The journal says it edits /etc/passwd as containerd's config.
    "a-foreign-target": (lambda r: record([entry(r, PASSWD)], target=PASSWD),
                         r"names '/etc/passwd' as the containerd config it edits, which is "
                         r"none that gpunode edits here.*rolls nothing back"),
    # No 'target' key (an older journal): the one config it names is /etc/passwd.
    "an-inferred-foreign-target": (lambda r: record([entry(r, PASSWD)]),
                                   r"'/etc/passwd' as the containerd config it edits, which is "
                                   r"none that gpunode edits here"),
    "a-backup-of-a-foreign-file": (
        lambda r: record([entry(r, CONFIG), {**entry(r, PASSWD), "path": "/etc/passwd"
                                             ".gpunode-orig", "before": None}], target=CONFIG),
        r"names '/etc/passwd.gpunode-orig', which is not a file gpunode writes"),
    "two-targets": (lambda r: record([entry(r, CONFIG), entry(r, PASSWD)]),
                    r"names no single containerd config it edits"),
    "a-relative-target": (lambda r: record([entry(r, CONFIG)], target="etc/x"),
                          r"key 'target' must be an absolute path"),
    "a-foreign-created-dir": (lambda r: record([entry(r, CONFIG)], target=CONFIG,
                                               created_dirs=["/home"]),
                              r"names '/home' in 'created_dirs', which holds no file gpunode "
                              r"writes"),
    "the-root-as-created-dir": (lambda r: record([entry(r, CONFIG)], target=CONFIG,
                                                 created_dirs=["/"]),
                                r"names '/' in 'created_dirs'"),
    "a-foreign-removed-dir": (lambda r: record([entry(r, CONFIG)], target=CONFIG,
                                               removed_dirs=["/opt/evil"]),
                              r"names '/opt/evil' in 'removed_dirs', which holds no file"),
}


@pytest.mark.parametrize("command", ["configure", "revert", "boot"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_journal_naming_a_path_gpunode_does_not_own_is_refused_and_nothing_written(
    make_host: HostFactory, cli: Cli, case: str, command: str,
) -> None:
    root = configured_flatcar(make_host, cli)
    make, pattern = CASES[case]
    (root / journal.JOURNAL.lstrip("/")).write_text(json.dumps(make(root)))
    argv = ["--root", str(root), *(["boot"] if command == "boot" else ["containerd", command])]
    if command == "boot":
        # boot records the failed step (and so writes its boot record): the node's files stay.
        passwd = (root / "etc/passwd").read_bytes()
        result = cli(*argv)
        assert result.code == 1, result.err
        (error,) = [e for e in result.errors if e.get("step") == "containerd"]
        assert re.search(pattern, f"{error['error']} {error['hint']}"), error
        assert (root / "etc/passwd").read_bytes() == passwd
        assert (root / journal.JOURNAL.lstrip("/")).exists()
        return
    check_refusal(cli, root, argv, 1, pattern)


def interrupted_configure(root: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """`containerd configure --enable-cdi` killed right before it writes the ledger."""
    real = Host.write_atomic

    def killed(self: Host, path: str, *args: object, **kwargs: object) -> None:
        if path == "/var/lib/gpunode/containerd.json":
            raise SystemExit(137)  # nothing after this runs, as after a SIGKILL
        real(self, path, *args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(Host, "write_atomic", killed)
        cli("--root", str(root), "containerd", "configure", "--enable-cdi")
    assert (root / journal.JOURNAL.lstrip("/")).exists()


def test_plan_says_boot_rolls_back_a_pending_change_first(
    make_host: HostFactory, cli: Cli, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The files as the kill left them already have CDI on, but boot rolls that back and
    configures again: plan says so instead of "nothing to change"."""
    root = configured_flatcar(make_host, cli)
    interrupted_configure(root, cli, monkeypatch)
    result = cli("--root", str(root), "plan")
    assert result.code == 0, result.err
    assert ("containerd: roll back the interrupted change recorded in "
            "/var/lib/gpunode.containerd-journal (restore /etc/containerd/config.toml)"
            in result.out), result.out
    assert "computed after the rollback" in result.out


def test_dry_run_shows_the_rollback_and_configure_then_does_it(
    make_host: HostFactory, cli: Cli, monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = configured_flatcar(make_host, cli)
    configured = (root / CONFIG.lstrip("/")).read_bytes()
    interrupted_configure(root, cli, monkeypatch)
    dry = cli("--root", str(root), "containerd", "configure", "--dry-run")
    assert dry.code == 0, dry.err
    assert dry.out == ("# roll back the interrupted change recorded in "
                       "/var/lib/gpunode.containerd-journal (restore /etc/containerd/config.toml), "
                       "then configure /etc/containerd/config.toml from the rolled-back files "
                       "(that plan is computed after the rollback)\n")
    result = cli("--root", str(root), "containerd", "configure")
    assert result.code == 0, result.err
    assert [e["event"] for e in result.events].count("containerd.interrupted_change_undone") == 1
    assert (root / CONFIG.lstrip("/")).read_bytes() == configured
    assert not (root / journal.JOURNAL.lstrip("/")).exists()
