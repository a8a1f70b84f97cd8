"""Hostile inputs of `gpunode image bake`: every bad bake config, image root or artifact gets
one clear message and its documented exit code (2: the bake config, the root; 1: an artifact
that cannot be fetched or is not the one pinned), and leaves every file under the root as it
was: nothing half-placed, no temporary file, no directory made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import HostFactory
from helpers.bake import DRIVER, GPUNODE_FILE, make_inputs, serving, sha512
from hostile.support import Cli, check_refusal

GOOD_SHA = "0" * 128
# The whole bake config → the refusal it must give (exit 2). {G} and {D}: the good sections.
BAD_CONFIGS: dict[str, tuple[str, str]] = {
    "not-toml": ("[gpunode\n", r"bake\.toml:1: not valid TOML"),
    "unknown-section": ("{G}\n[extras]\nx = 1\n",
                        r"key 'extras': unknown section; valid sections are gpunode, driver"),
    "no-gpunode": ("{D}", r"key 'gpunode': missing"),
    "gpunode-not-a-table": ('gpunode = "x"\n', r"key 'gpunode': must be a table"),
    "unknown-key": ('{G}mode = "fast"\n',
                    r":4: key 'gpunode.mode': unknown key; valid keys in \[gpunode\] are "
                    r"source, sha512"),
    "no-sha512": ('[gpunode]\nsource = "a.raw"\n', r"key 'gpunode.sha512': missing"),
    "sha512-short": ('[gpunode]\nsource = "a.raw"\nsha512 = "abc"\n',
                     r":3: key 'gpunode.sha512': must be 128 lowercase hex digits"),
    "sha512-uppercase": (f'[gpunode]\nsource = "a.raw"\nsha512 = "{"A" * 128}"\n',
                         r"key 'gpunode.sha512': must be 128 lowercase hex"),
    "sha512-a-number": ('[gpunode]\nsource = "a.raw"\nsha512 = 5\n',
                        r"key 'gpunode.sha512': must be a string, not int"),
    "ftp-source": (f'[gpunode]\nsource = "ftp://h/gpunode.raw"\nsha512 = "{GOOD_SHA}"\n',
                   r":2: key 'gpunode.source'.*fetches http, https or file URLs"),
    "file-url-with-host": (f'[gpunode]\nsource = "file://host/g.raw"\nsha512 = "{GOOD_SHA}"\n',
                           r"key 'gpunode.source'.*file:///path"),
    "url-without-host": (f'[gpunode]\nsource = "https:///g.raw"\nsha512 = "{GOOD_SHA}"\n',
                         r"key 'gpunode.source'.*names no host"),
    "bad-port": (f'[gpunode]\nsource = "https://h:99999/g.raw"\nsha512 = "{GOOD_SHA}"\n',
                 r"key 'gpunode.source'.*not a URL"),
    "padded-source": (f'[gpunode]\nsource = " g.raw"\nsha512 = "{GOOD_SHA}"\n',
                      r"key 'gpunode.source'.*without spaces around it"),
    "empty-source": (f'[gpunode]\nsource = ""\nsha512 = "{GOOD_SHA}"\n',
                     r"key 'gpunode.source'.*must be a URL or a path"),
    "newline-in-source": (f'[gpunode]\nsource = "a\\nb.raw"\nsha512 = "{GOOD_SHA}"\n',
                          r"key 'gpunode.source'.*control characters"),
    "gpunode-not-a-raw-file": (f'[gpunode]\nsource = "https://h/dl?id=3"\nsha512 = "{GOOD_SHA}"\n',
                               r"key 'gpunode.source': must name a file like gpunode-"),
    "driver-not-an-array": ('driver = 3\n{G}', r":1: key 'driver': must be an array of tables"),
    "driver-key-in-gpunode": ('{G}driver = 3\n', r"key 'gpunode.driver': unknown key"),
    "driver-bad-name": ('{G}\n[[driver]]\nname = "nvidia-570"\nsource = "d.raw"\n'
                        f'sha512 = "{GOOD_SHA}"\n',
                        r":6: key 'driver\[1\].name': 'nvidia-570' is not a Flatcar driver"),
    "driver-no-source": ('{G}\n[[driver]]\nname = "nvidia-drivers-570"\n'
                         f'sha512 = "{GOOD_SHA}"\n', r"key 'driver\[1\].source': missing"),
    "driver-unknown-key": ('{G}{D}enable = true\n', r"key 'driver\[1\].enable': unknown key"),
    "driver-twice": ('{G}{D}{D}', r"key 'driver\[2\].name': 'nvidia-drivers-570-open' is baked "
                     r"twice"),
    "unknown-placeholder": ('{G}\n[[driver]]\nname = "nvidia-drivers-570"\n'
                            'source = "https://h/{{release}}/d.raw"\n'
                            f'sha512 = "{GOOD_SHA}"\n',
                            r"key 'driver\[1\].source': unknown placeholder \{release\}"),
    "timeout-zero": ("{G}\n[download]\ntimeout = 0\n",
                     r"key 'download.timeout': must be an integer from 1 to 600, not 0"),
    "attempts-a-boolean": ("{G}\n[download]\nattempts = true\n",
                           r"key 'download.attempts': must be an integer from 1 to 10"),
    "agent-config-missing": ('{G}\n[agent]\nconfig = "absent.toml"\n',
                             r"key 'agent.config':.*absent\.toml.*does not exist"),
    "agent-config-invalid": ('{G}\n[agent]\nconfig = "bad-agent.toml"\n',
                             r"key 'agent.config':.*bad-agent\.toml:2: key 'driver\.flavour'"),
}


def _sections(inputs_dir: Path) -> dict[str, str]:
    inputs = make_inputs(inputs_dir)
    text = inputs.config().read_text()
    gpunode, _, driver = text.partition("\n[[driver]]")
    (inputs_dir / "bad-agent.toml").write_text('[driver]\nflavour = "fast"\n')
    return {"G": gpunode, "D": "\n[[driver]]" + driver}


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=BAD_CONFIGS.keys())
def test_a_bad_bake_config_is_refused_naming_key_and_line(
        make_host: HostFactory, tmp_path: Path, cli: Cli, case: str) -> None:
    body, pattern = BAD_CONFIGS[case]
    root = make_host("nc4as-t4-v3", "driver").root
    sections = _sections(tmp_path / "in")
    config = tmp_path / "in" / "bake.toml"
    config.write_text(body.replace("{G}", sections["G"]).replace("{D}", sections["D"])
                      .replace("{{", "{").replace("}}", "}"))
    result = check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                       str(config)], 2, pattern)
    assert result.errors[0]["error_code"] == "bake-config-invalid"


def test_a_missing_bake_config_is_refused(make_host: HostFactory, tmp_path: Path,
                                          cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                              str(tmp_path / "none.toml")], 2, r"none\.toml: does not exist")


def test_a_fifo_as_bake_config_is_refused_without_waiting(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    os.mkfifo(tmp_path / "fifo.toml")
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                              str(tmp_path / "fifo.toml")], 2, r"fifo\.toml: cannot be read")


def test_a_bake_without_config_is_a_usage_error(make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    check_refusal(cli, root, ["image", "bake", "--root", str(root)], 2,
                  r"the following arguments are required: --config")


def test_a_root_without_os_release_is_refused(tmp_path: Path, cli: Cli) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    config = make_inputs(tmp_path / "in").config()
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  2, r"no os-release.*not the root of an OS image")


def test_a_driver_for_an_image_that_is_not_flatcar_is_refused(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    (root / "etc/os-release").write_text("ID=debian\nVERSION_ID=12\n")
    config = make_inputs(tmp_path / "in").config()
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  2, r"key 'driver\[1\].name': a Flatcar driver sysext needs a Flatcar image")


# Artifacts that are not what the bake config pins (exit 1): nothing is placed.
@pytest.mark.parametrize("which", ["gpunode", "driver"])
def test_a_corrupt_artifact_is_refused_and_nothing_is_placed(
        make_host: HostFactory, tmp_path: Path, cli: Cli, which: str) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "in")
    config = inputs.config(**{f"{which}_sha": sha512(b"what the publisher signed")})
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  1, r"its sha512 is .*, not the .* the bake config pins; nothing was placed")
    assert not (root / "opt/extensions").exists()


def test_a_corrupt_second_driver_of_several_is_refused_and_nothing_is_placed(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("hgx-b200", "bare").root
    inputs = make_inputs(tmp_path / "in")
    inputs.add("d580.raw", b"hsqs 580 stand-in\n" * 100)
    config = inputs.config(extra='\n[[driver]]\nname = "nvidia-drivers-580"\n'
                                 f'source = "d580.raw"\nsha512 = "{sha512(b"signed")}"\n')
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  1, r"driver-sysext nvidia-drivers-580.*its sha512 is .*; nothing was placed")
    assert not (root / "opt/extensions").exists()
    assert not (root / "etc/flatcar/sysext").exists()


def test_a_missing_artifact_file_is_refused(make_host: HostFactory, tmp_path: Path,
                                            cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "in")
    config = inputs.config()
    (tmp_path / "in" / f"flatcar-{DRIVER}.raw").unlink()
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  1, rf"Failed to bake driver-sysext {DRIVER} from .*: No such file")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_artifact_that_is_not_a_regular_file_is_refused_without_reading(
        make_host: HostFactory, tmp_path: Path, cli: Cli, kind: str) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "in")
    config = inputs.config()
    image = tmp_path / "in" / GPUNODE_FILE
    image.unlink()
    os.mkfifo(image) if kind == "fifo" else image.mkdir()
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  1, r"Failed to bake gpunode-sysext gpunode from .*(FIFO|directory)")


def test_a_placed_file_that_is_a_directory_is_refused(make_host: HostFactory, tmp_path: Path,
                                                      cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    (root / "opt/extensions/gpunode" / GPUNODE_FILE).mkdir(parents=True)
    config = make_inputs(tmp_path / "in").config()
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  1, r"gpunode-0\.2\.0-x86-64\.raw.*directory")


@pytest.mark.integration  # a socket on 127.0.0.1
@pytest.mark.parametrize("answer", ["404", "unreachable"])
def test_a_download_that_fails_is_refused_after_its_attempts(
        make_host: HostFactory, tmp_path: Path, cli: Cli, answer: str) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    inputs = make_inputs(tmp_path / "in")
    with serving(tmp_path / "in") as server:
        url = server.url if answer == "404" else "http://127.0.0.1:9/"
        config = inputs.config(base=url, driver="missing.raw", driver_sha=GOOD_SHA,
                               extra="\n[download]\nattempts = 1\ntimeout = 2\n")
        pattern = r"HTTP 404" if answer == "404" else r"cannot connect.*tried 1 times"
        check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                  str(config)], 1, pattern)


def test_an_image_whose_own_agent_config_the_node_would_refuse_is_refused(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    (root / "etc/gpunode").mkdir(parents=True)
    (root / "etc/gpunode/config.toml").write_text('[driver]\nflavour = "fast"\n')
    config = make_inputs(tmp_path / "in").config()
    result = check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                       str(config)], 2,
                           r"config\.toml:2: key 'driver\.flavour'")
    assert result.errors[0]["error_code"] == "config-invalid"


def test_a_bake_with_an_agent_config_replaces_an_invalid_one_in_the_image(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    (root / "etc/gpunode").mkdir(parents=True)
    (root / "etc/gpunode/config.toml").write_text('[driver]\nflavour = "fast"\n')
    (tmp_path / "in").mkdir()
    (tmp_path / "in/gpunode.toml").write_text('[driver]\nflavour = "open"\n')
    config = make_inputs(tmp_path / "in").config(extra='\n[agent]\nconfig = "gpunode.toml"\n')
    result = cli("image", "bake", "--root", str(root), "--config", str(config))
    assert result.code == 0, result.err
    assert (root / "etc/gpunode/config.toml").read_text() == '[driver]\nflavour = "open"\n'


def test_an_agent_config_named_before_image_is_refused_not_ignored(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    config = make_inputs(tmp_path / "in").config()
    check_refusal(cli, root, ["--config", str(config), "image", "bake", "--root", str(root),
                              "--config", str(config)], 2,
                  r"before 'image' names an agent config, which image bake does not read")
