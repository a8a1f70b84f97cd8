"""Hostile inputs to gpunode's parsers: documents nested thousands deep, a byte order mark,
configs over the size cap, an agent config as large as the node allows.

Every JSON record and TOML config goes through one parser (platform/records.py loads_json,
platform/tomlread.py loads_toml), so each case here is a command a user runs and the contract
it keeps: one clear refusal (exit code, one JSON error event naming the file, every file as it
was, no traceback), or for `boot` a record naming the failed step.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.containerd import edit, journal, undo
from gpunode.errors import FileError
from gpunode.platform import records
from gpunode.platform.tomlread import loads_toml
from gpunode_testing import fixtures
from hostile.support import Cli, check_refusal

USR_CONFIG = "usr/share/containerd/config.toml"  # what Flatcar's containerd.service names
LEDGER = "var/lib/gpunode/containerd.json"
RECORD = "run/gpunode/state.json"
KUBECONFIG = "etc/kubernetes/kubelet.conf"
DEEP = 100000

# A containerd config nested too deeply: tomllib recurses into inline arrays (RecursionError),
# and a long dotted header parses fine into a document every later walk recurses into.
NESTED_TOML = {
    "inline-array-3000": "version = 2\nx = " + "[" * 3000 + "]" * 3000 + "\n",
    "inline-table-3000": "version = 2\nx = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",
    "header-3000": "version = 2\n[" + ".".join(["a"] * 3000) + "]\nb = 1\n",
}
TOO_DEEP = r"not valid for gpunode: nested too deeply"


def runtime_binary(root: Path) -> Path:
    runtime = root / "usr/bin/nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    return root


def failed_boot_step(cli: Cli, root: Path, step: str) -> dict[str, object]:
    """Run `boot`: it fails (exit 1) without a traceback, and records `step` as failed."""
    result = cli("--root", str(root), "boot")
    assert (result.code, "Traceback" in result.err) == (1, False), result.err
    assert all(line.startswith("{") for line in result.err.splitlines())
    record = json.loads((root / RECORD).read_text())
    found = next(s for s in record["steps"] if s["name"] == step)
    assert (record["outcome"], found["outcome"]) == ("failed", "failed")
    return found  # type: ignore[no-any-return]


# -- a containerd config nested too deeply ----------------------------------------------------


@pytest.mark.parametrize("command", [["status"], ["containerd", "configure", "--dry-run"],
                                     ["containerd", "configure"]],
                         ids=["status", "configure-dry-run", "configure"])
@pytest.mark.parametrize("case", list(NESTED_TOML))
def test_a_containerd_config_nested_too_deeply_is_one_refusal(
    make_host: HostFactory, cli: Cli, case: str, command: list[str]
) -> None:
    root = runtime_binary(make_host("nc4as-t4-v3", "driver").root)
    (root / USR_CONFIG).write_text(NESTED_TOML[case])
    if command == ["status"]:
        result = cli("--root", str(root), "status", "--json")
        assert (result.code, "Traceback" in result.err) == (1, False), result.err
        check = next(c for c in json.loads(result.out)["checks"]
                     if c["name"] == "containerd_runtime")
        assert "config.toml" in check["detail"] and "nested too deeply" in check["detail"]
        return
    check_refusal(cli, root, ["--root", str(root), *command], 1,
                  r"share/containerd/config\.toml: " + TOO_DEEP)


@pytest.mark.parametrize("case", list(NESTED_TOML))
def test_boot_records_a_containerd_config_nested_too_deeply_as_its_failed_step(
    make_host: HostFactory, cli: Cli, case: str
) -> None:
    root = runtime_binary(make_host("nc4as-t4-v3", "driver").root)
    (root / USR_CONFIG).write_text(NESTED_TOML[case])
    step = failed_boot_step(cli, root, "containerd")
    assert "nested too deeply" in str(step["error"]), step


# -- gpunode's own records nested too deeply --------------------------------------------------


def configured(make_host: HostFactory, cli: Cli) -> Path:
    root = runtime_binary(make_host("nc4as-t4-v3", "driver").root)
    assert cli("--root", str(root), "containerd", "configure").code == 0
    return root


DEEP_JSON = {
    "ledger": (LEDGER, r"containerd\.json: not JSON for gpunode: nested too deeply"),
    "journal": (journal.JOURNAL.lstrip("/"),
                r"containerd-journal: not JSON for gpunode: nested too deeply"),
}


@pytest.mark.parametrize("command", ["revert", "configure"])
@pytest.mark.parametrize("record", list(DEEP_JSON))
def test_a_record_nested_too_deeply_is_one_refusal(
    make_host: HostFactory, cli: Cli, record: str, command: str
) -> None:
    root = configured(make_host, cli)
    path, pattern = DEEP_JSON[record]
    (root / path).write_text("[" * DEEP + "]" * DEEP)
    check_refusal(cli, root, ["--root", str(root), "containerd", command], 1, pattern)


@pytest.mark.parametrize("record", list(DEEP_JSON))
def test_boot_records_a_record_nested_too_deeply_as_the_containerd_steps_failure(
    make_host: HostFactory, cli: Cli, record: str
) -> None:
    root = configured(make_host, cli)
    path, _ = DEEP_JSON[record]
    (root / path).write_text("[" * DEEP + "]" * DEEP)
    step = failed_boot_step(cli, root, "containerd")
    assert "nested too deeply" in str(step["error"]), step


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, "a:\n" + "".join(
    " " * i + "- \n" for i in range(1, 1900))], ids=["flow-100000", "block-1900"])
def test_a_kubeconfig_nested_too_deeply_is_one_refusal_for_label(
    make_host: HostFactory, cli: Cli, text: str
) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    (root / KUBECONFIG).parent.mkdir(parents=True)
    (root / KUBECONFIG).write_text(text)
    check_refusal(cli, root, ["--root", str(root), "label"], 1,
                  r"kubelet\.conf: not valid (for gpunode: nested too deeply|YAML)")


# -- a byte order mark ------------------------------------------------------------------------

BOM_CONFIG = "\ufeff" + fixtures.FLATCAR_CONTAINERD_CONFIG
# containerd 2.x refuses a BOM, so under --root (version unknown) only a version 1 file, which
# only 1.x reads, is configured with one (tests/hostile/test_containerd_round2.py)
BOM_V1_CONFIG = ('\ufeff[plugins.cri.containerd.runtimes.runc]\n'
                 'runtime_type = "io.containerd.runc.v2"\n')


def test_edit_reverts_a_config_that_starts_with_a_byte_order_mark() -> None:
    configured_text = edit.configure(BOM_CONFIG, edit.RuntimeSpec(), "f", daemon=(1, 7)).text
    assert undo.revert(configured_text, "nvidia", (), "f", ()).text == BOM_CONFIG


def test_configure_then_revert_gives_back_a_config_with_a_byte_order_mark(
    make_host: HostFactory, cli: Cli
) -> None:
    root = runtime_binary(make_host("nc4as-t4-v3", "driver").root)
    config = root / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(BOM_V1_CONFIG)
    argv = ["--root", str(root), "containerd"]
    configured = cli(*argv, "configure", "--config", "/etc/containerd/config.toml", "--force")
    assert configured.code == 0, configured.err
    assert "nvidia" in config.read_text()
    result = cli(*argv, "revert")
    assert (result.code, "Traceback" in result.err) == (0, False), result.err
    assert config.read_text() == BOM_V1_CONFIG


# -- one size cap for containerd configs, the node's for the agent config ----------------------


@pytest.mark.parametrize("command", [["containerd", "configure", "--dry-run"],
                                     ["containerd", "configure"]], ids=["dry-run", "configure"])
def test_a_2_mib_and_a_20_mib_containerd_config_get_the_same_refusal(
    make_host: HostFactory, cli: Cli, command: list[str]
) -> None:
    events = []
    for mib in (2, 20):
        root = runtime_binary(make_host("nc4as-t4-v3", "driver").root)
        (root / USR_CONFIG).write_text(fixtures.FLATCAR_CONTAINERD_CONFIG + "#" * (mib << 20))
        result = check_refusal(cli, root, ["--root", str(root), *command], 1,
                               r"share/containerd/config\.toml: is larger than 1 MiB")
        event = result.errors[0]
        events.append((str(event["error"]).replace(str(root), "<root>"), event.get("hint")))
    assert events[0] == events[1]
    assert "containerd.service names" not in str(events[0][1])


def test_an_agent_config_of_2_mib_the_node_accepts_goes_into_the_ignition_snippet(
    make_host: HostFactory, cli: Cli, tmp_path: Path
) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[log]\nlevel = \"debug\"\n" + "#" * (2 << 20) + "\n")
    node = make_host("nc4as-t4-v3", "ready").root
    assert cli("--root", str(node), "--config", str(path), "plan").code in (0, 1)
    assert "ConfigError" not in cli("--root", str(node), "--config", str(path), "plan").err
    sha = hashlib.sha512(b"x").hexdigest()
    result = cli("ignition", "--sysext-url", "https://example.com/gpunode.raw",
                 "--sysext-sha512", sha, "--format", "ignition", "--agent-config", str(path))
    assert (result.code, "Traceback" in result.err) == (0, False), result.err
    assert "/etc/gpunode/config.toml" in result.out


UNITS = Path(__file__).parents[2] / "units"


@pytest.mark.parametrize("case", ["symlink-loop", "name-too-long"])
def test_a_unit_file_ignition_cannot_read_is_a_usage_refusal(
    tmp_path: Path, cli: Cli, case: str
) -> None:
    units = tmp_path / "units"
    shutil.copytree(UNITS, units)
    unit = units / "gpunode.service"
    if case == "symlink-loop":
        unit.unlink()
        unit.symlink_to(unit)
        pattern = r"gpunode\.service: too many levels of symbolic links"
    else:  # a read that fails with an errno (ENAMETOOLONG) rather than a refused kind
        units = units / ("x" * 300)
        pattern = r"gpunode\.service: File name too long"
    sha = hashlib.sha512(b"x").hexdigest()
    check_refusal(cli, tmp_path, ["ignition", "--sysext-url", "https://example.com/g.raw",
                                  "--sysext-sha512", sha, "--units", str(units)], 2, pattern)


# -- schema_version true is not 1 --------------------------------------------------------------


@pytest.mark.parametrize("record", ["ledger", "journal"])
def test_a_record_whose_schema_version_is_true_is_refused(
    make_host: HostFactory, cli: Cli, record: str
) -> None:
    root = configured(make_host, cli)
    if record == "ledger":
        document = json.loads((root / LEDGER).read_text())
        path, pattern = LEDGER, r"containerd\.json: key 'schema_version' is true, expected 1"
    else:
        document = {"schema_version": True, "files": [], "created_dirs": [], "removed_dirs": []}
        path, pattern = journal.JOURNAL.lstrip("/"), r"not a gpunode journal \(schema_version 1\)"
    (root / path).write_text(json.dumps({**document, "schema_version": True}))
    check_refusal(cli, root, ["--root", str(root), "containerd", "revert"], 1, pattern)


# -- the two parsers themselves ---------------------------------------------------------------


@pytest.mark.parametrize("data", [b"[" * DEEP + b"]" * DEEP, b"[" * 150 + b"]" * 150,
                                  b'{"a": ' * 150 + b"1" + b"}" * 150],
                         ids=["recursion-limit", "list-150", "object-150"])
def test_loads_json_refuses_any_document_nested_too_deeply(data: bytes) -> None:
    with pytest.raises(ValueError, match=r"^f: not JSON for gpunode: nested too deeply"):
        records.loads_json(data, "f")


def test_loads_json_reads_a_document_as_deep_as_the_limit() -> None:
    depth = records.MAX_DEPTH
    assert records.loads_json("[" * depth + "]" * depth, "f") == json.loads("[" * depth +
                                                                            "]" * depth)


def test_loads_toml_drops_a_byte_order_mark_and_names_the_line_of_an_error() -> None:
    assert loads_toml("\ufeffa = 1\n", "f") == {"a": 1}
    with pytest.raises(FileError, match=r"^f:2: not valid TOML"):
        loads_toml("\ufeffa = 1\nb =\n", "f")


def test_the_reader_does_not_take_true_for_the_schema_version_1() -> None:
    reader = records.Reader({"schema_version": True}, "f", ValueError)
    with pytest.raises(ValueError, match=r"^f: key 'schema_version' is true, expected 1$"):
        reader.schema("schema_version", 1)
