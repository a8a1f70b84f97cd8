"""The containerd config edit, on golden vectors: exact output, idempotent, reversible, and
nothing outside the touched tables changes."""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path

import pytest

from gpunode.containerd import schema, tomltext
from gpunode.containerd.edit import Change, EditError, RuntimeSpec, configure
from gpunode.containerd.undo import revert
from helpers.containerd_vectors import VECTORS, spec_for

NAMES = sorted(p.name for p in VECTORS.iterdir())


def text(name: str, which: str) -> str:
    return (VECTORS / name / f"{which}.toml").read_text()


@pytest.mark.parametrize("name", NAMES)
def test_output_equals_the_golden_file(name: str) -> None:
    assert configure(text(name, "input"), spec_for(name), name).text == text(name, "expected")


@pytest.mark.parametrize("name", NAMES)
def test_second_run_changes_nothing(name: str) -> None:
    result = configure(text(name, "expected"), spec_for(name), name)
    assert not result.changed
    assert result.text == text(name, "expected")


@pytest.mark.parametrize("name", NAMES)
def test_no_line_of_the_input_is_removed_except_a_reconciled_value(name: str) -> None:
    """Comments, blank lines, order and quoting outside the touched tables stay as they were."""
    diff = difflib.ndiff(text(name, "input").splitlines(), text(name, "expected").splitlines())
    removed = [line[2:] for line in diff if line.startswith("- ")]
    assert all("BinaryName" in line for line in removed), removed


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("no-runc-")])
def test_added_runtime_equals_its_source_except_binary_name(name: str) -> None:
    before = tomllib.loads(text(name, "input"))
    after = tomllib.loads(text(name, "expected"))
    spec = spec_for(name)
    runtimes = schema.runtimes(after)
    nvidia = runtimes[spec.name]
    assert schema.runtime_binary(nvidia) == spec.binary
    if spec.name not in schema.runtimes(before):
        source_name = configure(text(name, "input"), spec, name).source_runtime
        cri = schema.lookup(before, schema.cri_path(schema.config_version(before)))
        source = dict(cri["containerd"]["default_runtime"] if source_name == "default"
                      else schema.runtimes(before)[source_name])
        key = schema.binary_key(source) or "BinaryName"
        assert nvidia["options"][key] == spec.binary
        options = {k: v for k, v in nvidia["options"].items() if k not in ("BinaryName", key)}
        source_options = {k: v for k, v in source.get("options", {}).items()
                          if k not in ("BinaryName", key)}
        # an empty runtime_type is written out as the runc v2 shim containerd runs for it
        source.setdefault("runtime_type", "io.containerd.runc.v2")
        source["runtime_type"] = source["runtime_type"] or "io.containerd.runc.v2"
        assert {**nvidia, "options": options} == {**source, "options": source_options}
    # everything but the runtime (and the CRI keys the spec asked for) is unchanged
    version = schema.config_version(before)
    for doc in (before, after):
        schema.lookup(doc, schema.runtimes_path(version)[:-1])["runtimes"].pop(spec.name, None)
        cri = schema.lookup(doc, schema.cri_path(version))
        for key in ("enable_cdi", "cdi_spec_dirs"):
            cri.pop(key, None)
        cri.get("containerd", {}).pop("default_runtime_name", None)
    assert after == before


@pytest.mark.parametrize("name", NAMES)
def test_revert_restores_the_parsed_input(name: str) -> None:
    result = configure(text(name, "input"), spec_for(name), name)
    undone = revert(result.text, result.added_runtime, result.changes, name)
    assert tomllib.loads(undone.text) == tomllib.loads(text(name, "input"))


def test_an_nvidia_runtime_running_another_binary_is_reconciled_not_duplicated() -> None:
    result = configure(text("nvidia-runtime-other-binary", "input"), RuntimeSpec(), "f")
    assert result.added_runtime is None
    assert result.describe() == [
        'set plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options.BinaryName'
        ' = "/usr/bin/nvidia-container-runtime" (was "/opt/nvidia/toolkit/nvidia-container-'
        'runtime")',
        'add plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options.SystemdCgroup'
        ' = true']
    nvidia = schema.runtimes(tomllib.loads(result.text))["nvidia"]
    assert nvidia["privileged_without_host_devices"] is False  # untouched


