"""Real containerd (1.6, 1.7, 2.x) judges every edit gpunode makes: the golden vectors, the
configs with no runtime table at all, and the inputs of the NVIDIA container toolkit's own
tests (tests/data/containerd/toolkit). For every version whose `config dump` accepts an input,
the dump of gpunode's output shows the nvidia runtime running the configured binary (through the
option its shim reads), the default runtime still there and still the default, and everything
else exactly as in the dump of the input.

Each input is edited twice, as gpunode does: on a live host (containerd's own dump and version
passed in) and under --root (neither known); and for a version whose defaults gpunode knows,
without the dump, which must make the same text."""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from conftest import TEST_DATA
from gpunode.containerd import schema
from gpunode.containerd.edit import EditError, RuntimeSpec, configure, configure_dropin
from helpers.containerd_vectors import VECTORS, spec_for
from real.containerd_bins import ContainerdError, dump_config, ensure_containerd

DATA = TEST_DATA / "containerd"
TOOLKIT = DATA / "toolkit"
VERSIONS = ("1.6", "1.7", "2")
DAEMON = {"1.6": (1, 6), "1.7": (1, 7), "2": (2, 1)}


def inputs() -> list[tuple[str, str]]:
    return ([(f"vector/{p.name}", str(p / "input.toml")) for p in sorted(VECTORS.iterdir())]
            + [(f"toolkit/{p.stem}", str(p)) for p in sorted(TOOLKIT.glob("*.toml"))])


def cases() -> list[tuple[str, str, str]]:
    return [(name, path, version) for name, path in inputs() for version in VERSIONS]


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


def cri_of(doc: dict[str, Any]) -> dict[str, Any]:
    return schema.lookup(doc, schema.cri_path(schema.config_version(doc))) or {}


def runtimes_of(doc: dict[str, Any]) -> dict[str, Any]:
    return schema.lookup(doc, schema.runtimes_path(schema.config_version(doc))) or {}


