"""The node snippet: valid Ignition, the same content in all three formats, units verbatim."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode import ignition
from gpunode.cli import main
from gpunode.errors import UsageError

ROOT = Path(__file__).parent.parent
UNITS = ROOT / "units"
URL = "https://downloads.example.com/gpunode/gpunode-0.1.0-x86-64.raw"
SHA512 = hashlib.sha512(b"example").hexdigest()
AGENT = (ROOT / "ignition/example-config.toml").read_text()


def rendered(fmt: str) -> str:
    return ignition.render(ignition.snippet(URL, SHA512, AGENT, UNITS), fmt)


def normalised(fmt: str) -> dict[str, Any]:
    """files, links and units of a rendering, in one shape whatever the format."""
    text = rendered(fmt)
    doc = json.loads(text) if fmt == "ignition" else yaml.safe_load(text)
    files = {}
    for f in doc["storage"]["files"]:
        c = f["contents"]
        if "remote" in c:  # CLC
            source = (c["remote"]["url"], "sha512-" + c["remote"]["verification"]["hash"]["sum"])
        elif "verification" in c:
            source = (c["source"], c["verification"]["hash"])
        elif "inline" in c:
            source = ("inline", c["inline"])
        else:  # Ignition: data URL
            source = ("inline", urllib.parse.unquote(c["source"].removeprefix("data:,")))
        files[f["path"]] = (f["mode"], source)
    links = {ln["path"]: ln["target"] for ln in doc["storage"]["links"]}
    units = {u["name"]: (u.get("enabled", u.get("enable")), u.get("mask", False),
                         u.get("contents")) for u in doc["systemd"]["units"]}
    return {"files": files, "links": links, "units": units}


@pytest.mark.integration
def test_ignition_validate_accepts_the_rendered_ignition(tmp_path: Path) -> None:
    path = tmp_path / "gpunode.ign"
    path.write_text(rendered("ignition"))
    done = subprocess.run(["ignition-validate", str(path)], capture_output=True, text=True,
                          check=False)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@pytest.mark.integration
def test_ignition_validate_would_catch_a_broken_config(tmp_path: Path) -> None:
    broken = json.loads(rendered("ignition"))
    broken["storage"]["files"][0]["path"] = "relative/path"
    path = tmp_path / "broken.ign"
    path.write_text(json.dumps(broken))
    done = subprocess.run(["ignition-validate", str(path)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 1
    assert "path not absolute" in done.stderr + done.stdout


def test_all_formats_carry_the_same_files_links_and_units() -> None:
    butane, ign, clc = (normalised(f) for f in ("butane", "ignition", "clc"))
    assert butane == ign == clc
    assert butane["links"] == {"/etc/extensions/gpunode.raw":
                               "/opt/extensions/gpunode/gpunode-0.1.0-x86-64.raw"}
    assert butane["files"]["/opt/extensions/gpunode/gpunode-0.1.0-x86-64.raw"] == (
        0o644, (URL, f"sha512-{SHA512}"))
    assert butane["files"]["/etc/gpunode/config.toml"] == (0o644, ("inline", AGENT))
    assert butane["units"]["nvidia.service"] == (None, True, None)


@pytest.mark.parametrize("fmt", ignition.FORMATS)
def test_units_are_embedded_byte_for_byte(fmt: str) -> None:
    units = normalised(fmt)["units"]
    for path in sorted(UNITS.glob("*.service")):
        assert units[path.name] == (True, False, path.read_text())


def test_butane_header_and_clc_size() -> None:
    butane = yaml.safe_load(rendered("butane"))
    assert (butane["variant"], butane["version"]) == ("flatcar", "1.0.0")
    assert json.loads(rendered("ignition"))["ignition"]["version"] == "3.3.0"
    assert len(rendered("clc")) < ignition.CLC_LIMIT // 4


@pytest.mark.parametrize("fmt,name", [("butane", "gpunode.butane"), ("ignition", "gpunode.ign"),
                                      ("clc", "gpunode.clc")])
def test_committed_examples_are_current(fmt: str, name: str) -> None:
    assert (ROOT / "ignition" / name).read_text() == rendered(fmt)


@pytest.mark.parametrize(("url", "sha", "message"), [
    (URL, "abc", "128 lowercase hex digits"),
    ("ftp://example.com/x.raw", SHA512, "Ignition fetches http(s)"),
])
def test_bad_arguments_are_refused(url: str, sha: str, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        ignition.snippet(url, sha, None, UNITS)


def test_cli_refuses_an_invalid_agent_config_before_rendering(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "config.toml"
    bad.write_text("[log]\nlevel = 'loud'\n")
    code = main(["ignition", "--sysext-url", URL, "--sysext-sha512", SHA512,
                 "--agent-config", str(bad)])
    assert code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{bad}:2: key 'log.level'" in err


def test_the_agent_config_to_install_is_read_once_and_installed_as_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What is checked is what is installed: one read, so a file changed in between cannot
    slip an unchecked config into the snippet."""
    from gpunode.host import Host

    path = tmp_path / "config.toml"
    path.write_text(AGENT)
    reads: list[str] = []
    real = Host.read_optional

    def counted(self: Host, name: str, *args: Any, **kwargs: Any) -> str | None:
        reads.append(name)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(Host, "read_optional", counted)
    assert ignition.agent_config(str(path)) == AGENT
    assert reads == [str(path)]


@pytest.mark.integration
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