def test_default_runtime_is_the_source_when_it_is_not_runc() -> None:
    config = ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
              'default_runtime_name = "crun"\n'
              '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun]\n'
              'runtime_type = "io.containerd.runc.v2"\n'
              '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun.options]\n'
              'BinaryName = "/usr/bin/crun"\n'
              '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
              'runtime_type = "io.containerd.runc.v2"\n')
    result = configure(config, RuntimeSpec(), "f")
    assert result.source_runtime == "crun"


def test_no_runtimes_at_all_gets_containerds_built_in_runc_and_a_copy_of_it() -> None:
    """containerd 1.x drops its built-in runc once a file sets any runtime, so gpunode writes
    runc out as containerd 1.x has it built in (tests/data/containerd/defaults) and copies it."""
    result = configure("version = 2\n", RuntimeSpec(), "f")
    runtimes = schema.runtimes(tomllib.loads(result.text))
    defaults = tomllib.loads((VECTORS.parent / "defaults" / "containerd-1.6.toml").read_text())
    builtin = schema.runtimes(defaults)["runc"]
    assert runtimes["runc"] == {"runtime_type": builtin["runtime_type"],
                                "options": builtin["options"]}
    assert runtimes["nvidia"] == {**runtimes["runc"], "options": {
        **builtin["options"], "BinaryName": "/usr/bin/nvidia-container-runtime"}}


def test_revert_leaves_a_value_someone_changed_since() -> None:
    result = configure(text("nvidia-runtime-other-binary", "input"), RuntimeSpec(), "f")
    edited = result.text.replace('BinaryName = "/usr/bin/nvidia-container-runtime"',
                                 'BinaryName = "/srv/other-runtime"')
    undone = revert(edited, result.added_runtime, result.changes, "f")
    nvidia = schema.runtimes(tomllib.loads(undone.text))["nvidia"]
    assert nvidia["options"] == {"BinaryName": "/srv/other-runtime"}


BAD = {
    "garbage-bytes": ("\x00\x01\x02 not toml", "not valid TOML"),
    "empty-key": ("= 1\n", "not valid TOML"),
    "duplicate-key": ('version = 2\nversion = 2\n', ":2: not valid TOML"),
    "table-where-value-expected": (
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\nruntimes = 5\n',
        "'plugins.io.containerd.grpc.v1.cri.containerd.runtimes' is not a table"),
    "version-4": ("version = 4\n",
                  "'version' is 4; gpunode understands 1 (or no version), 2 and 3"),
    "version-string": ('version = "2"\n', "'version' is '2'"),
    "runtime-options-not-a-table": (
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        'options = "x"\n', "runtimes.nvidia.options' is not a table"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_refused_with_file_and_reason(name: str) -> None:
    source, message = BAD[name]
    with pytest.raises(EditError) as info:
        configure(source, RuntimeSpec(), "/etc/containerd/config.toml")
    assert str(info.value).startswith("/etc/containerd/config.toml")
    assert message in str(info.value)


@pytest.mark.parametrize("source", ["", "\n\n", "# only a comment\n"])
def test_empty_file_becomes_version_2_which_every_containerd_reads(source: str) -> None:
    """As version 1 (no version key), containerd 2.x would ignore the runtime."""
    result = configure(source, RuntimeSpec(), "f")
    assert source.strip() in result.text  # a comment stays
    doc = tomllib.loads(result.text)
    assert doc["version"] == 2
    assert set(schema.runtimes(doc)) == {"nvidia", "runc"}


def test_change_descriptions_quote_dotted_plugin_names() -> None:
    change = Change(("plugins", "io.containerd.grpc.v1.cri", "enable_cdi"), None, True)
    assert change.describe() == 'add plugins."io.containerd.grpc.v1.cri".enable_cdi = true'


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("no-runc-")])
def test_a_file_without_runtimes_gets_runc_written_out_and_nothing_else(name: str) -> None:
    """containerd 1.x drops its built-in runc once a file sets any runtime: gpunode writes the
    built-in runc, then the nvidia copy of it; the rest of the file is as it was."""
    before = tomllib.loads(text(name, "input"))
    after = tomllib.loads(text(name, "expected"))
    version = schema.config_version(after)
    runtimes = schema.runtimes(after)
    assert set(runtimes) == ({"nvidia"} if version == 3 else {"nvidia", "runc"})
    if version < 3:
        assert runtimes["runc"]["runtime_type"] == "io.containerd.runc.v2"
        assert runtimes["nvidia"] == {**runtimes["runc"], "options": {
            **runtimes["runc"]["options"], "BinaryName": "/usr/bin/nvidia-container-runtime"}}
    table = schema.lookup(after, schema.runtimes_path(version))
    for added in ("nvidia", "runc"):
        table.pop(added, None)
    if "version" not in before and not before:
        del after["version"]  # an empty file becomes version 2
    assert _without_empty_tables(after) == _without_empty_tables(before)


