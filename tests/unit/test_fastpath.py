"""The no-op boot: a second `gpunode boot` in the same boot with nothing changed answers from
a stamp of its inputs, and any changed input sends it through the whole pipeline again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.cli import entry
from gpunode.pipeline import fastpath
from gpunode.platform.host import Host


def boot(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], host: Host,
         *extra: str) -> tuple[int, list[str]]:
    monkeypatch.setattr(sys, "argv", ["gpunode", "--root", str(host.root), "--log-format",
                                      "json", *extra, "boot"])
    code = entry.main()
    return code, [json.loads(line)["event"] for line in capsys.readouterr().err.splitlines()]


@pytest.fixture
def node(make_host: HostFactory) -> Host:
    return make_host("nc4as-t4-v3", "ready")


def test_second_boot_with_nothing_changed_is_answered_from_the_stamp(
    node: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert boot(monkeypatch, capsys, node)[1][-1] == "boot.done"
    record = (node.root / "run/gpunode/state.json").read_bytes()
    assert boot(monkeypatch, capsys, node) == (0, ["boot.unchanged"])
    assert (node.root / "run/gpunode/state.json").read_bytes() == record  # no new record


@pytest.mark.parametrize("change", [
    "etc/containerd/config.toml", "etc/gpunode/config.toml", "proc/driver/nvidia/version",
    "dev/nvidia0", "sys/bus/pci/devices/0005:00:00.0", "usr/lib/systemd/system/containerd.service",
], ids=["containerd-config", "agent-config", "driver", "device-node", "pci", "unit"])
def test_any_changed_input_runs_the_whole_pipeline(
    node: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], change: str
) -> None:
    boot(monkeypatch, capsys, node)
    path = node.root / change
    if path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# changed\n")
    _, events = boot(monkeypatch, capsys, node)
    assert "boot.unchanged" not in events


def test_a_failed_boot_leaves_no_stamp(
    make_host: HostFactory, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host = make_host("nc4as-t4-v3", "bare")  # nothing can load the driver here
    assert boot(monkeypatch, capsys, host)[0] == 1
    assert not (host.root / "run/gpunode/inputs.json").exists()
    assert boot(monkeypatch, capsys, host)[1][-1] == "boot.done"


def test_another_gpunode_version_ignores_the_stamp(node: Host) -> None:
    stamp = fastpath.compute(str(node.root), ["/etc/gpunode/config.toml"], "0.0.1", None)
    (node.root / "run/gpunode").mkdir(parents=True, exist_ok=True)
    (node.root / "run/gpunode/inputs.json").write_text(json.dumps(stamp))
    assert fastpath.unchanged(str(node.root), "0.0.1", None)
    assert not fastpath.unchanged(str(node.root), "0.0.2", None)


@pytest.mark.parametrize(("argv", "parsed"), [
    (["boot"], (("boot",), "/", None, None)),
    (["--root", "/mnt/node", "--log-format=json", "boot"], (("boot",), "/mnt/node", None,
                                                             "json")),
    # as given: the command resolves them as the full command line does (clirun.host_for)
    (["--root", "link/..", "--config", "sub/../c.toml", "boot"], (("boot",), "link/..",
                                                                   "sub/../c.toml", None)),
    (["status"], (("status",), "/", None, None)),
    (["--root=/n", "status", "--json"], (("status", "--json"), "/n", None, None)),
    (["status", "--js"], None),  # argparse's abbreviation: the full CLI's to read
    (["status", "--json", "--json"], None),
    (["--json", "status"], None),
    (["detect"], None),
    (["boot", "--help"], None),
    (["--verbose", "boot"], None),
    (["--root", "", "boot"], None),
    (["--root"], None),
])
def test_only_a_plain_boot_or_status_skips_the_full_command_line(argv: list[str],
                                                                 parsed: object) -> None:
    assert fastpath.plain_args(argv) == parsed


def test_stamp_lists_the_inputs_the_boot_read(node: Host, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    boot(monkeypatch, capsys, node)
    inputs = json.loads((node.root / "run/gpunode/inputs.json").read_text())["inputs"]
    assert {"/etc/containerd/config.toml", "/proc/driver/nvidia/version", "/dev/nvidia0",
            "/dev/nvidia-uvm", "/sys/bus/pci/devices/", "/etc/gpunode/config.toml"} <= set(inputs)
    assert not any(p.startswith(str(node.root)) for p in inputs)  # host paths only


def test_an_edited_symlink_target_runs_the_whole_pipeline(
    node: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """/etc/containerd/config.toml a link to a file elsewhere: editing that file is a change."""
    config = node.root / "etc/containerd/config.toml"
    real = node.root / "srv/containerd.toml"
    real.parent.mkdir()
    real.write_bytes(config.read_bytes())
    config.unlink()
    config.symlink_to("/srv/containerd.toml")  # absolute: resolved inside the root
    boot(monkeypatch, capsys, node)
    assert boot(monkeypatch, capsys, node)[1] == ["boot.unchanged"]
    with real.open("a") as f:
        f.write("# edited by hand\n")
    assert "boot.unchanged" not in boot(monkeypatch, capsys, node)[1]


def test_a_symlink_is_signed_by_its_target_inside_the_root_never_outside(node: Host) -> None:
    (node.root / "etc/hostname").write_text("fixture\n")
    (node.root / "etc/link").symlink_to("/etc/hostname")
    sig = fastpath.signature(str(node.root), "/etc/link")
    assert sig[5:] == ["/etc/hostname", *_fields(node.root / "etc/hostname")]


def test_a_symlink_that_climbs_out_of_the_root_is_never_unchanged(node: Host) -> None:
    from gpunode import __version__

    (node.root / "etc/escape").symlink_to("../../../../../../../../../../etc/hostname")
    stamp = fastpath.compute(str(node.root), ["/etc/escape"], __version__, None)
    assert stamp["inputs"]["/etc/escape"] == {"unreadable": "a symlink climbs above the root"}
    (node.root / "run/gpunode").mkdir(parents=True, exist_ok=True)
    (node.root / "run/gpunode/inputs.json").write_text(json.dumps(stamp))
    assert not fastpath.unchanged(str(node.root), __version__, None)


def _fields(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_rdev]


@pytest.mark.parametrize("text", [
    '{"stamp_version": 2, "inputs": {"/a": [1, 2, "x"], "/b/": ["n\\u00e9"]}}\n',
    '{"a": [1.5, -2, 1e3, true, false, null, {}], "b": "\\ud83d\\ude00"}', '[]', '"s"', "7"])
def test_the_stamp_reader_reads_what_json_reads(text: str) -> None:
    assert fastpath._json_document(text) == json.loads(text)


@pytest.mark.parametrize("text", [
    '{"a": [1,', '{"a": 1} {"b": 2}', '{"a": NaN}', '{"a": Infinity}', "", "   ",
    '{"a": "tab\tin a string"}', "{'a': 1}", '{"a": 1,}', " {}"])
def test_the_stamp_reader_refuses_with_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        fastpath._json_document(text)


@pytest.mark.parametrize(("argv", "word"), [
    (["watch"], "watch"), (["--root", "/x", "--log-format", "json", "watch", "--once"], "watch"),
    (["--root=/x", "status"], "status"), (["--config", "watch", "boot"], "boot"),
    (["--log-format", "json"], None), ([], None), (["-h"], None)])
def test_the_command_word_skips_the_global_options_and_their_values(
        argv: list[str], word: str | None) -> None:
    assert fastpath.command_word(argv) == word


@pytest.mark.parametrize(("argv", "collecting"), [
    (["status", "--json"], False), (["--root", "/", "boot"], False), (["--version"], False),
    (["watch"], True), (["--log-format", "json", "watch", "--interval", "5"], True)])
def test_only_the_daemon_runs_with_the_cycle_collector(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], collecting: bool) -> None:
    """entry.run, the installed entry point: a one-shot command is spared the collector's
    passes over every module's objects; the node-lifetime daemon keeps it."""
    import gc

    seen: list[bool] = []
    monkeypatch.setattr(sys, "argv", ["gpunode", *argv])
    monkeypatch.setattr(entry, "main", lambda: seen.append(gc.isenabled()) or 3)
    monkeypatch.setattr(entry.atexit, "_run_exitfuncs", lambda: None)  # pytest's own

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(entry.os, "_exit", exit_)
    try:
        with pytest.raises(SystemExit) as ended:
            entry.run()
    finally:
        gc.enable()
    assert (seen, ended.value.code) == ([collecting], 3)
