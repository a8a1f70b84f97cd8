"""Real containerd 1.6 / 1.7 / 2.x read configs: what `config dump` makes of files we write.

These pin down, against the real binaries, the facts gpunode's containerd handling relies on:
which CRI table names each version's config uses, and how an `imports` drop-in that adds the
nvidia runtime combines with the main file (containerd#5837). The binaries come from the Debian
archive (tests/real/containerd_bins.py); CI fetches them beforehand with
tests/real/fetch_containerd.py. A failed fetch fails these tests: they must not quietly skip.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import TEST_DATA
from real.containerd_bins import (
    VERSIONS,
    ContainerdError,
    default_config,
    dump_config,
    ensure_binary,
)

DEFAULTS = TEST_DATA / "containerd" / "defaults"

CRI_V2 = "io.containerd.grpc.v1.cri"  # config version 2 (containerd 1.x; 2.x migrates it)
CRI_V3_RUNTIME = "io.containerd.cri.v1.runtime"  # config version 3 (containerd 2.x)
CRI_V3_IMAGES = "io.containerd.cri.v1.images"
NVIDIA_BINARY = "/usr/bin/nvidia-container-runtime"


@dataclass(frozen=True)
class Containerd:
    version: str  # "1.6", "1.7" or "2"
    path: Path
    version_line: str

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


@pytest.fixture(scope="module", params=VERSIONS, ids=[f"containerd-{v}" for v in VERSIONS])
def containerd(request: pytest.FixtureRequest) -> Containerd:
    try:
        binary = ensure_binary(request.param)
    except Exception as err:  # network down, mirror gone, no apt: a failure, never a skip
        problem = f"could not get a real containerd {request.param}:\n{err}"
    else:
        return Containerd(request.param, binary.path, binary.version_line)
    pytest.fail(problem, pytrace=False)  # outside `except`: the message once, no traceback


def dump(containerd: Containerd, tmp_path: Path, main: str, **imports: str) -> dict[str, Any]:
    """Write main.toml (+ NAME.toml per import) under tmp_path, and parse its `config dump`."""
    for name, text in imports.items():
        (tmp_path / f"{name}.toml").write_text(text)
    config = tmp_path / "main.toml"
    config.write_text(main)
    return tomllib.loads(dump_config(containerd.path, config))


def runtimes(dumped: dict[str, Any]) -> dict[str, Any]:
    """The CRI runtimes table of a dump, wherever that version keeps it."""
    cri = dumped["plugins"][CRI_V3_RUNTIME if dumped["version"] == 3 else CRI_V2]
    return cri["containerd"]["runtimes"]


def test_own_default_config_round_trips(containerd: Containerd, tmp_path: Path) -> None:
    text = default_config(containerd.path)
    # Point root/state into tmp_path (dump creates nothing, but a config test should not name
    # the machine's real containerd directories).
    text = text.replace("/var/lib/containerd", str(tmp_path / "root"))
    text = text.replace("/run/containerd", str(tmp_path / "state"))
    config = tmp_path / "config.toml"
    config.write_text(text)

    dumped = dump_config(containerd.path, config)

    if containerd.major == 1:
        assert "version = 2" in dumped.splitlines()
        assert f'[plugins."{CRI_V2}".containerd.runtimes.runc]' in dumped
    else:
        assert "version = 3" in dumped.splitlines()
        assert f"[plugins.'{CRI_V3_RUNTIME}'.containerd.runtimes.runc]" in dumped
        assert f"[plugins.'{CRI_V3_RUNTIME}']" in dumped
    assert runtimes(tomllib.loads(dumped))["runc"]["runtime_type"] == "io.containerd.runc.v2"
    assert str(tmp_path / "root") in dumped


def test_golden_default_is_this_binarys_output(containerd: Containerd) -> None:
    """The committed defaults are real `config default` output of the recorded versions."""
    recorded = dict(
        line.split("\t", 1) for line in (DEFAULTS / "VERSIONS").read_text().splitlines()
    )
    golden = (DEFAULTS / f"containerd-{containerd.version}.toml").read_text()
    if recorded[containerd.version] != containerd.version_line:
        # Another build (Debian moved on): its defaults may legitimately differ; only check
        # that the golden file is still a config of the same config version.
        assert tomllib.loads(golden)["version"] == (2 if containerd.major == 1 else 3)
        return
    assert default_config(containerd.path) == golden


MAIN_V2 = f"""\
version = 2
imports = ["{{tmp}}/nvidia.toml"]

