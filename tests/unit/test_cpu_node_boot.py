"""The CPU node's boot decided from sysfs alone (gpunode/pipeline/shortcut.py): the same record
and events as the whole pipeline writes on that node, and the whole pipeline wherever anything
is not plain."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.cli.main import main
from gpunode.pipeline import shortcut
from gpunode.platform.host import Host

RECORD = "run/gpunode/state.json"
STEADY = ("started_at", "finished_at")


def boot(capsys: pytest.CaptureFixture[str], host: Host,
         log_format: str = "json") -> tuple[int, list[str]]:
    code = main(["--root", str(host.root), "--log-format", log_format, "boot"])
    return code, capsys.readouterr().err.splitlines()


def steady(record: dict[str, object]) -> dict[str, object]:
    """The record without its times (the durations differ from run to run)."""
    steps = [{k: v for k, v in s.items() if k != "duration_ms"}  # type: ignore[attr-defined]
             for s in record["steps"]]  # type: ignore[attr-defined]
    return {**{k: v for k, v in record.items() if k not in STEADY}, "steps": steps}


def test_the_shortcut_s_record_and_events_are_the_whole_pipeline_s(
        make_host: HostFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fast, whole = make_host("azure-d4s-v5", "bare"), make_host("azure-d4s-v5", "bare")
    code, fast_lines = boot(capsys, fast)
    assert code == 0
    taken: list[bool] = []
    real = shortcut.boot_without_gpu
    monkeypatch.setattr(shortcut, "boot_without_gpu",
                        lambda *args: taken.append(real(*args)) or False)
    code, whole_lines = boot(capsys, make_host("azure-d4s-v5", "bare"))
    assert code == 0 and taken == [True]  # it would have answered: the pipeline answered again
    monkeypatch.setattr(shortcut, "boot_without_gpu", lambda *args: False)
    code, whole_lines = boot(capsys, whole)
    assert code == 0
    assert steady(json.loads((fast.root / RECORD).read_text())) == \
        steady(json.loads((whole.root / RECORD).read_text()))
    fast_events = [{k: v for k, v in json.loads(line).items()
                    if k not in ("timestamp", "duration_ms")} for line in fast_lines]
    whole_events = [{k: v for k, v in json.loads(line).items()
                     if k not in ("timestamp", "duration_ms")} for line in whole_lines]
    assert fast_events == whole_events


def test_the_shortcut_answers_a_cpu_node_without_the_pipeline(
        make_host: HostFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Neither the pipeline nor systemd is asked on a plain CPU node."""
    monkeypatch.delitem(sys.modules, "gpunode.pipeline.boot", raising=False)
    code, _ = boot(capsys, make_host("azure-d4s-v5", "bare"))
    assert code == 0 and "gpunode.pipeline.boot" not in sys.modules


def test_the_console_lines_say_the_same(make_host: HostFactory, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = boot(capsys, make_host("azure-d4s-v5", "bare"), "console")
    assert code == 0
    assert "step.done" in lines[0] and "step=detect" in lines[0] and "gpus=0" in lines[0]
    assert "boot.done" in lines[1] and "outcome=no-gpu" in lines[1]


def _gpu(root: Path) -> None:
    function = root / "sys/bus/pci/devices/0001:00:00.0"
    function.mkdir(parents=True)
    (function / "vendor").write_text("0x10de\n")


def _fifo_vendor(root: Path) -> None:
    vendor = next((root / "sys/bus/pci/devices").iterdir()) / "vendor"
    vendor.unlink()
    os.mkfifo(vendor)


def _agent_config(root: Path) -> None:
    (root / "etc/gpunode").mkdir(parents=True)
    (root / "etc/gpunode/config.toml").write_text("[detect]\nsource = 'nope'\n")


def _cdi_spec(root: Path) -> None:
    (root / "var/run/cdi").mkdir(parents=True)
    (root / "var/run/cdi/nvidia.yaml").write_text(
        "# Written by gpunode (gpunode cdi generate); gpunode boot keeps it current.\n{}\n")


@pytest.mark.parametrize(("change", "code", "events", "says"), [
    # the pipeline's detect decides: a function it cannot identify is no "no GPU"
    (_gpu, 1, [("step.failed", "detect"), ("boot.done", None)], "cannot tell whether"),
    # an agent config is checked whole: a bad one is refused
    (_agent_config, 2, [("command.refused", None)], "detect.source"),
    # gpunode's spec on a node without GPU: the cdi step removes it
    (_cdi_spec, 0, [("step.done", "detect"), ("step.done", "cdi"), ("boot.done", None)], ""),
    # a vendor file that is no file: detect reads around it, and says so
    (_fifo_vendor, 0, [("step.done", "detect"), ("boot.done", None)], ""),
    # the record's place is a directory: the pipeline's refusal names it
    (lambda root: (root / RECORD).mkdir(parents=True), 1,
     [("step.done", "detect"), ("command.failed", None)], "state.json"),
], ids=["nvidia-function", "agent-config", "cdi-spec", "fifo-vendor", "record-is-a-dir"])
def test_anything_not_plain_goes_through_the_whole_pipeline(
        make_host: HostFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], change: object, code: int,
        events: list[tuple[str, str | None]], says: str) -> None:
    host = make_host("azure-d4s-v5", "bare")
    change(host.root)  # type: ignore[operator]
    got, lines = boot(capsys, host)
    logged = [json.loads(line) for line in lines if line.startswith("{")]
    assert (got, [(e["event"], e.get("step")) for e in logged]) == (code, events)
    assert says in " ".join(str(e.get("error", "")) for e in logged)
    assert not (host.root / "var/run/cdi/nvidia.yaml").exists() or change is not _cdi_spec
    assert not list(host.root.rglob("*.gpunode-tmp"))


def test_a_record_link_pointing_out_of_the_root_stays_inside_it(
        make_host: HostFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    host = make_host("azure-d4s-v5", "bare")
    outside = tmp_path / "outside"
    outside.mkdir()
    (host.root / "run").mkdir(exist_ok=True)
    (host.root / "run/gpunode").symlink_to(outside)  # absolute: re-rooted under --root
    code, _ = boot(capsys, host)
    assert code == 0
    assert list(outside.iterdir()) == []
