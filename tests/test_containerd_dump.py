"""Real containerd (1.6, 1.7, 2.x) parses and merges every config gpunode writes, and its own
dump shows exactly one change: the nvidia runtime, equal to its source except BinaryName."""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from test_containerd_edit import spec_for

from gpunode.containerd import schema
from gpunode.containerd.edit import configure, configure_dropin
from real.containerd_bins import dump_config, ensure_containerd

pytestmark = pytest.mark.integration

VECTORS = Path(__file__).parent / "data" / "containerd" / "vectors"
VERSIONS = ("1.6", "1.7", "2")


def cases() -> list[tuple[str, str]]:
    """Every vector on every containerd that reads its config version: version 3 is 2.x only,
    and containerd 2.x drops every CRI setting of a version 1 file (it renames the plugin but
    does not migrate its contents), so a v1 file is only meaningful on 1.x."""
    out = []
    for vector in sorted(p.name for p in VECTORS.iterdir()):
        text = (VECTORS / vector / "input.toml").read_text()
        version = schema.config_version(tomllib.loads(text))
        readers = {1: ("1.6", "1.7"), 2: VERSIONS, 3: ("2",)}[version]
        out += [(vector, containerd) for containerd in readers]
    return out


@pytest.fixture(scope="module")
def binaries() -> dict[str, Path]:
    return {version: ensure_containerd(version) for version in VERSIONS}


def dump(binary: Path, text: str, tmp_path: Path, name: str) -> dict[str, Any]:
    path = tmp_path / name
    path.write_text(text)
    doc = tomllib.loads(dump_config(binary, path))
    # containerd lists the file it loaded among `imports`; that is not a difference.
    doc["imports"] = [i for i in doc.get("imports", []) if i != str(path)]
    return doc


def runtimes_of(doc: dict[str, Any]) -> dict[str, Any]:
    return schema.lookup(doc, schema.runtimes_path(schema.config_version(doc))) or {}


def spec_keys(name: str) -> dict[str, Any]:
    path = VECTORS / name / "spec.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.parametrize(("vector", "containerd"), cases(),
                         ids=[f"{v}-containerd{c}" for v, c in cases()])
def test_dump_shows_exactly_the_nvidia_runtime_added(
    binaries: dict[str, Path], tmp_path: Path, vector: str, containerd: str
) -> None:
    binary = binaries[containerd]
    source = (VECTORS / vector / "input.toml").read_text()
    before = dump(binary, source, tmp_path, "before.toml")
    # As on a node: the copy is made with containerd's own view of the source runtime.
    result = configure(source, spec_for(vector), vector, effective=before).text
    after = dump(binary, result, tmp_path, "after.toml")

    old, new = runtimes_of(before), runtimes_of(after)
    assert set(new) - set(old) <= {"nvidia"}
    nvidia = copy.deepcopy(new["nvidia"])
    assert nvidia["options"].pop("BinaryName") == "/usr/bin/nvidia-container-runtime"
    if "nvidia" not in old:  # added: a copy of runc as containerd itself sees runc
        runc = copy.deepcopy(old["runc"])
        runc.get("options", {}).pop("BinaryName", None)
        assert nvidia == runc

    # Everything else in the effective config is what it was.
    wanted = spec_keys(vector)
    for doc in (before, after):
        runtimes_of(doc).pop("nvidia", None)
        cri = schema.lookup(doc, schema.cri_path(schema.config_version(doc)))
        for key in ("enable_cdi", "cdi_spec_dirs"):
            if key in wanted or (key == "cdi_spec_dirs" and "enable_cdi" in wanted):
                cri.pop(key, None)
        if wanted.get("set_as_default"):
            cri["containerd"].pop("default_runtime_name", None)
    assert after == before


def test_cdi_and_default_runtime_reach_containerd(binaries: dict[str, Path],
                                                   tmp_path: Path) -> None:
    result = (VECTORS / "flatcar-default-cdi" / "expected.toml").read_text()  # no dump used
    for version in ("1.7", "2"):
        after = dump(binaries[version], result, tmp_path, f"cdi-{version}.toml")
        cri = schema.lookup(after, schema.cri_path(schema.config_version(after)))
        assert cri["enable_cdi"] is True
        assert cri["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
        assert cri["containerd"]["default_runtime_name"] == "nvidia"


def dropin_files(binary: Path, tmp_path: Path, vector: str) -> tuple[Path, dict[str, Any]]:
    """Drop-in mode as gpunode writes it: main file + imported file; returns the main file
    and containerd's dump of the untouched input."""
    main = tmp_path / "config.toml"
    imported = tmp_path / "conf.d" / "99-gpunode-nvidia.toml"
    imported.parent.mkdir()
    source = (VECTORS / vector / "input.toml").read_text()
    before = dump(binary, source, tmp_path, "before.toml")
    main_edit, imported_text = configure_dropin(source, spec_for(vector), str(main),
                                                str(imported), effective=before)
    main.write_text(main_edit.text)
    imported.write_text(imported_text)
    return main, before


def test_dropin_mode_on_containerd_2_1_merges_the_runtime_and_keeps_everything_else(
    binaries: dict[str, Path], tmp_path: Path
) -> None:
    main, before = dropin_files(binaries["2"], tmp_path, "flatcar-default")
    after = tomllib.loads(dump_config(binaries["2"], main))
    after["imports"] = [i for i in after["imports"] if i.startswith("/etc/")]  # drop own files
    runtimes = runtimes_of(after)
    nvidia = runtimes.pop("nvidia")
    assert nvidia["options"].pop("BinaryName") == "/usr/bin/nvidia-container-runtime"
    runc = copy.deepcopy(runtimes["runc"])
    runc["options"].pop("BinaryName")
    assert nvidia == runc
    assert after == {**before, "imports": []}


@pytest.mark.parametrize("containerd", ["1.6", "1.7"])
def test_why_dropin_mode_is_refused_before_2_1(
    binaries: dict[str, Path], tmp_path: Path, containerd: str
) -> None:
    """The same two files on 1.x: the imported CRI table replaces the main one, so runc (and
    its SystemdCgroup) is gone from the effective config."""
    main, before = dropin_files(binaries[containerd], tmp_path, "flatcar-default")
    after = tomllib.loads(dump_config(binaries[containerd], main))
    assert runtimes_of(before)["runc"]["options"]["SystemdCgroup"] is True
    assert "runc" not in runtimes_of(after)
