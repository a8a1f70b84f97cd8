"""The command line's own contract under hostile arguments: a usage error (argparse's or
gpunode's) and an unreadable or invalid agent config are one JSON error event with `error` and
`hint` under --log-format json, exit 2, and nothing written; `plan` exits 0 whenever it could
plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import HostFactory
from hostile.support import Cli, check_refusal

# argv (after --log-format json) → refusal pattern; {root} is the test's directory
USAGE: dict[str, tuple[list[str], str]] = {
    "unknown-command": (["frobnicate"], r"invalid choice: 'frobnicate'.*gpunode --help"),
    "no-command": ([], r"the following arguments are required: COMMAND"),
    "unknown-option": (["detect", "--bogus"],
                       r"unrecognized arguments: --bogus.*see 'gpunode detect --help'"),
    "unknown-option-of-an-action": (["containerd", "revert", "--x"],
                                    r"--x.*see 'gpunode containerd revert --help'"),
    "bad-log-format": (["--log-format", "xml", "detect"],
                       r"argument --log-format: invalid choice: 'xml'"),
    "missing-required-option": (["ignition", "--sysext-sha512", "0"],
                                r"required: --sysext-url.*gpunode ignition --help"),
    "bad-choice-of-a-subcommand": (["label", "--registration", "helm"],
                                   r"argument --registration: invalid choice: 'helm'"),
    "no-action": (["containerd"], r"required: ACTION.*gpunode containerd --help"),
    "option-without-value": (["--root"], r"argument --root: expected one argument"),
    "root-missing": (["--root", "{root}/nope", "detect"], r"--root \S+/nope: not a directory"),
    "root-a-file": (["--root", "{root}/file", "detect"], r"--root \S+/file: not a directory"),
}


@pytest.mark.parametrize("case", list(USAGE))
def test_a_usage_error_is_one_json_event_with_a_hint(tmp_path: Path, cli: Cli,
                                                     case: str) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    words, pattern = USAGE[case]
    result = check_refusal(cli, tmp_path, [w.format(root=tmp_path) for w in words], 2, pattern)
    [event] = result.errors
    assert event["exit_code"] == 2 and event["hint"]
    assert result.out == ""


CONFIGS: dict[str, tuple[bytes | None, str]] = {
    "missing": (None, r"config\.toml: does not exist \(omit --config to use defaults\)"),
    "not-toml": (b"[log\n", r"config\.toml:1: not valid TOML"),
    "unknown-section": (b"[logging]\nlevel = 'info'\n", r"key 'logging': unknown section"),
    "wrong-type": (b"[log]\nlevel = 3\n", r"config\.toml:2: key 'log\.level'"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_an_invalid_agent_config_is_one_json_event_naming_file_and_key(
    tmp_path: Path, cli: Cli, case: str
) -> None:
    content, pattern = CONFIGS[case]
    path = tmp_path / "config.toml"
    if content is not None:
        path.write_bytes(content)
    result = check_refusal(cli, tmp_path, ["--config", str(path), "detect"], 2, pattern)
    [event] = result.errors
    assert event["file"] == str(path)
    assert "docs/config.md lists every key" in str(event["hint"])


def test_an_agent_config_that_is_a_directory_is_refused(tmp_path: Path, cli: Cli) -> None:
    (tmp_path / "config.toml").mkdir()
    check_refusal(cli, tmp_path, ["--config", str(tmp_path / "config.toml"), "detect"], 2,
                  r"config\.toml: cannot be read: is a directory")


def test_the_default_agent_config_under_a_root_is_refused_the_same_way(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    (host.root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (host.root / "etc/gpunode/config.toml").write_text("[driver]\nstrategy = 'magic'\n")
    check_refusal(cli, host.root, ["--root", str(host.root), "boot"], 2,
                  r"etc/gpunode/config\.toml:2: key 'driver\.strategy'")


@pytest.mark.parametrize(("machine", "state"), [("nc4as-t4-v3", "bare"),
                                                 ("t4-nouveau", "bare"),
                                                 ("nc4as-t4-v3", "driver")])
def test_plan_exits_0_whenever_it_could_plan(make_host: HostFactory, cli: Cli, machine: str,
                                             state: str) -> None:
    """Boot would fail on these nodes; saying so (with why and what to do) is plan's answer."""
    host = make_host(machine, state)
    result = cli("--root", str(host.root), "plan", "--json")
    doc = json.loads(result.out)
    assert (result.code, result.errors) == (0, [])
    assert doc["would_fail"] is True
    assert all(p["error"] and p["hint"] for p in doc["problems"])
