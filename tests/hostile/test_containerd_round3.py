"""Hostile containerd cases, round 3: TOML values JSON has no form for, in the runtime table
gpunode copies (its ledger used to fail with 'Object of type datetime is not JSON
serializable'), and a boot killed before its ledger names every directory it made."""

from __future__ import annotations

import pytest

from conftest import HostFactory, with_runtime_binary
from hostile.support import Cli, assert_unchanged, snapshot

CONFIG = "/etc/containerd/config.toml"
CRI_V2 = 'plugins."io.containerd.grpc.v1.cri"'
ACTIVE = "/usr/share/containerd/config.toml"  # what the fixture's containerd.service reads
RUNC = f'[{CRI_V2}.containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n'

# A value TOML has and JSON has not, under runc's options → what gpunode's nvidia copy holds.
ODD_VALUES = {
    "offset-datetime": ("When = 1979-05-27T07:32:00Z", "When = 1979-05-27T07:32:00Z"),
    "local-datetime": ("When = 1979-05-27T07:32:00.999999", "When = 1979-05-27T07:32:00.999999"),
    "local-date": ("Day = 1979-05-27", "Day = 1979-05-27"),
    "local-time": ("At = 07:32:00", "At = 07:32:00"),
    "datetime-in-a-list": ("Times = [1979-05-27T07:32:00-08:00, 1980-01-01]",
                           "1979-05-27T07:32:00-08:00"),
    "infinity": ("Limit = inf", "Limit = inf"),
}


@pytest.mark.parametrize("case", ODD_VALUES, ids=ODD_VALUES.keys())
def test_a_runtime_table_with_a_value_json_lacks_is_configured_and_reverted(
        make_host: HostFactory, cli: Cli, case: str) -> None:
    value, copied = ODD_VALUES[case]
    body = (f'version = 2\n[{CRI_V2}.containerd.runtimes.runc]\n'
            f'runtime_type = "io.containerd.runc.v2"\n'
            f'[{CRI_V2}.containerd.runtimes.runc.options]\nSystemdCgroup = true\n{value}\n')
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: body})
    before = snapshot(host.root)
    argv = ["--root", str(host.root), "containerd"]
    configured = cli(*argv, "configure", "--config", CONFIG, "--force")
    assert configured.code == 0, configured.err
    text = (host.root / CONFIG.lstrip("/")).read_text()
    assert text.count(copied) == 2, text  # runc's and the nvidia runtime's copy
    reverted = cli(*argv, "revert")
    assert reverted.code == 0, reverted.err
    assert_unchanged(host.root, before)


def test_a_boot_copies_a_runtime_table_with_a_datetime(make_host: HostFactory,
                                                      cli: Cli) -> None:
    """boot's containerd step writes the same ledger (it used to fail there too)."""
    body = (f'version = 2\n[{CRI_V2}.containerd.runtimes.runc]\n'
            f'runtime_type = "io.containerd.runc.v2"\n'
            f'[{CRI_V2}.containerd.runtimes.runc.options]\nWhen = 1979-05-27T07:32:00Z\n')
    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver", extra={ACTIVE: body}))
    result = cli("--root", str(host.root), "boot")
    assert result.code == 0, result.err
    ledger = (host.root / "var/lib/gpunode/containerd.json").read_text()
    assert '"$toml": "datetime"' in ledger


class Killed(BaseException):
    """The process dies here (SIGKILL): nothing after it runs, no handler, no cleanup."""


def test_a_configure_killed_before_its_journal_is_written_leaves_no_var_lib(
        make_host: HostFactory, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a root without /var: killed after the journal's directory was made and before the
    journal was in it, the rerun used to take /var/lib for the tree's own (the ledger's
    created_dirs lacked it), and a later revert left R/var/lib behind."""
    import shutil

    from gpunode.platform.host import Host

    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: "version = 2\n" + RUNC})
    shutil.rmtree(host.root / "var", ignore_errors=True)
    before = snapshot(host.root)
    write_atomic = Host.write_atomic

    def dies_at_the_journal(self: Host, path: str, data: object, *args: object,
                            **kwargs: object) -> None:
        if isinstance(data, bytes) and data.startswith(b'{"schema_version": 1, "target"'):
            if kwargs.get("make_parents"):
                self.make_dirs(path.rpartition("/")[0])
            raise Killed
        write_atomic(self, path, data, *args, **kwargs)  # type: ignore[arg-type]

    argv = ["--root", str(host.root), "containerd"]
    with monkeypatch.context() as patch:
        patch.setattr(Host, "write_atomic", dies_at_the_journal)
        with pytest.raises(Killed):
            cli(*argv, "configure", "--config", CONFIG, "--force")
    configured = cli(*argv, "configure", "--config", CONFIG, "--force")
    assert configured.code == 0, configured.err
    reverted = cli(*argv, "revert")
    assert reverted.code == 0, reverted.err
    assert not (host.root / "var").exists()
    assert_unchanged(host.root, before)


def test_a_revert_killed_right_after_its_journal_is_gone_leaves_no_var_lib(
        make_host: HostFactory, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other end: the journal removed (the commit), the directories it kept from being
    removed still there, no record left to name them."""
    import shutil

    from gpunode.containerd.journal import JOURNAL
    from gpunode.platform.host import Host

    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: "version = 2\n" + RUNC})
    shutil.rmtree(host.root / "var", ignore_errors=True)
    before = snapshot(host.root)
    argv = ["--root", str(host.root), "containerd"]
    assert cli(*argv, "configure", "--config", CONFIG, "--force").code == 0
    journal = host.root / JOURNAL.lstrip("/")

    def dies_once_the_journal_is_gone(name: str) -> None:
        original = getattr(Host, name)

        def call(self: Host, *args: object, **kwargs: object) -> object:
            had = journal.exists()
            result = original(self, *args, **kwargs)
            if had and not journal.exists():
                raise Killed
            return result

        monkeypatch.setattr(Host, name, call)

    with monkeypatch.context():
        for name in ("remove", "rename", "remove_dir", "remove_tree"):
            dies_once_the_journal_is_gone(name)
        with pytest.raises(Killed):
            cli(*argv, "revert")
    monkeypatch.undo()
    assert cli(*argv, "revert").code == 0
    assert not (host.root / "var").exists()
    assert_unchanged(host.root, before)
