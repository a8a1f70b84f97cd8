"""The node snippet: the same content in all three formats, units verbatim. ignition-validate
on what it renders: tests/integration/test_ignition_validate.py."""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO
from gpunode.cli.main import main
from gpunode.delivery import ignition
from gpunode.errors import UsageError
from helpers.ignition_example import AGENT, SHA512, UNITS, URL, rendered


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


def test_all_formats_carry_the_same_files_links_and_units() -> None:
    butane, ign, clc = (normalised(f) for f in ("butane", "ignition", "clc"))
    assert butane == ign == clc
    assert butane["links"] == {"/etc/extensions/gpunode.raw":
                               "/opt/extensions/gpunode/gpunode-0.1.0-x86-64.raw"}
    assert butane["files"]["/opt/extensions/gpunode/gpunode-0.1.0-x86-64.raw"] == (
        0o644, (URL, f"sha512-{SHA512}"))
    assert butane["files"]["/etc/gpunode/config.toml"] == (0o644, ("inline", AGENT))
    assert butane["units"]["nvidia.service"] == (None, True, None)


@pytest.mark.parametrize("fmt", ("butane", "ignition", "clc"))
def test_units_are_embedded_byte_for_byte(fmt: str) -> None:
    units = normalised(fmt)["units"]
    for path in sorted(UNITS.glob("*.service")):
        assert units[path.name] == (True, False, path.read_text())


@pytest.mark.parametrize("fmt", ignition.FORMATS)
def test_without_units_the_packaged_units_are_embedded_and_they_are_those_of_units(
        fmt: str) -> None:
    """No --units: the units come from gpunode's package data, which units/ links to."""
    packaged = ignition.render(ignition.snippet(URL, SHA512, AGENT), fmt)
    assert packaged == rendered(fmt)
    assert UNITS.resolve() == (REPO / "gpunode" / "delivery" / "units").resolve()


def test_butane_header_and_clc_size() -> None:
    butane = yaml.safe_load(rendered("butane"))
    assert (butane["variant"], butane["version"]) == ("flatcar", "1.0.0")
    assert json.loads(rendered("ignition"))["ignition"]["version"] == "3.3.0"
    assert len(rendered("clc")) < ignition.CLC_LIMIT // 4


@pytest.mark.parametrize("fmt,name", [("butane", "gpunode.butane"), ("ignition", "gpunode.ign"),
                                      ("clc", "gpunode.clc")])
def test_committed_examples_are_current(fmt: str, name: str) -> None:
    assert (REPO / "ignition" / name).read_text() == rendered(fmt)


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
    from gpunode.platform.host import Host

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


def test_the_clc_enables_units_with_enabled_not_the_deprecated_enable() -> None:
    """Container Linux Config's `enable:` is deprecated; CAPI's CLC and the charts use
    `enabled:`."""
    units = yaml.safe_load(rendered("clc"))["systemd"]["units"]
    assert all("enable" not in u for u in units)
    assert [u["name"] for u in units if u.get("enabled")] == [
        "gpunode.service", "gpunode-label.service", "gpunode-watch.service"]
