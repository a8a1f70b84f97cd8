"""The hostile suite's own harness: what it accepts and what it catches."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import HostFactory
from hostile.support import Cli, assert_unchanged, snapshot


def test_a_read_only_command_on_a_fixture_leaves_every_file_as_it_was(
    make_host: HostFactory, cli: Cli
) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    before = snapshot(root)
    result = cli("--root", str(root), "detect", "--json")
    assert result.code == 0
    assert_unchanged(root, before)


def test_a_temp_file_left_behind_is_caught(tmp_path: Path) -> None:
    before = snapshot(tmp_path)
    (tmp_path / ".config.toml.abc.gpunode-tmp").write_text("half")
    with pytest.raises(AssertionError, match="temp files left behind"):
        assert_unchanged(tmp_path, before)
