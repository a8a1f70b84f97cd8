"""Hostile containerd cases, round 2: what containerd really does decides, not what the file
seems to say.

- A CRI plugin in `disabled_plugins` leaves containerd with no CRI at all: status fails
  containerd_runtime naming it, configure refuses naming it (gpunode never edits that list).
- A byte order mark: containerd 1.x skips it, 2.x refuses the whole file. Under --root the
  version is unknown, so 2.x's reading counts: status warns, configure refuses (as it does when
  containerd is known to be 2.x); a version 1 file, which only 1.x reads, is configured.
- A write that fails (disk full) leaves the files as they were, and the step's event says
  changed: false (planned_change: true).
- configure then revert on a root without /var leaves no /var (the journal's own directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.containerd import schema
from gpunode.errors import HostError
from gpunode.platform.host import Host
from hostile.support import Cli, assert_unchanged, check_refusal, snapshot

CONFIG = "/etc/containerd/config.toml"
CRI_V2 = 'plugins."io.containerd.grpc.v1.cri"'
CRI_V3 = 'plugins."io.containerd.cri.v1.runtime"'
ACTIVE = "/usr/share/containerd/config.toml"  # what the fixture's containerd.service reads


def nvidia(table: str) -> str:
    return (f'[{table}.containerd.runtimes.nvidia]\nruntime_type = "io.containerd.runc.v2"\n'
            f'[{table}.containerd.runtimes.nvidia.options]\n'
            'BinaryName = "/usr/bin/nvidia-container-runtime"\n')


def runc(table: str) -> str:
    return f'[{table}.containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n'


def status_check(cli: Cli, root: Path, name: str = "containerd_runtime") -> dict[str, str]:
    result = cli("--root", str(root), "status", "--json")
    assert "Traceback" not in result.err, result.err
    checks = {c["name"]: c for c in json.loads(result.out)["checks"]}
    return checks[name]


# -- a CRI plugin in disabled_plugins -------------------------------------------------------------

# name → config whose every reader runs no CRI plugin, and the entry that disables it
DISABLED = {
    "v1-cri": ('disabled_plugins = ["cri"]\n' + nvidia("plugins.cri"), "cri"),
    "v2-grpc-cri": ('version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                    + nvidia(CRI_V2), "io.containerd.grpc.v1.cri"),
    "v3-cri-runtime": ('version = 3\ndisabled_plugins = ["io.containerd.cri.v1.runtime"]\n'
                       + nvidia(CRI_V3), "io.containerd.cri.v1.runtime"),
    "v3-grpc-cri": ('version = 3\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                    + nvidia(CRI_V3), "io.containerd.grpc.v1.cri"),
    "v3-cri-images": ('version = 3\ndisabled_plugins = ["io.containerd.cri.v1.images"]\n'
                      + nvidia(CRI_V3), "io.containerd.cri.v1.images"),
    "v2-without-runtime": ('version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                           + runc(CRI_V2), "io.containerd.grpc.v1.cri"),
}


@pytest.mark.parametrize("name", sorted(DISABLED))
def test_configure_refuses_a_config_whose_cri_plugin_is_disabled(
    name: str, make_host: HostFactory, cli: Cli
) -> None:
    text, entry = DISABLED[name]
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: text})
    argv = ["--root", str(host.root), "containerd", "configure", "--config", CONFIG, "--force"]
    check_refusal(cli, host.root, argv, 1,
                  rf"lists '{entry}' in disabled_plugins.*no CRI plugin.*remove '{entry}' from "
                  "disabled_plugins")


@pytest.mark.parametrize("name", sorted(DISABLED))
def test_status_fails_the_runtime_of_a_config_whose_cri_plugin_is_disabled(
    name: str, make_host: HostFactory, cli: Cli
) -> None:
    text, entry = DISABLED[name]
    host = make_host("nc4as-t4-v3", "driver", extra={ACTIVE: text})
    check = status_check(cli, host.root)
    assert check["state"] == "fail", check
    assert f"lists '{entry}' in disabled_plugins" in check["detail"], check


@pytest.mark.parametrize("text", [
    'version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.CRI"]\n',  # matched exactly
    'version = 2\ndisabled_plugins = ["io.containerd.monitor.v1.cgroups"]\n',
    'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n',  # a URI in a version 1 file: 1.x
], ids=["other-case", "other-plugin", "v1-file-with-a-uri"])
def test_a_disabled_plugin_that_is_not_the_cri_one_does_not_stop_configure(
    text: str, make_host: HostFactory, cli: Cli
) -> None:
    body = text + (runc("plugins.cri") if "version" not in text else runc(CRI_V2))
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: body})
    result = cli("--root", str(host.root), "containerd", "configure", "--config", CONFIG,
                 "--force")
    assert result.code == 0, result.err
    assert "nvidia" in (host.root / CONFIG.lstrip("/")).read_text()


def test_a_cri_plugin_disabled_in_an_import_is_found_there(make_host: HostFactory,
                                                           cli: Cli) -> None:
    """containerd appends every file's disabled_plugins: the import's entry counts."""
    imported = "/etc/containerd/conf.d/10-off.toml"
    host = make_host("nc4as-t4-v3", "driver", extra={
        CONFIG: 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n' + runc(CRI_V2),
        imported: 'version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n'})
    argv = ["--root", str(host.root), "containerd", "configure", "--config", CONFIG, "--force"]
    check_refusal(cli, host.root, argv, 1, rf"{imported} lists 'io.containerd.grpc.v1.cri'")


def test_every_version_view_carries_the_disabled_cri_plugin() -> None:
    """status, plan and configure share schema.effective: each version that honours the entry
    has it as its problem, and the others do not."""
    doc = {"version": 2, "disabled_plugins": ["io.containerd.cri.v1.runtime"]}
    views = {d: schema.effective([schema.Layer("f", doc)], d) for d in schema.KNOWN_BEHAVIOURS}
    assert views[(1, 6)].problem is None and views[(1, 7)].problem is None
    assert "disabled_plugins" in (views[(2, 1)].problem or "")


# -- a byte order mark ----------------------------------------------------------------------------

BOM_V2 = "\ufeffversion = 2\n" + runc(CRI_V2)
BOM_V1 = "\ufeff" + runc("plugins.cri")


def test_configure_under_an_unknown_version_refuses_a_v2_file_with_a_byte_order_mark(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: BOM_V2})
    argv = ["--root", str(host.root), "containerd", "configure", "--config", CONFIG, "--force"]
    check_refusal(cli, host.root, argv, 1,
                  r"byte order mark, which containerd 2\.x refuses.*remove the file's first 3")


def test_status_under_an_unknown_version_does_not_pass_a_v2_file_with_a_byte_order_mark(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "driver",
                     extra={ACTIVE: "\ufeffversion = 2\n" + runc(CRI_V2) + nvidia(CRI_V2)})
    check = status_check(cli, host.root)
    assert check["state"] in ("warn", "fail"), check
    assert "containerd 2.1+: " in check["detail"] and "byte order mark" in check["detail"]


def test_an_import_with_a_byte_order_mark_breaks_the_2x_view() -> None:
    layers = [schema.Layer("main", {"version": 2, "imports": ["imp"]}),
              schema.Layer("imp", {"version": 2}, bom=True)]
    assert "imp starts with a UTF-8 byte order mark" in (
        schema.effective(layers, (2, 1)).problem or "")
    assert schema.effective(layers, (1, 7)).problem is None


def test_a_v1_file_with_a_byte_order_mark_is_configured_and_keeps_it(
    make_host: HostFactory, cli: Cli
) -> None:
    """Only 1.x reads a version 1 file's runtimes, and 1.x skips a BOM."""
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: BOM_V1})
    result = cli("--root", str(host.root), "containerd", "configure", "--config", CONFIG,
                 "--force")
    assert result.code == 0, result.err
    written = (host.root / CONFIG.lstrip("/")).read_text()
    assert written.startswith("\ufeff") and "nvidia-container-runtime" in written


