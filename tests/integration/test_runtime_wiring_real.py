"""Runtime wiring against real containerd 1.6, 1.7 and 2.x: what each one's `config dump` makes
of gpunode's edit, with the version asked of that very binary (CommandProbe), as boot asks it
of the node's own. The decisions themselves on fixture hosts: tests/unit/test_containerd_wiring.py.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory, in_place_host
from gpunode.config import ContainerdConfig
from gpunode.containerd import step
from gpunode.containerd.edit import EditError
from gpunode.containerd.probe import CommandProbe
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
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


class RecordingProbe(CommandProbe):
    """The real probe, recording each program it starts (which programs run is the point)."""

    def __init__(self, binary: str) -> None:
        super().__init__(binary_override=binary)
        self.ran: list[tuple[str, ...]] = []

    def prefetch(self, binary: str, path: str | None, version: bool = True) -> None:
        before = set(self._started)
        super().prefetch(binary, path, version)
        self.ran += [argv[1:] for argv in self._started if argv not in before]

    def _run(self, argv: tuple[str, ...], timeout: float) -> str:
        if argv not in self._started:
            self.ran.append(argv[1:])
        return super()._run(argv, timeout)


@pytest.mark.parametrize("version", ["1.6", "1.7", "2"])
def test_boot_s_early_start_is_the_version_alone_and_a_known_version_needs_no_dump(
        make_host: HostFactory, version: str) -> None:
    """locate.early starts one Go program beside gpunode, `--version`; the plan takes its
    answer and, for a version whose defaults gpunode knows, asks for no `config dump` at
    all, writing what it writes from the real dump."""
    from gpunode.containerd import edit, locate

    real = str(ensure_binary(version).path)
    host, _ = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    config = ContainerdConfig()
    asked = RecordingProbe(real)
    located = locate.early(host, config, NoSystemd(), asked)
    assert isinstance(located, locate.Located)
    assert asked.ran == [("--version",)]
    plan = step.plan(host, config, NoSystemd(), probe=asked, located=located)
    assert asked.ran == [("--version",)]  # no dump
    assert asked._started == {}  # answered, nothing left running
    daemon = asked.version(real)
    assert daemon in edit.schema.KNOWN_DEFAULTS
    path = host.path(located.source)
    dumped = edit.parse(dump_config(Path(real), path), "dump")
    from_dump = edit.configure(located.source_text, step.spec_from(config, daemon),
                               str(path), dumped, daemon)
    assert plan.edit.text == from_dump.text
    assert "nvidia" in plan.edit.text


def test_an_unknown_version_s_dump_is_asked_after_it(make_host: HostFactory,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A version whose defaults gpunode does not know (here the real 2.1, taken as unknown):
    the plan asks for its `config dump` once it has the version, and copies from it."""
    from gpunode.containerd import edit, locate

    monkeypatch.setattr(edit.schema, "KNOWN_DEFAULTS", frozenset())
    real = str(ensure_binary("2").path)
    host, _ = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    config = ContainerdConfig()
    asked = RecordingProbe(real)
    located = locate.early(host, config, NoSystemd(), asked)
    assert isinstance(located, locate.Located)
    plan = step.plan(host, config, NoSystemd(), probe=asked, located=located)
    path = str(host.path(located.source))
    assert asked.ran == [("--version",), ("--config", path, "config", "dump")]
    assert asked._started == {}
    runtime = tomllib.loads(plan.edit.text)["plugins"][CRI[2]]["containerd"]["runtimes"]
    assert runtime["nvidia"]["sandbox_mode"] == "podsandbox"  # 2.1's built-in runc, dumped