def _without_empty_tables(doc: dict[str, object]) -> dict[str, object]:
    pruned = {k: _without_empty_tables(v) if isinstance(v, dict) else v for k, v in doc.items()}
    return {k: v for k, v in pruned.items() if v != {}}


V2_RUNC = ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
           'runtime_type = "io.containerd.runc.v2"\n')


def test_a_byte_order_mark_is_kept_for_1x_and_refused_for_2x() -> None:
    """containerd 1.x skips a UTF-8 BOM; 2.x refuses the file ('invalid character at start of
    key'), checked in tests/integration/test_containerd_real.py."""
    result = configure("\ufeff" + V2_RUNC, RuntimeSpec(), "f", daemon=(1, 7))
    assert result.text.startswith("\ufeffversion = 2\n")
    with pytest.raises(EditError, match=r"byte order mark, which containerd 2\.1 refuses"):
        configure("\ufeff" + V2_RUNC, RuntimeSpec(), "f", daemon=(2, 1))


def test_a_version_1_file_is_refused_for_containerd_2() -> None:
    with pytest.raises(EditError, match=r"version 1 config .*containerd 2\.1 ignores its CRI"):
        configure(text("v1-no-version", "input"), RuntimeSpec(), "f", daemon=(2, 1))


def test_nan_in_the_config_does_not_fail_the_self_check() -> None:
    source = V2_RUNC + '[plugins."io.containerd.gc.v1.scheduler"]\npause_threshold = nan\n'
    result = configure(source, RuntimeSpec(), "f")
    assert result.added_runtime == "nvidia"
    assert not configure(result.text, RuntimeSpec(), "f").changed


def test_the_legacy_linux_shim_gets_the_binary_in_options_runtime() -> None:
    """io.containerd.runtime.v1.linux runs options.Runtime (runctypes.RuncOptions)."""
    source = ('version = 1\n[plugins.cri.containerd.runtimes.runc]\n'
              'runtime_type = "io.containerd.runtime.v1.linux"\n'
              '[plugins.cri.containerd.runtimes.runc.options]\nRuntime = "/usr/bin/runc"\n')
    nvidia = schema.runtimes(tomllib.loads(configure(source, RuntimeSpec(), "f").text))["nvidia"]
    assert nvidia == {"runtime_type": "io.containerd.runtime.v1.linux",
                      "options": {"Runtime": "/usr/bin/nvidia-container-runtime"}}


def test_a_kata_default_runtime_is_not_copied() -> None:
    """A shim that runs no OCI binary cannot run the NVIDIA runtime: runc is copied instead."""
    source = ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
              'default_runtime_name = "kata"\n'
              '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]\n'
              'runtime_type = "io.containerd.kata.v2"\n'
              + V2_RUNC.split("\n", 1)[1])
    assert configure(source, RuntimeSpec(), "f").source_runtime == "runc"


def test_the_built_in_runc_is_written_as_containerds_dump_shows_it() -> None:
    effective = tomllib.loads((VECTORS.parent / "defaults" / "containerd-1.7.toml").read_text())
    result = configure("version = 2\n", RuntimeSpec(), "f", effective=effective, daemon=(1, 7))
    runc = schema.runtimes(tomllib.loads(result.text))["runc"]
    dumped = schema.runtimes(effective)["runc"]
    assert runc["sandbox_mode"] == "podsandbox"
    assert runc["options"] == dumped["options"]


def test_a_2_1_daemon_needs_no_runc_written() -> None:
    """containerd 2.x merges a file's runtimes with its built-in ones."""
    result = configure("version = 2\n", RuntimeSpec(), "f", daemon=(2, 1))
    assert set(schema.runtimes(tomllib.loads(result.text))) == {"nvidia"}


