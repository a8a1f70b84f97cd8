"""The node snippet is valid Ignition for the real ignition-validate (Debian's package), and
ignition-validate would catch a broken one: what `gpunode ignition` renders, as it renders it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gpunode.cli.main import main
from helpers.ignition_example import SHA512, rendered


def test_ignition_validate_accepts_the_rendered_ignition(tmp_path: Path) -> None:
    path = tmp_path / "gpunode.ign"
    path.write_text(rendered("ignition"))
    done = subprocess.run(["ignition-validate", str(path)], capture_output=True, text=True,
                          check=False)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_ignition_validate_would_catch_a_broken_config(tmp_path: Path) -> None:
    broken = json.loads(rendered("ignition"))
    broken["storage"]["files"][0]["path"] = "relative/path"
    path = tmp_path / "broken.ign"
    path.write_text(json.dumps(broken))
    done = subprocess.run(["ignition-validate", str(path)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 1
    assert "path not absolute" in done.stderr + done.stdout


def test_ignition_validate_accepts_what_the_checks_let_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """UTF-8 text in the agent config, percent-escapes and a query in the URL: rendered by the
    command line, and valid for ignition-validate."""
    config = tmp_path / "config.toml"
    config.write_text('# Knoten für GPU-Pools — “ü”\n[log]\nlevel = "info"\n')
    url = "https://downloads.example.com/my%20images/gpunode.raw?sig=a%2Fb&v=1"
    code = main(["--log-format", "json", "ignition", "--format", "ignition", "--sysext-url",
                 url, "--sysext-sha512", SHA512, "--agent-config", str(config)])
    out, _ = capsys.readouterr()
    assert code == 0
    files = {f["path"]: f for f in json.loads(out)["storage"]["files"]}
    assert files["/opt/extensions/gpunode/gpunode-0.1.0-x86-64.raw"]["contents"]["source"] == url
    path = tmp_path / "gpunode.ign"
    path.write_text(out)
    done = subprocess.run(["ignition-validate", str(path)], capture_output=True, text=True,
                          check=False)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