# -- a write that fails ---------------------------------------------------------------------------


def test_a_full_disk_during_configure_leaves_the_file_and_says_nothing_changed(
    make_host: HostFactory, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: "version = 2\n" + runc(CRI_V2)})
    write = Host.write_atomic

    def full(self: Host, path: str, data: bytes, **kwargs: object) -> None:
        if path == CONFIG:
            raise HostError("write", self.display(path), "No space left on device")
        write(self, path, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Host, "write_atomic", full)
    argv = ["--root", str(host.root), "containerd", "configure", "--config", CONFIG, "--force"]
    result = check_refusal(cli, host.root, argv, 1, "No space left on device")
    failed = next(e for e in result.events if e["event"] == "step.failed")
    assert (failed["changed"], failed["planned_change"], failed["config"]) == (
        False, True, CONFIG), failed
    assert "interrupted" not in failed


def test_a_configure_that_succeeds_says_it_changed_the_file(make_host: HostFactory,
                                                             cli: Cli) -> None:
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: "version = 2\n" + runc(CRI_V2)})
    argv = ["--root", str(host.root), "containerd", "configure", "--config", CONFIG, "--force"]
    done = next(e for e in cli(*argv).events if e["event"] == "step.done")
    assert (done["changed"], done["planned_change"]) == (True, True), done
    again = next(e for e in cli(*argv).events if e["event"] == "step.done")
    assert (again["changed"], again["planned_change"]) == (False, False), again


def test_a_dry_run_says_what_would_change_and_that_nothing_changed(make_host: HostFactory,
                                                                   cli: Cli) -> None:
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: "version = 2\n" + runc(CRI_V2)})
    result = cli("--root", str(host.root), "containerd", "configure", "--config", CONFIG,
                 "--force", "--dry-run")
    done = next(e for e in result.events if e["event"] == "step.done")
    assert (done["changed"], done["planned_change"]) == (False, True), done


# -- the journal's own directory ------------------------------------------------------------------


def test_configure_then_revert_on_a_root_without_var_leaves_no_var(make_host: HostFactory,
                                                                  cli: Cli) -> None:
    import shutil

    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: "version = 2\n" + runc(CRI_V2)})
    shutil.rmtree(host.root / "var", ignore_errors=True)
    before = snapshot(host.root)
    argv = ["--root", str(host.root), "containerd"]
    configured = cli(*argv, "configure", "--config", CONFIG, "--force")
    assert configured.code == 0, configured.err
    assert (host.root / "var/lib/gpunode").is_dir()
    reverted = cli(*argv, "revert")
    assert reverted.code == 0, reverted.err
    assert not (host.root / "var").exists()
    assert "remove /var (gpunode created it; now empty)" in reverted.out
    assert_unchanged(host.root, before)

