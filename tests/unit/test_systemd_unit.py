"""Reading a unit like systemd: search-path priority, drop-ins, resets and variable expansion."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpunode.containerd.discover import active_config, config_flag
from gpunode.errors import HostError
from gpunode.platform.host import Host
from gpunode.platform.systemd_unit import expand_command, read_unit
from gpunode_testing import fixtures


def write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write(tmp_path, "/usr/lib/systemd/system/containerd.service", fixtures.FLATCAR_CONTAINERD_UNIT)
    return tmp_path


def test_flatcar_unit_runs_containerd_with_the_config_from_its_environment(root: Path) -> None:
    unit = read_unit(Host(root), "containerd.service")
    assert unit.exec_start == ("/usr/bin/containerd", "--config",
                               "/usr/share/containerd/config.toml")
    assert active_config(Host(root)).path == "/usr/share/containerd/config.toml"


def test_dropin_environment_overrides_the_unit(root: Path) -> None:
    write(root, "/etc/systemd/system/containerd.service.d/10-gpunode.conf",
          "[Service]\nEnvironment=CONTAINERD_CONFIG=/etc/containerd/config.toml\n")
    assert active_config(Host(root)).path == "/etc/containerd/config.toml"


def test_dropins_apply_in_file_name_order_across_directories(root: Path) -> None:
    write(root, "/run/systemd/system/containerd.service.d/20-b.conf",
          "[Service]\nEnvironment=CONTAINERD_CONFIG=/b.toml\n")
    write(root, "/etc/systemd/system/containerd.service.d/10-a.conf",
          "[Service]\nEnvironment=CONTAINERD_CONFIG=/a.toml\n")
    assert active_config(Host(root)).path == "/b.toml"


def test_etc_dropin_shadows_the_same_name_in_usr(root: Path) -> None:
    write(root, "/usr/lib/systemd/system/containerd.service.d/10-x.conf",
          "[Service]\nEnvironment=CONTAINERD_CONFIG=/usr.toml\n")
    write(root, "/etc/systemd/system/containerd.service.d/10-x.conf",
          "[Service]\nEnvironment=CONTAINERD_CONFIG=/etc.toml\n")
    unit = read_unit(Host(root), "containerd.service")
    assert unit.dropins == ("/etc/systemd/system/containerd.service.d/10-x.conf",)
    assert active_config(Host(root)).path == "/etc.toml"


def test_empty_exec_start_resets_and_the_next_one_counts(root: Path) -> None:
    write(root, "/etc/systemd/system/containerd.service.d/50-exec.conf",
          "[Service]\nExecStart=\nExecStart=/usr/bin/containerd -c /opt/containerd.toml\n")
    assert active_config(Host(root)).path == "/opt/containerd.toml"


def test_unit_in_etc_replaces_the_one_in_usr(root: Path) -> None:
    write(root, "/etc/systemd/system/containerd.service",
          "[Service]\nExecStart=/usr/bin/containerd --config=/etc/own.toml\n")
    assert active_config(Host(root)).path == "/etc/own.toml"


def test_environment_file_is_read(root: Path) -> None:
    write(root, "/etc/default/containerd", "CONTAINERD_CONFIG='/srv/c.toml'\n")
    write(root, "/etc/systemd/system/containerd.service.d/10-env.conf",
          "[Service]\nEnvironmentFile=-/etc/default/containerd\n")
    assert active_config(Host(root)).path == "/srv/c.toml"


def test_no_unit_means_containerds_default(tmp_path: Path) -> None:
    config = active_config(Host(tmp_path))
    assert config.path == "/etc/containerd/config.toml"
    assert "containerd's default" in config.reason


def test_masked_unit_is_reported_as_masked(root: Path) -> None:
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/containerd.service").symlink_to("/dev/null")
    assert read_unit(Host(root), "containerd.service").masked


def test_continuation_lines_are_joined(root: Path) -> None:
    write(root, "/etc/systemd/system/containerd.service.d/10-x.conf",
          "[Service]\nExecStart=\nExecStart=/usr/bin/containerd \\\n  --config /x.toml\n")
    assert active_config(Host(root)).path == "/x.toml"


def test_unbalanced_quotes_name_the_file(root: Path) -> None:
    write(root, "/etc/systemd/system/containerd.service.d/10-bad.conf",
          '[Service]\nEnvironment="CONTAINERD_CONFIG=/x.toml\n')
    with pytest.raises(HostError, match=re.escape("10-bad.conf': No closing quotation")):
        read_unit(Host(root), "containerd.service")


@pytest.mark.parametrize(("line", "argv"), [
    ("/bin/c --config ${CFG}", ["/bin/c", "--config", "/a b.toml"]),
    ("/bin/c $OPTS", ["/bin/c", "-c", "/x.toml"]),
    ("-/bin/c", ["/bin/c"]),
    ("/bin/c --config=${CFG}", ["/bin/c", "--config=/a b.toml"]),
])
def test_expand_command_follows_systemd_rules(line: str, argv: list[str]) -> None:
    env = {"CFG": "/a b.toml", "OPTS": "-c /x.toml"}
    assert expand_command(line, env) == argv


@pytest.mark.parametrize(("argv", "path"), [
    (["containerd", "--config", "/a"], "/a"),
    (["containerd", "-c", "/b"], "/b"),
    (["containerd", "--config=/c"], "/c"),
    (["containerd", "-c=/d"], "/d"),
    (["containerd"], None),
    (["containerd", "--config"], None),
])
def test_config_flag_spellings(argv: list[str], path: str | None) -> None:
    assert config_flag(argv) == path