def default_of(dumped: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The default runtime as containerd's CRI plugin resolves it: 1.x turns a typed
    (deprecated) `default_runtime` table into the default runtime named "default"."""
    containerd = cri_of(dumped).get("containerd", {})
    legacy = containerd.get("default_runtime")
    if dumped["version"] == 2 and isinstance(legacy, dict) and legacy.get("runtime_type"):
        return "default", legacy
    name = containerd.get("default_runtime_name", "runc")
    return name, runtimes_of(dumped).get(name)


def spec_of(name: str) -> RuntimeSpec:
    if name.startswith("vector/"):
        return spec_for(name.removeprefix("vector/"))
    return RuntimeSpec()


def file_runtimes(text: str) -> set[str]:
    doc = tomllib.loads(text.removeprefix(schema.BOM))
    return set(schema.runtimes(doc))


def judge(binary: Path, version: str, name: str, source: str, tmp_path: Path,
          live: bool, dumped: dict[str, Any]) -> dict[str, Any] | None:
    """Edit `source` as gpunode would and check containerd's dump of the result against
    `dumped`, the dump of the source; returns the dump of the output (None when gpunode
    refused, which the caller checks)."""
    spec = spec_of(name)
    before = copy.deepcopy(dumped)
    try:
        result = configure(source, spec, name, effective=before if live else None,
                           daemon=DAEMON[version] if live else None)
    except EditError:
        return None
    after = dump(binary, result.text, tmp_path, "after.toml")

    nvidia = runtimes_of(after)[spec.name]
    key = schema.binary_key(nvidia)
    assert key is not None, f"nvidia runs shim {nvidia['runtime_type']!r}, which runs no binary"
    assert nvidia["options"][key] == spec.binary
    if DAEMON[version] >= (2, 0):
        assert nvidia["runtime_type"] != schema.LEGACY_LINUX  # 2.x has no legacy shim

    was_name, was = default_of(before)
    now_name, now = default_of(after)
    if spec.set_as_default:
        assert now_name == spec.name
    elif was is not None:  # the default runtime is still there, still the default
        assert (now_name, now is not None) == (was_name, True)

    # Everything else is unchanged: the dumps minus the runtimes gpunode added to the file and
    # the CRI keys the spec asks for.
    added = file_runtimes(result.text) - file_runtimes(source)
    wanted = json.loads((VECTORS / name.removeprefix("vector/") / "spec.json").read_text()) \
        if (VECTORS / name.removeprefix("vector/") / "spec.json").exists() else {}
    for doc in (before, after):
        for runtime in added | {spec.name}:
            runtimes_of(doc).pop(runtime, None)
        cri = cri_of(doc)
        for key in ("enable_cdi", "cdi_spec_dirs"):
            if key in wanted or (key == "cdi_spec_dirs" and "enable_cdi" in wanted):
                cri.pop(key, None)
        if wanted.get("set_as_default"):
            cri["containerd"].pop("default_runtime_name", None)
    assert after == before
    return after


@pytest.mark.parametrize(("name", "path", "version"), cases(),
                         ids=[f"{n}-containerd{v}" for n, _, v in cases()])
def test_containerd_sees_the_runtime_and_nothing_else_changes(
    binaries: dict[str, Path], tmp_path: Path, name: str, path: str, version: str
) -> None:
    binary = binaries[version]
    source = Path(path).read_text()
    try:
        dumped = dump(binary, source, tmp_path, "before.toml")
    except ContainerdError:
        return  # this containerd does not accept the input at all (e.g. version 3 on 1.x)
    file_version = schema.config_version(tomllib.loads(source))
    v1_on_2 = file_version == 1 and DAEMON[version] >= (2, 0) and bool(tomllib.loads(source))
    v3_on_1 = file_version == 3 and DAEMON[version] < (2, 0)
    # Live host: containerd's own dump and version are known.
    judged = judge(binary, version, name, source, tmp_path, True, dumped)
    if v1_on_2 or v3_on_1:
        # refused: 2.x ignores a version 1 file's CRI settings; 1.6 reads a version 3 file
        # without complaint but ignores every setting in it
        assert judged is None
        return
    else:
        assert judged is not None, "gpunode refused an input containerd reads"
    # Under --root: neither is known; a version 1 file is taken for 1.x (2.x ignores it
    # whatever gpunode writes), every other output must be right for every version.
    assert judge(binary, version, name, source, tmp_path, False, dumped) is not None


@pytest.mark.parametrize(("name", "path", "version"), cases(),
                         ids=[f"{n}-containerd{v}" for n, _, v in cases()])
def test_a_known_version_s_edit_without_its_dump_is_the_edit_with_it(
    binaries: dict[str, Path], tmp_path: Path, name: str, path: str, version: str
) -> None:
    """For a version in schema.KNOWN_DEFAULTS boot asks no `config dump`: the edit made from
    gpunode's own reading of the version (schema.reading) is, byte for byte, the one made from
    the real dump (or refused alike)."""
    daemon = DAEMON[version]
    assert daemon in schema.KNOWN_DEFAULTS
    source = Path(path).read_text()
    try:
        dumped = dump(binaries[version], source, tmp_path, "before.toml")
    except ContainerdError:
        return  # this containerd does not accept the input at all
    spec = spec_of(name)
    made = []
    for effective in (dumped, None):
        try:
            made.append(configure(source, spec, name, effective, daemon).text)
        except EditError as exc:
            made.append(f"refused: {exc}")
    assert made[1] == made[0]
    if daemon >= schema.MERGES_FROM and not made[0].startswith("refused"):
        with_dump = configure_dropin(source, spec, name, "/etc/containerd/conf.d/x.toml",
                                     dumped, daemon=daemon)
        without = configure_dropin(source, spec, name, "/etc/containerd/conf.d/x.toml",
                                   daemon=daemon)
        assert (without[0].text, without[1]) == (with_dump[0].text, with_dump[1])


def test_cdi_and_default_runtime_reach_containerd(binaries: dict[str, Path],
                                                   tmp_path: Path) -> None:
    result = (VECTORS / "flatcar-default-cdi" / "expected.toml").read_text()  # no dump used
    for version in ("1.7", "2"):
        after = dump(binaries[version], result, tmp_path, f"cdi-{version}.toml")
        cri = cri_of(after)
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