[plugins."{CRI_V2}"]
  sandbox_image = "example.org/pause:9"
  [plugins."{CRI_V2}".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."{CRI_V2}".containerd.runtimes.runc.options]
      SystemdCgroup = true
"""

NVIDIA_V2 = f"""\
version = 2

[plugins."{CRI_V2}".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  [plugins."{CRI_V2}".containerd.runtimes.nvidia.options]
    BinaryName = "{NVIDIA_BINARY}"
"""


def test_imported_cri_table_replaces_on_1x_merges_on_2x(
    containerd: Containerd, tmp_path: Path
) -> None:
    """containerd#5837: a drop-in adding only the nvidia runtime, pulled in through `imports`.

    1.6/1.7 merge imports per plugin: the imported `io.containerd.grpc.v1.cri` table replaces
    the main file's whole CRI table, so the main file's sandbox image and runc SystemdCgroup are
    gone, and so is the runc runtime itself (a set runtimes map replaces the built-in one), while
    default_runtime_name still says "runc". 2.x merges the tables: everything survives.
    """
    dumped = dump(containerd, tmp_path, MAIN_V2.replace("{tmp}", str(tmp_path)), nvidia=NVIDIA_V2)
    table = runtimes(dumped)
    assert table["nvidia"]["options"]["BinaryName"] == NVIDIA_BINARY

    if containerd.major == 1:
        cri = dumped["plugins"][CRI_V2]
        assert cri["sandbox_image"] != "example.org/pause:9"
        assert "runc" not in table
        assert cri["containerd"]["default_runtime_name"] == "runc"
    else:
        assert dumped["version"] == 3  # the v2 files were migrated
        assert table["runc"]["options"]["SystemdCgroup"] is True
        images = dumped["plugins"][CRI_V3_IMAGES]
        assert images["pinned_images"]["sandbox"] == "example.org/pause:9"


def test_runtimes_in_the_main_file_replace_the_builtin_runc_on_1x(
    containerd: Containerd, tmp_path: Path
) -> None:
    """Even without imports, 1.x drops the built-in runc once a file sets any runtime."""
    table = runtimes(dump(containerd, tmp_path, NVIDIA_V2))
    assert "nvidia" in table
    assert ("runc" in table) == (containerd.major >= 2)


@pytest.mark.parametrize("containerd", ["2"], indirect=True, ids=["containerd-2"])
def test_2x_mixing_config_versions_loses_settings(containerd: Containerd, tmp_path: Path) -> None:
    """On 2.x every file must carry the same `version`; mixing loses settings silently.

    A version 2 drop-in imported by a version 3 main file that also sets runtimes loses the
    drop-in's runtime (no warning at all); version-2 keys in a main file whose import is
    version 3 are not migrated and are dropped with only a warning on stderr.
    """
    main_v3 = f"""\
version = 3
imports = ["{tmp_path}/nvidia.toml"]
[plugins.'{CRI_V3_RUNTIME}'.containerd.runtimes.runc.options]
  SystemdCgroup = true
"""
    table = runtimes(dump(containerd, tmp_path, main_v3, nvidia=NVIDIA_V2))
    assert "nvidia" not in table
    assert table["runc"]["options"]["SystemdCgroup"] is True

    same_version = NVIDIA_V2.replace("version = 2", "version = 3").replace(
        f'"{CRI_V2}"', f"'{CRI_V3_RUNTIME}'"
    )
    table = runtimes(dump(containerd, tmp_path, main_v3, nvidia=same_version))
    assert table["nvidia"]["options"]["BinaryName"] == NVIDIA_BINARY
    assert table["runc"]["options"]["SystemdCgroup"] is True


def test_config_without_version_key(containerd: Containerd, tmp_path: Path) -> None:
    """A file with no `version` is a version 1 config: 1.x reads it (short plugin names, with a
    deprecation warning); 2.x renames the plugins but ignores the CRI settings in it (warnings
    only, exit 0), so the nvidia runtime of such a file never reaches 2.x."""
    v1 = """\
[plugins.cri]
  sandbox_image = "example.org/pause:9"
  [plugins.cri.containerd.runtimes.nvidia]
    runtime_type = "io.containerd.runc.v2"
"""
    dumped = dump(containerd, tmp_path, v1)
    if containerd.major == 1:
        assert dumped["plugins"][CRI_V2]["sandbox_image"] == "example.org/pause:9"
        assert "nvidia" in runtimes(dumped)
    else:
        assert "nvidia" not in runtimes(dumped)
        assert dumped["plugins"][CRI_V3_IMAGES]["pinned_images"]["sandbox"] != "example.org/pause:9"


# -- the daemon itself: its CRI plugin loads with gpunode's output, and runs the binary ------------

DATA = TEST_DATA / "containerd"
CTR = Path("/usr/bin/ctr")  # Debian's containerd package ships it; its API works with 1.6 to 2.1
DAEMON = {"1.6": (1, 6), "1.7": (1, 7), "2": (2, 1)}


@dataclass(frozen=True)
class Started:
    plugins: dict[str, str]  # "type id" → status ("ok", "error", "skip")
    log: str

    def cri(self) -> dict[str, Any]:
        """The CRI plugin's own, validated config as the daemon logs it when the plugin starts:
        default runtime name and name → (type, options) of every runtime."""
        line = next((ln for ln in self.log.splitlines()
                     if "Start cri plugin with config" in ln or "starting cri plugin" in ln), "")
        if "starting cri plugin" in line:  # 2.x: JSON
            import json
            import shlex

            fields = dict(part.split("=", 1) for part in shlex.split(line) if "=" in part)
            config = json.loads(fields["config"])["containerd"]
            return {"default": config["defaultRuntimeName"],
                    "runtimes": {name: (rt["runtimeType"], rt.get("options") or {})
                                 for name, rt in config["runtimes"].items()}}
        import re  # 1.x: Go's %+v of the struct

        default = re.search(r"DefaultRuntimeName:(\S*)", line)
        table = line.split("Runtimes:map[", 1)[-1]
        entry = re.compile(r"(?:^|\s)([\w.-]+):\{Type:(\S*) .*?Options:map\[([^\]]*)\]")
        runtimes = {m.group(1): (m.group(2), dict(kv.split(":", 1) for kv in m.group(3).split()))
                    for m in entry.finditer(table)}
        return {"default": default.group(1) if default else None, "runtimes": runtimes}


def start(binary: Path, config: Path, tmp_path: Path) -> Started:
    """`containerd --config CONFIG` with its own root, state and socket under tmp_path, in a
    private mount namespace whose /opt and /run are empty tmpfs (plugins create directories
    there), until the API answers; then `ctr plugins ls`, and the daemon is stopped."""
    import os
    import re
    import signal
    import subprocess
    import time

    if os.geteuid() != 0:
        pytest.skip("starting containerd needs root (mount namespace, its root directory)")
    # Without ctr (only the containerd binary is fetched for the non-system versions), the
    # daemon's own log says when it has booted and whether a CRI plugin failed to load.
    use_ctr = CTR.exists()
    tmp_path.mkdir(parents=True, exist_ok=True)
    address = tmp_path / "containerd.sock"
    log = (tmp_path / "daemon.log").open("w")
    script = 'mount -t tmpfs tmpfs /opt && mount -t tmpfs tmpfs /run && exec "$@"'
    daemon = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         str(binary), "--config", str(config), "--root", str(tmp_path / "root"),
         "--state", str(tmp_path / "state"), "--address", str(address)],
        stdout=log, stderr=subprocess.STDOUT)
    listing = ""
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and daemon.poll() is None:
            if address.exists() and use_ctr:
                result = subprocess.run([str(CTR), "--address", str(address), "plugins", "ls"],
                                        capture_output=True, text=True, timeout=10)
                if result.returncode == 0:
                    listing = result.stdout
                    break
            elif "containerd successfully booted" in (tmp_path / "daemon.log").read_text():
                log_text = (tmp_path / "daemon.log").read_text()
                failed = re.search(r'failed to load plugin "?io\.containerd\.(grpc\.v1|cri\.v1)'
                                   r'[.a-z]*"?', log_text)
                status = "error" if failed else "ok"
                listing = f"TYPE ID STATUS\nio.containerd.grpc.v1 cri {status}\n"
                break
            time.sleep(0.05)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
    text = (tmp_path / "daemon.log").read_text()
    assert listing, f"containerd did not answer on {address}:\n{text[-2000:]}"
    plugins = {" ".join(line.split()[:2]): line.split()[-1] for line in listing.splitlines()[1:]}
    return Started(plugins, text)


def cri_loads(started: Started) -> bool:
    return all(status == "ok" for name, status in started.plugins.items() if "cri" in name)


# The hardest outputs per version: no runtime table at all (live and --root edits), the legacy
# linux shim and deprecated default_runtime of version 1 files, a version 3 file; and the
# cluster chart's file (cluster-azure), on 1.7 as gpunode leaves it (CDI on).
DAEMON_INPUTS = {
    "1.6": ["vectors/no-runc-v2-sandbox-image/input.toml", "vectors/no-runc-empty/input.toml",
            "toolkit/container-config_v1.toml", "toolkit/installer-v1-legacy-options.toml",
            "toolkit/engine-runc-empty-type.toml"],
    "1.7": ["vectors/no-runc-v2-sandbox-image/input.toml", "vectors/no-runc-v1-sandbox-image/"
            "input.toml", "toolkit/container-config_v1.toml",
            "toolkit/installer-v1-legacy-custom-default.toml", "toolkit/installer-v2-complex.toml",
            "vectors/cluster-azure-containerd-1.7/expected.toml"],  # the chart's, CDI on
    "2": ["vectors/no-runc-v2-sandbox-image/input.toml", "vectors/no-runc-comment-only/input.toml",
          "toolkit/installer-v3-options.toml", "toolkit/engine-runc-empty-type.toml",
          "vectors/cluster-azure/input.toml"],  # the chart's version 2 file, v1.linux plugin
}


def test_the_cri_plugin_of_a_real_daemon_loads_with_the_edit_and_runs_the_binary(
    containerd: Containerd, tmp_path: Path
) -> None:
    """For each input: the daemon's CRI plugin loads with the input and with gpunode's output
    (live edit: with containerd's dump and version), keeps the default runtime, and its own
    validated config has the nvidia runtime on a shim running the configured binary."""
    from gpunode.containerd import schema
    from gpunode.containerd.edit import RuntimeSpec, configure

    for number, name in enumerate(DAEMON_INPUTS[containerd.version]):
        source = (DATA / name).read_text()
        work = tmp_path / str(number)
        work.mkdir()
        config = work / "config.toml"
        config.write_text(source)
        before = start(containerd.path, config, work / "before")
        assert cri_loads(before), f"{name}: the input itself does not load"
        effective = tomllib.loads(dump_config(containerd.path, config))
        edited = configure(source, RuntimeSpec(), name, effective=effective,
                           daemon=DAEMON[containerd.version]).text
        config.write_text(edited)
        after = start(containerd.path, config, work / "after")
        assert cri_loads(after), f"{name}: CRI fails with gpunode's output:\n{after.log[-3000:]}"
        was, now = before.cri(), after.cri()
        assert now["default"] == was["default"] and now["default"] in now["runtimes"], name
        shim, options = now["runtimes"]["nvidia"]
        key = schema.BINARY_KEY.get(shim)
        assert key is not None, f"{name}: nvidia runs on shim {shim!r}"
        assert options[key] == NVIDIA_BINARY, (name, options)


def test_the_edit_gpunode_used_to_make_fails_the_cri_plugin_on_1x(
    containerd: Containerd, tmp_path: Path
) -> None:
    """The control: only `runtimes.nvidia` added to a file without runtimes — 1.x drops runc
    while default_runtime_name stays "runc", and its CRI plugin refuses to start; 2.x merges."""
    config = tmp_path / "config.toml"
    config.write_text(NVIDIA_V2)
    started = start(containerd.path, config, tmp_path / "run")
    assert cri_loads(started) == (containerd.major >= 2)


# -- gpunode's model of the merge agrees with containerd's own dump --------------------------------

RUNC_V2 = (f'[plugins."{CRI_V2}".containerd.runtimes.runc]\nruntime_type = '
           '"io.containerd.runc.v2"\n')
NVIDIA_OLD = (f'[plugins."{CRI_V2}".containerd.runtimes.nvidia.options]\n'
              'BinaryName = "/opt/old/nvidia-container-runtime"\n')
# name → (main file, {relative import path: text}); "{tmp}" is the directory of the main file
MERGES = {
    "runtime-in-an-import": ('version = 2\nimports = ["conf.d/*.toml"]\n',
                             {"conf.d/nvidia.toml": NVIDIA_V2}),
    "import-touching-cri-drops-main-runtimes": (
        "version = 2\nimports = [\"{tmp}/conf.d/*.toml\"]\n" + RUNC_V2
        + NVIDIA_V2.split("\n", 1)[1],
        {"conf.d/images.toml": f'version = 2\n[plugins."{CRI_V2}"]\nsandbox_image = "x"\n'}),
    "wrong-binary-in-an-import": ("version = 2\nimports = [\"conf.d/*.toml\"]\n" + RUNC_V2
                                  + NVIDIA_V2.split("\n", 1)[1],
                                  {"conf.d/old.toml": "version = 2\n" + RUNC_V2 + NVIDIA_OLD}),
    "relative-literal-import": ('version = 2\nimports = ["sub/runc.toml"]\n',
                                {"sub/runc.toml": "version = 2\n" + RUNC_V2}),
    "imports-of-imports": ('version = 2\nimports = ["a.toml"]\n' + RUNC_V2,
                           {"a.toml": 'version = 2\nimports = ["b/*.toml"]\n',
                            "b/nvidia.toml": "version = 2\n" + RUNC_V2 + NVIDIA_OLD}),
    "star-does-not-cross-a-slash": ('version = 2\nimports = ["*.toml"]\n' + RUNC_V2,
                                    {"conf.d/nvidia.toml": NVIDIA_V2}),
    "version-1-file": ("[plugins.cri.containerd.runtimes.nvidia]\n"
                       'runtime_type = "io.containerd.runc.v2"\n'
                       "[plugins.cri.containerd.runtimes.nvidia.options]\n"
                       f'BinaryName = "{NVIDIA_BINARY}"\n', {}),
}


# On the live root: containerd 1.6 (and gpunode's model of it) globs relative imports against
# the daemon's working directory, the machine's /.
@pytest.mark.allow_paths("/")
@pytest.mark.parametrize("name", sorted(MERGES))
def test_gpunodes_model_of_imports_is_what_containerd_dumps(
    containerd: Containerd, tmp_path: Path, name: str
) -> None:
    """status and configure judge a file with imports by gpunode's model of containerd's merge
    (under --root nothing can be run): for each scenario the model's runtimes, their binaries
    and the default runtime equal what this containerd's `config dump` shows."""
    from gpunode.containerd import discover, schema
    from gpunode.platform.host import Host

    main, imports = MERGES[name]
    for relative, text in imports.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    config = tmp_path / "main.toml"
    config.write_text(main.replace("{tmp}", str(tmp_path)))
    daemon = {"1.6": (1, 6), "1.7": (1, 7), "2": (2, 1)}[containerd.version]
    view = schema.effective(discover.load_layers(Host(), str(config), daemon=daemon), daemon)
    # From "/", the working directory systemd gives containerd (1.6 resolves relative globs
    # against it, relative literal paths against the importing file's directory).
    import subprocess

    dumped = tomllib.loads(subprocess.run(
        [str(containerd.path), "--config", str(config), "config", "dump"], cwd="/",
        capture_output=True, text=True, check=True, timeout=60).stdout)
    real = runtimes(dumped)
    if view.problem is not None:  # the model says this version ignores the settings
        assert "nvidia" not in real
        return
    assert {n: schema.runtime_binary(rt) for n, rt in view.runtimes.items()} == {
        n: schema.runtime_binary(rt) for n, rt in real.items()}
    cri = dumped["plugins"][CRI_V3_RUNTIME if dumped["version"] == 3 else CRI_V2]
    assert view.default_name == cri["containerd"]["default_runtime_name"]


def test_a_byte_order_mark_is_skipped_by_1x_and_refused_by_2x(
    containerd: Containerd, tmp_path: Path
) -> None:
    """Why gpunode keeps a BOM it finds, and refuses the file when containerd is 2.x."""
    config = tmp_path / "bom.toml"
    config.write_text("\ufeff" + NVIDIA_V2)
    if containerd.major == 1:
        assert "nvidia" in runtimes(tomllib.loads(dump_config(containerd.path, config)))
    else:
        with pytest.raises(ContainerdError, match="invalid character at start of key"):
            dump_config(containerd.path, config)


# -- status on a live host asks containerd itself -------------------------------------------------

LIVE_STATUS = {
    # main file's runtime, dropped on 1.x by an import that touches the CRI table
    "import-touching-cri": (
        "version = 2\nimports = [\"{tmp}/conf.d/*.toml\"]\n" + RUNC_V2
        + NVIDIA_V2.split("\n", 1)[1],
        {"conf.d/images.toml": f'version = 2\n[plugins."{CRI_V2}"]\nsandbox_image = "x"\n'},
        {"1.6": None, "1.7": None, "2": NVIDIA_BINARY}),
    "wrong-binary-in-an-import": (
        "version = 2\nimports = [\"{tmp}/conf.d/*.toml\"]\n" + RUNC_V2
        + NVIDIA_V2.split("\n", 1)[1],
        {"conf.d/old.toml": "version = 2\n" + RUNC_V2 + NVIDIA_OLD},
        {v: "/opt/old/nvidia-container-runtime" for v in VERSIONS}),
    "version-1-file": (MERGES["version-1-file"][0], {},
                       {"1.6": NVIDIA_BINARY, "1.7": NVIDIA_BINARY, "2": None}),
}


@pytest.mark.parametrize("name", sorted(LIVE_STATUS))
def test_live_status_reports_the_runtime_containerd_itself_dumps(
    containerd: Containerd, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a live host status judges by containerd's own `config dump` (here the test's real
    binary stands in for the node's), not by reading the files."""
    import functools

    from gpunode.config import AgentConfig, ContainerdConfig
    from gpunode.containerd import probe
    from gpunode.platform.host import Host
    from gpunode.status import containerd as status_containerd

    main, imports, expected = LIVE_STATUS[name]
    for relative, text in imports.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    config = tmp_path / "main.toml"
    config.write_text(main.replace("{tmp}", str(tmp_path)))
    monkeypatch.setattr(probe, "CommandProbe",
                        functools.partial(probe.CommandProbe, str(containerd.path)))
    facts = status_containerd.config_facts(Host(), AgentConfig(containerd=ContainerdConfig(
        config_path=str(config))))
    assert facts.judge.endswith("own config dump"), facts
    assert facts.binary_name == expected[containerd.version], facts
    if name == "version-1-file" and containerd.major == 2:
        assert facts.problem and "ignores its CRI settings" in facts.problem


# -- disabled_plugins: which entries leave containerd without CRI --------------------------------

DISABLED_CASES = {
    "v1-cri": 'disabled_plugins = ["cri"]\n',
    "v1-uri": 'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n',
    "v2-grpc-cri": 'version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n',
    "v2-cri-runtime": 'version = 2\ndisabled_plugins = ["io.containerd.cri.v1.runtime"]\n',
    "v2-other-case": 'version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.CRI"]\n',
    "v2-other-plugin": 'version = 2\ndisabled_plugins = ["io.containerd.monitor.v1.cgroups"]\n',
}


@pytest.mark.parametrize("name", sorted(DISABLED_CASES))
def test_gpunode_knows_which_disabled_plugins_entries_leave_containerd_without_cri(
    name: str, containerd: Containerd, tmp_path: Path
) -> None:
    """1.x's dump leaves out a plugin it disables: gpunode's view has a problem exactly then.
    2.x's dump keeps every plugin's settings but shows the list as it migrated it: gpunode's
    2.1 view has a problem exactly when that list names one of the CRI plugins."""
    from gpunode.containerd import schema

    text = DISABLED_CASES[name]
    dumped = dump(containerd, tmp_path, text)
    doc = tomllib.loads(text)
    if containerd.major == 1:
        daemon = (1, 6) if containerd.version == "1.6" else (1, 7)
        has_cri = any(key in dumped.get("plugins", {}) for key in ("cri", CRI_V2))
    else:
        daemon = (2, 1)
        cri = {CRI_V2, CRI_V3_RUNTIME, CRI_V3_IMAGES}
        has_cri = not cri & set(dumped["disabled_plugins"])
    problem = schema.effective([schema.Layer("f", doc)], daemon).problem
    assert (problem is None) == has_cri, (problem, dumped.get("disabled_plugins"))


def test_a_short_plugin_name_in_a_version_2_file_is_refused_by_containerd(
    containerd: Containerd, tmp_path: Path
) -> None:
    from gpunode.containerd import schema

    with pytest.raises(ContainerdError, match="invalid disabled plugin URI"):
        dump(containerd, tmp_path, 'version = 2\ndisabled_plugins = ["cri"]\n')
    doc = {"version": 2, "disabled_plugins": ["cri"]}
    for daemon in schema.KNOWN_BEHAVIOURS:
        assert "refuses to start" in (schema.effective([schema.Layer("f", doc)], daemon).problem
                                      or "")
