"""The agent config: defaults when absent, every documented key accepted, bad files refused
with file, line, key and what would be valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import TEST_DATA
from gpunode.cli.main import main
from gpunode.config import (
    CDI_CAPABILITIES,
    AgentConfig,
    CdiConfig,
    ContainerdConfig,
    KubeletConfig,
    LogConfig,
    MetricsConfig,
    load_config,
)
from gpunode.errors import ConfigError
from gpunode.platform.host import Host

DATA = TEST_DATA / "config"
INVALID = sorted((DATA / "invalid").glob("*.toml"))


def install(root: Path, source: Path) -> Host:
    target = root / "etc/gpunode/config.toml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    return Host(root)


def expectation(source: Path) -> str:
    first = source.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), f"{source.name} must start with '# expect: REGEX'"
    return first.removeprefix("# expect: ")


def test_missing_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(Host(tmp_path)) == AgentConfig()


def test_empty_file_means_defaults_read_from_that_file(tmp_path: Path) -> None:
    config = load_config(install(tmp_path, DATA / "valid/empty.toml"))
    assert config == AgentConfig(source=f"{tmp_path}/etc/gpunode/config.toml")


def test_every_documented_key_is_read(tmp_path: Path) -> None:
    config = load_config(install(tmp_path, DATA / "valid/full.toml"))
    assert config.log == LogConfig(level="debug")
    assert config.containerd == ContainerdConfig(runtime_name="nvidia-cdi",
                                                 config_path="/etc/containerd/config.toml")
    assert config.kubelet == KubeletConfig(
        device_plugin_socket="/var/lib/kubelet/device-plugins/nvidia.sock")
    assert config.metrics == MetricsConfig(textfile="")  # "": the watch writes no metrics file
    assert config.cdi == CdiConfig(capabilities=("compute", "utility", "video"))
    assert config.cdi.wanted == {"compute", "utility", "video"}


def test_the_cdi_capabilities_default_to_every_one_as_nvidia_ctk_mounts_them() -> None:
    """`[cdi] capabilities` unset means "all": every capability's files, as `nvidia-ctk cdi
    generate` mounts every library of the driver."""
    assert AgentConfig().cdi.wanted == set(CDI_CAPABILITIES)
    assert {"compute", "utility", "video", "graphics", "display", "ngx"} == set(CDI_CAPABILITIES)


@pytest.mark.parametrize("source", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_config_is_refused_with_its_reason(tmp_path: Path, source: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(install(tmp_path, source))
    message = str(info.value)
    assert message.startswith(f"{tmp_path}/etc/gpunode/config.toml")
    assert re.search(expectation(source), message), message


@pytest.mark.parametrize("source", INVALID, ids=[p.stem for p in INVALID])
def test_cli_exits_2_with_one_message_and_leaves_the_file_alone(
    tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = install(tmp_path, source)
    before = (host.root / "etc/gpunode/config.toml").read_bytes()
    assert main(["--root", str(tmp_path), "--log-format", "json", "status"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    event = json.loads(err[0])  # one JSON event under --log-format json
    assert (event["level"], event["exit_code"]) == ("error", 2)
    assert event["error"].startswith(f"{tmp_path}/etc/gpunode/config.toml")
    assert (host.root / "etc/gpunode/config.toml").read_bytes() == before


def test_explicit_config_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Host(), str(tmp_path / "nope.toml"))


def test_explicit_config_path_is_read_from_this_machine_not_the_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "root").mkdir()
    bad = tmp_path / "agent.toml"
    bad.write_text("[log]\nlevel = 'loud'\n")
    assert main(["--root", str(tmp_path / "root"), "--config", str(bad), "detect"]) == 2
    assert f"{bad}:2: key 'log.level'" in capsys.readouterr().err


def test_unreadable_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "etc/gpunode/config.toml").mkdir(parents=True)
    with pytest.raises(ConfigError, match="cannot be read: is a directory, not a regular file"):
        load_config(Host(tmp_path))