@pytest.mark.parametrize(("imports", "added"), [
    ('["conf.d/*.toml"]', False), ('["/etc/containerd/conf.d/*.toml"]', False),
    ('["*.toml"]', True),  # '*' does not cross '/': /etc/containerd/*.toml misses conf.d/
    ('["/etc/*/conf.d/*.toml"]', False), ('["/etc/containerd/conf.d/?9-*.toml"]', False),
])
def test_dropin_mode_adds_an_import_unless_one_matches_as_go_globs_do(imports: str,
                                                                      added: bool) -> None:
    from gpunode.containerd.edit import configure_dropin

    main, _ = configure_dropin(f"version = 2\nimports = {imports}\n" + V2_RUNC.split("\n", 1)[1],
                               RuntimeSpec(), "/etc/containerd/config.toml",
                               "/etc/containerd/conf.d/99-gpunode-nvidia.toml")
    assert main.changed is added


def test_set_as_default_is_refused_where_a_legacy_default_runtime_wins() -> None:
    """containerd 1.x makes a typed `default_runtime` table the default runtime "default"
    whatever default_runtime_name says (its CRI plugin logs so), so the change would not hold."""
    source = (VECTORS.parent / "toolkit" / "container-config_v1.toml").read_text()
    with pytest.raises(EditError, match="deprecated default_runtime table") as info:
        configure(source, RuntimeSpec(set_as_default=True), "f")
    assert "default_runtime_name" in info.value.hint


TOOLKIT = sorted((VECTORS.parent / "toolkit").glob("*.toml"))


@pytest.mark.parametrize("path", TOOLKIT, ids=[p.stem for p in TOOLKIT])
def test_toolkit_inputs_keep_every_line_and_a_second_run_changes_nothing(path: Path) -> None:
    """The NVIDIA container toolkit's own test configs: every input line stays byte for byte
    (except a reconciled binary), and the output is already as configured."""
    source = path.read_text()
    result = configure(source, RuntimeSpec(), path.name)
    diff = difflib.ndiff(source.splitlines(), result.text.splitlines())
    removed = [line[2:] for line in diff if line.startswith("- ")]
    assert all("BinaryName" in line for line in removed), removed
    assert not configure(result.text, RuntimeSpec(), path.name).changed


def test_a_runtime_an_import_gives_every_containerd_is_not_added_again() -> None:
    imported = tomllib.loads(V2_RUNC + (
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        'BinaryName = "/usr/bin/nvidia-container-runtime"\n'))
    main = 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n' + V2_RUNC.split("\n", 1)[1]
    result = configure(main, RuntimeSpec(), "/etc/containerd/config.toml",
                       imports=[schema.Layer("/etc/containerd/conf.d/nvidia.toml", imported)])
    assert not result.changed and result.text == main


@pytest.mark.parametrize(("before", "appended"), [
    ("version = 2\n", "\n[a]\nb = 1\n"),
    ("", "version = 2\n"),
    ("x = 1\ny = 2\nz = 3\n", "x = 1\ny = 2\nz = 3\n"),  # the whole file again
    ("x = 1\n", "\n\n"),
    ("x = 1\r\n", "y = 2"),  # no newline at the end of what is appended
])
def test_an_append_gives_the_hunk_difflib_gives_and_is_undone(before: str,
                                                              appended: str) -> None:
    """tomltext.text_hunks' own answer for lines only appended (a first boot's runtime) is
    the one difflib's SequenceMatcher finds, and unapplying it gives the file back."""
    after = before + appended
    a, b = tomltext.split_lines(before), tomltext.split_lines(after)
    expected = [(tuple(b[max(0, j1 - 2):j1]), tuple(a[i1:i2]), tuple(b[j1:j2]))
                for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
                    None, a, b, autojunk=False).get_opcodes() if tag != "equal"]
    hunks = tomltext.text_hunks(before, after)
    assert hunks == expected and len(hunks) == 1
    assert tomltext.unapply(after, (tuple(hunks),)) == before


def test_a_last_line_without_newline_that_is_extended_is_diffed_as_before() -> None:
    hunks = tomltext.text_hunks("x = 1", "x = 1\ny = 2\n")
    assert hunks == [((), ("x = 1",), ("x = 1\n", "y = 2\n"))]
