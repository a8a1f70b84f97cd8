"""Runtime wiring against real containerd 1.6, 1.7 and 2.x: what each one's `config dump` makes
of gpunode's edit, with the version asked of that very binary (CommandProbe), as boot asks it
of the node's own. The decisions themselves on fixture hosts: tests/unit/test_containerd_wiring.py.
"""

from __future__ import annotations

import io
import json
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory, in_place_host
from gpunode import log
from gpunode.config import ContainerdConfig
from gpunode.containerd import probe, step
from gpunode.containerd.edit import EditError
from gpunode.containerd.probe import CommandProbe
from gpunode.host import Host
from gpunode.systemd import NoSystemd
from gpunode_testing import fixtures
from real.containerd_bins import dump_config, ensure_binary

CRI = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}


def configured(make_host: HostFactory, version: str, config: ContainerdConfig,
               text: str = fixtures.FLATCAR_CONTAINERD_CONFIG) -> tuple[Host, Path, dict[str, Any]]:
    """A node whose config is `text`, configured as real containerd `version` reads it; the
    written file and that containerd's dump of it."""
    binary = ensure_binary(version).path
    host, target = in_place_host(make_host, text)
    for name in ("nvidia-container-runtime.cdi", "nvidia-container-runtime.legacy"):
        tool = host.root / "usr/bin" / name
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    probe = CommandProbe(binary_override=str(binary))
    step.apply(host, step.plan(host, config, NoSystemd(), probe=probe), NoSystemd(), 5)
    return host, target, tomllib.loads(dump_config(binary, target))


def cri_of(dump: dict[str, Any]) -> dict[str, Any]:
    return dump["plugins"][CRI[dump.get("version", 1)]]


@pytest.mark.parametrize("version", ["1.7"])
def test_containerd_1_7_dumps_cdi_enabled_after_the_default_edit(
    make_host: HostFactory, version: str,
) -> None:
    _, target, dump = configured(make_host, version, ContainerdConfig())
    assert cri_of(dump)["enable_cdi"] is True
    assert "/var/run/cdi" in cri_of(dump)["cdi_spec_dirs"]
    assert "enable_cdi = true" in target.read_text()


def test_containerd_1_6_has_no_cdi_so_gpunode_writes_none() -> None:
    """1.6 drops enable_cdi from its dump: the key means nothing to it, and auto writes none."""
    binary = ensure_binary("1.6").path
    assert "enable_cdi" not in dump_config(binary, Path("/dev/null"))


def test_containerd_1_6_auto_edit_writes_no_cdi_key(make_host: HostFactory) -> None:
    _, target, dump = configured(make_host, "1.6", ContainerdConfig())
    assert "enable_cdi" not in target.read_text()
    assert "nvidia" in cri_of(dump)["containerd"]["runtimes"]


def test_containerd_2_dump_has_cdi_on_and_gpunode_wrote_no_deprecated_key(
    make_host: HostFactory,
) -> None:
    _, target, dump = configured(make_host, "2", ContainerdConfig())
    assert "enable_cdi" not in target.read_text() and "cdi_spec_dirs" not in target.read_text()
    cri = dump["plugins"]["io.containerd.cri.v1.runtime"]
    assert cri["enable_cdi"] is True  # 2.x's own default
    assert "/var/run/cdi" in cri["cdi_spec_dirs"]


@pytest.mark.parametrize("version", ["1.6", "1.7", "2"])
def test_mode_runtimes_run_the_toolkits_cdi_and_legacy_binaries(
    make_host: HostFactory, version: str,
) -> None:
    _, _, dump = configured(make_host, version, ContainerdConfig(mode_runtimes=True))
    runtimes = cri_of(dump)["containerd"]["runtimes"] if version != "2" else \
        dump["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert {name: rt["options"]["BinaryName"] for name, rt in runtimes.items()
            if name.startswith("nvidia")} == {
        "nvidia": "/usr/bin/nvidia-container-runtime",
        "nvidia-cdi": "/usr/bin/nvidia-container-runtime.cdi",
        "nvidia-legacy": "/usr/bin/nvidia-container-runtime.legacy"}
    assert runtimes["runc"]["options"]["SystemdCgroup"] is True  # the copies keep the file's


