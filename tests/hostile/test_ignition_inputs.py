"""Hostile `gpunode ignition` inputs: the agent config, the units, the URL and the size limit.
Each is refused with exit 2 and one JSON error event, prints nothing on stdout (no half
snippet), never blocks, and writes nothing."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.delivery import ignition
from hostile.support import Cli, check_refusal

UNITS = Path(__file__).parents[2] / "units"
URL = "https://downloads.example.com/gpunode/gpunode-0.1.0-x86-64.raw"
SHA512 = hashlib.sha512(b"example").hexdigest()


def argv(*extra: str, url: str = URL, sha: str = SHA512) -> list[str]:
    return ["ignition", "--sysext-url", url, "--sysext-sha512", sha, *extra]


def fifo(path: Path) -> None:
    os.mkfifo(path)


# name → (make the agent config at PATH, refusal pattern)
AGENT_CONFIGS: dict[str, tuple[Callable[[Path], object], str]] = {
    "missing": (lambda p: None, r"config\.toml: does not exist"),
    "a-directory": (lambda p: p.mkdir(), r"config\.toml: is a directory, not a regular file"),
    "a-fifo": (fifo, r"config\.toml: is a FIFO, not a regular file"),
    "not-utf-8": (lambda p: p.write_bytes(b"[log]\nlevel = \"info\" # caf\xe9\n"),
                  r"config\.toml: is not UTF-8 text \(invalid byte 0xe9 at line 2, "
                  r"byte offset 26\)"),
    "not-toml": (lambda p: p.write_text("[log\n"), r"config\.toml:1: not valid TOML"),
    "invalid-key": (lambda p: p.write_text("[log]\nlevel = \"loud\"\n"),
                    r"config\.toml:2: key 'log\.level'"),
    "too-big": (lambda p: p.write_text("#" * (ignition.MAX_INPUT + 1)),
                r"config\.toml: is larger than 16 MiB"),
}


@pytest.mark.parametrize("case", list(AGENT_CONFIGS))
def test_a_bad_agent_config_is_refused_before_anything_is_printed(
    tmp_path: Path, cli: Cli, case: str
) -> None:
    make, pattern = AGENT_CONFIGS[case]
    path = tmp_path / "config.toml"
    make(path)
    result = check_refusal(cli, tmp_path, argv("--agent-config", str(path)), 2, pattern)
    assert result.out == ""
    assert result.errors[0]["error_type"] == "ConfigError"


UNIT_FILES: dict[str, tuple[Callable[[Path], object], str]] = {
    "not-utf-8": (lambda p: p.write_bytes(b"[Unit]\nDescription=GPU \xff\n"),
                  r"gpunode\.service: is not UTF-8 text \(invalid byte 0xff at line 2"),
    "missing": (lambda p: p.unlink(), r"gpunode\.service: does not exist .*--units"),
    "a-fifo": (lambda p: (p.unlink(), fifo(p)), r"gpunode\.service: is a FIFO"),
    "a-directory": (lambda p: (p.unlink(), p.mkdir()), r"gpunode\.service: is a directory"),
}


@pytest.mark.parametrize("case", list(UNIT_FILES))
def test_a_bad_unit_file_is_refused(tmp_path: Path, cli: Cli, case: str) -> None:
    units = tmp_path / "units"
    shutil.copytree(UNITS, units)
    make, pattern = UNIT_FILES[case]
    make(units / "gpunode.service")
    result = check_refusal(cli, tmp_path, argv("--units", str(units)), 2, pattern)
    assert result.out == ""


URLS: dict[str, tuple[str, str]] = {
    "bad-ipv6": ("https://[::1/x", r"not a URL Ignition can fetch: Invalid IPv6 URL"),
    "newline": ("https://example.com/a\nb.raw", r"'https://example\.com/a\\nb\.raw': .*control"),
    "space": ("https://example.com/my image.raw", r"percent-encode them \(a space is %20\)"),
    "tab": ("https://example.com/a\tb", r"a control character"),
    "non-ascii": ("https://example.com/gpünode.raw", r"a non-ASCII character"),
    "port-not-a-number": ("https://example.com:abc/x.raw", r"Port could not be cast"),
    "port-out-of-range": ("https://example.com:70000/x.raw", r"Port out of range"),
    "bad-escape": ("https://example.com/x%zz.raw", r"a '%' that does not start a %XX escape"),
    "no-host": ("https:///x.raw", r"it names no host"),
    "ftp": ("ftp://example.com/x.raw", r"Ignition fetches http\(s\), s3, gs or tftp URLs"),
    "empty": ("", r"Ignition fetches http"),
}


@pytest.mark.parametrize("case", list(URLS))
def test_a_url_ignition_would_reject_is_refused(tmp_path: Path, cli: Cli, case: str) -> None:
    url, pattern = URLS[case]
    result = check_refusal(cli, tmp_path, argv(url=url), 2, pattern)
    assert result.out == ""


@pytest.mark.parametrize("sha", ["abc", SHA512.upper(), SHA512[:-1] + "g"])
def test_a_sha512_that_is_not_128_lowercase_hex_digits_is_refused(
    tmp_path: Path, cli: Cli, sha: str
) -> None:
    check_refusal(cli, tmp_path, argv(sha=sha), 2, r"128 lowercase hex digits")


def test_an_over_limit_clc_is_refused_and_never_printed(tmp_path: Path, cli: Cli) -> None:
    config = tmp_path / "config.toml"
    config.write_text("# padding\n" * 4000)  # valid (comments only), 40 kB
    result = check_refusal(cli, tmp_path, argv("--format", "clc", "--agent-config",
                                               str(config)), 2,
                           r"the Container Linux Config is \d+ characters, over Cluster API's "
                           r"additionalConfig limit of 32768")
    assert result.out == ""


def test_the_clc_size_is_a_log_event_not_a_plain_line(tmp_path: Path, cli: Cli) -> None:
    result = cli(*argv("--format", "clc"))
    assert result.code == 0
    [event] = result.events  # every stderr line is JSON
    assert (event["event"], event["limit"]) == ("ignition.clc_size", 32768)
    assert event["characters"] == len(result.out)