def test_cdi_mode_on_containerd_1_7_enables_cdi_and_adds_no_runtime(
    make_host: HostFactory,
) -> None:
    _, target, dump = configured(make_host, "1.7", ContainerdConfig(gpu_access="cdi"))
    assert cri_of(dump)["enable_cdi"] is True
    assert "nvidia" not in cri_of(dump)["containerd"]["runtimes"]
    assert "nvidia-container-runtime" not in target.read_text()


def test_cdi_mode_on_containerd_2_changes_nothing_in_the_config(make_host: HostFactory) -> None:
    text = fixtures.FLATCAR_CONTAINERD_CONFIG
    _, target, dump = configured(make_host, "2", ContainerdConfig(gpu_access="cdi"), text)
    assert target.read_text() == text
    assert dump["plugins"]["io.containerd.cri.v1.runtime"]["enable_cdi"] is True


def test_cdi_mode_on_containerd_1_6_is_refused_naming_the_version(
    make_host: HostFactory,
) -> None:
    binary = ensure_binary("1.6").path
    host, target = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    with pytest.raises(EditError, match=r"containerd 1\.6 does not have .*came with containerd "
                       r"1\.7"):
        step.plan(host, ContainerdConfig(gpu_access="cdi"), NoSystemd(),
                  probe=CommandProbe(binary_override=str(binary)))
    assert target.read_text() == fixtures.FLATCAR_CONTAINERD_CONFIG


def test_the_version_and_the_dump_are_asked_side_by_side(
        make_host: HostFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first run asks containerd both questions at once: here the binary answers --version
    only after its `config dump` has started (a FIFO between them), which one after the other
    would never do (the version's time limit would pass, logged as containerd.version_unknown).
    The answers are the real 2.x's."""
    monkeypatch.setattr(probe, "VERSION_TIMEOUT", 3.0)
    stream = io.StringIO()
    log.configure("json", stream=stream)
    real = ensure_binary("2").path
    fifo = tmp_path / "dump-started"
    os.mkfifo(fifo)
    binary = tmp_path / "containerd"
    binary.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then read started < {fifo}; exec {real} --version; fi
echo yes > {fifo}
exec {real} "$@"
""")
    binary.chmod(0o755)
    host, _ = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    plan = step.plan(host, ContainerdConfig(), NoSystemd(),
                     probe=CommandProbe(binary_override=str(binary)))
    written = tomllib.loads(plan.edit.text)
    runtime = written["plugins"][CRI[2]]["containerd"]["runtimes"]["nvidia"]
    assert runtime["options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"
    assert runtime["runtime_type"] == "io.containerd.runc.v2"
    events = [json.loads(line)["event"] for line in stream.getvalue().splitlines()]
    assert "containerd.version_unknown" not in events and "containerd.dump_unavailable" \
        not in events


def test_boot_s_early_start_is_the_dump_alone_and_the_plan_takes_it(
        make_host: HostFactory) -> None:
    """locate.early starts one Go program beside gpunode, the longer `config dump` (where a
    runtime is to be added); the plan then asks the version and takes the dump already
    running. The answers are the real 2.x's."""
    from gpunode.containerd import locate

    real = str(ensure_binary("2").path)
    host, _ = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    config = ContainerdConfig()
    asked = CommandProbe(binary_override=real)
    located = locate.early(host, config, NoSystemd(), asked)
    assert isinstance(located, locate.Located)
    # (the probe's own record of what it started: which programs run is the point here)
    assert [argv[1:] for argv in asked._started] == [
        ("--config", str(host.path(located.source)), "config", "dump")]
    plan = step.plan(host, config, NoSystemd(), probe=asked, located=located)
    runtime = tomllib.loads(plan.edit.text)["plugins"][CRI[2]]["containerd"]["runtimes"]
    assert runtime["nvidia"]["runtime_type"] == "io.containerd.runc.v2"
    assert asked._started == {}  # both answered, nothing left running
