"""Hostile containerd configs: each is refused with one clear message and every file as it was,
or (where containerd itself reads it fine) configured so that containerd sees the runtime.

The cases run `gpunode --root <fixture> containerd configure` in-process: under --root the
containerd version is unknown, so gpunode must be right for every version that reads the file
(containerd 1.x replaces an imported plugin table, 2.1+ merges it: containerd#5837)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.containerd import schema
from hostile.support import Cli, assert_unchanged, check_refusal, snapshot

CONFIG = "/etc/containerd/config.toml"
CRI = 'plugins."io.containerd.grpc.v1.cri"'
RUNC = (f'[{CRI}.containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n'
        f'[{CRI}.containerd.runtimes.runc.options]\nSystemdCgroup = true\n')
NVIDIA = (f'[{CRI}.containerd.runtimes.nvidia]\nruntime_type = "io.containerd.runc.v2"\n'
          f'[{CRI}.containerd.runtimes.nvidia.options]\n'
          'BinaryName = "/usr/bin/nvidia-container-runtime"\n')
IMPORTS = 'imports = ["/etc/containerd/conf.d/*.toml"]\n'

# name → (main config, {imported file: text}, error pattern)
REFUSED: dict[str, tuple[str, dict[str, str], str]] = {
    "import-replaces-the-cri-table-on-1x": (
        "version = 2\n" + IMPORTS + RUNC,
        {"/etc/containerd/conf.d/10-images.toml":
         f'version = 2\n[{CRI}]\nsandbox_image = "example.org/pause:9"\n'},
        r"containerd 1\.6 .*replace this file's whole CRI table.*containerd#5837"),
    "import-sets-a-wrong-binary-name": (
        "version = 2\n" + IMPORTS + RUNC + NVIDIA,
        {"/etc/containerd/conf.d/50-old.toml":
         f'version = 2\n{RUNC}[{CRI}.containerd.runtimes.nvidia.options]\n'
         'BinaryName = "/opt/old/nvidia-container-runtime"\n'},
        r"would not take effect.*runs /opt/old/nvidia-container-runtime"),
    "missing-literal-import": (
        'version = 2\nimports = ["/etc/containerd/gone.toml"]\n' + RUNC, {},
        r"imported file /etc/containerd/gone.toml does not exist: containerd 1\.6 refuses"),
    "imports-mixing-config-versions": (
        "version = 2\n" + IMPORTS + RUNC,
        {"/etc/containerd/conf.d/v3.toml":
         "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd]\n"
         "default_runtime_name = 'runc'\n"},
        r"containerd 1\.6 does not read config version 3"),
    "malformed-import-glob": (
        'version = 2\nimports = ["/etc/containerd/conf.d/[*.toml"]\n' + RUNC, {},
        r"imports: malformed pattern"),
    "imports-not-a-list": ('version = 2\nimports = "/etc/x.toml"\n' + RUNC, {},
                           r"'imports' is not a list"),
    "nvidia-runtime-on-a-kata-shim": (
        f'version = 2\n{RUNC}[{CRI}.containerd.runtimes.nvidia]\n'
        'runtime_type = "io.containerd.kata.v2"\n', {},
        r"runtime_type 'io.containerd.kata.v2', whose shim runs no OCI runtime binary"),
    "over-the-size-cap": ("version = 2\n" + RUNC + "# " + "x" * (1 << 20) + "\n", {},
                          r"larger than 1 MiB"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_configure_refuses(name: str, make_host: HostFactory, cli: Cli) -> None:
    main, imports, pattern = REFUSED[name]
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: main, **imports})
    check_refusal(cli, host.root, ["--root", str(host.root), "containerd", "configure",
                                   "--config", CONFIG, "--force"], 1, pattern)


USAGE = {
    "quote-in-runtime-name": (["--runtime-name", 'a"b'], r"--runtime-name 'a\"b': must be"),
    "empty-runtime-name": (["--runtime-name", ""], r"--runtime-name '': must be"),
    "runtime-name-with-a-dot-first": (["--runtime-name", ".x"], r"--runtime-name '.x': must"),
    "relative-runtime-path": (["--runtime-path", "bin/nvidia-container-runtime"],
                              r"--runtime-path 'bin/nvidia-container-runtime': must be an "
                              r"absolute path"),
    "newline-in-runtime-path": (["--runtime-path", "/usr/bin/nvidia\n--debug"],
                                r"--runtime-path .*must not contain control characters"),
}


@pytest.mark.parametrize("name", sorted(USAGE))
def test_bad_runtime_flags_are_usage_errors(name: str, make_host: HostFactory, cli: Cli) -> None:
    """Checked by the agent config's own rules: exit 2 with the flag and the rule, nothing
    written."""
    flags, pattern = USAGE[name]
    host = make_host("nc4as-t4-v3", "driver")
    check_refusal(cli, host.root, ["--root", str(host.root), "containerd", "configure",
                                   "--force", *flags], 2, pattern)


# Inputs containerd reads fine, which gpunode must now configure (name → config text).
NO_RUNC = {
    "v2-only-a-sandbox-image": f'version = 2\n[{CRI}]\nsandbox_image = "example.org/pause:9"\n',
    "empty-file": "",
    "comment-only": "# nothing here yet\n",
    "v1-no-version": '[plugins.cri]\nsandbox_image = "example.org/pause:9"\n',
    "v3-only-images": "version = 3\n[plugins.'io.containerd.cri.v1.images'.pinned_images]\n"
                      "sandbox = 'example.org/pause:9'\n",
}


@pytest.mark.parametrize("name", sorted(NO_RUNC))
def test_a_config_without_runtimes_keeps_runc(name: str, make_host: HostFactory,
                                              cli: Cli) -> None:
    """containerd 1.x drops its built-in runc once a file sets any runtime: gpunode writes it
    out (a version 3 file is read by 2.x only, which merges, so it needs none)."""
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: NO_RUNC[name]})
    result = cli("--root", str(host.root), "containerd", "configure", "--config", CONFIG,
                 "--force")
    assert result.code == 0, result.err
    written = (host.root / CONFIG.lstrip("/")).read_text()
    doc = tomllib.loads(written)
    runtimes = schema.runtimes(doc)
    assert schema.runtime_binary(runtimes["nvidia"]) == "/usr/bin/nvidia-container-runtime"
    if schema.config_version(doc) < 3:
        assert runtimes["runc"]["runtime_type"] == "io.containerd.runc.v2"
    assert written.startswith(NO_RUNC[name].split("\n")[0])


ODD = {
    "nan-and-inf-values": (f'version = 2\n[plugins."io.containerd.gc.v1.scheduler"]\n'
                           f'pause_threshold = nan\nmutation_threshold = inf\n{RUNC}'),
    "hash-and-quotes-in-keys": f'version = 2\n{RUNC}[{CRI}.registry.headers]\n"X-#" = ["a"]\n',
}


@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_but_valid_configs_are_configured(name: str, make_host: HostFactory,
                                              cli: Cli) -> None:
    """nan compares equal to itself in gpunode's self-check; a second run changes nothing (a
    byte order mark: tests/hostile/test_containerd_round2.py)."""
    host = make_host("nc4as-t4-v3", "driver", extra={CONFIG: ODD[name]})
    argv = ["--root", str(host.root), "containerd", "configure", "--config", CONFIG, "--force"]
    assert cli(*argv).code == 0
    written = (host.root / CONFIG.lstrip("/")).read_text()
    assert written.startswith(ODD[name][:12])
    runtimes = schema.runtimes(tomllib.loads(written.removeprefix("\ufeff")))
    assert runtimes["nvidia"]["options"]["SystemdCgroup"] is True
    before = snapshot(host.root)
    again = cli(*argv)
    assert again.code == 0 and "already as configured" in again.out
    assert_unchanged(host.root, before)


def test_a_runtime_defined_in_an_import_is_already_configured(make_host: HostFactory,
                                                              cli: Cli) -> None:
    """containerd reads it from the import (with runc, so 1.x keeps its default runtime):
    nothing to add, and status agrees."""
    host = make_host("nc4as-t4-v3", "driver", extra={
        CONFIG: "version = 2\n" + IMPORTS,
        "/etc/containerd/conf.d/nvidia.toml": "version = 2\n" + RUNC + NVIDIA})
    before = snapshot(host.root)
    (host.root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (host.root / "etc/gpunode/config.toml").write_text("[containerd]\nlimit_memlock = false\n")
    before = snapshot(host.root)
    result = cli("--root", str(host.root), "containerd", "configure", "--config", CONFIG,
                 "--force")
    assert result.code == 0 and "already as configured" in result.out, result.out
    assert_unchanged(host.root, before)


def status_check(host_root: Path, cli: Cli) -> dict[str, object]:
    import json

    result = cli("--root", str(host_root), "status", "--json")
    checks = json.loads(result.out)["checks"]
    return next(c for c in checks if c["name"] == "containerd_runtime")


STATUS = {
    # an import whose CRI table lacks runc: 1.x loses its default runtime, 2.1+ merges
    "import-without-runc-depends-on-the-version": (
        "version = 2\n" + IMPORTS + RUNC, {"/etc/containerd/conf.d/nvidia.toml":
                                            "version = 2\n" + NVIDIA},
        "warn", r"containerd 1\.6 and 1\.7: .*default runtime 'runc' is gone; containerd 2\.1\+: "
        r"runtime 'nvidia' runs"),
    # an import touching the CRI table drops the main file's runtime on 1.x
    "import-touching-cri-drops-the-main-runtime-on-1x": (
        "version = 2\n" + IMPORTS + RUNC + NVIDIA,
        {"/etc/containerd/conf.d/images.toml": f'version = 2\n[{CRI}]\nsandbox_image = "x"\n'},
        "warn", r"containerd 1\.6 and 1\.7: no runtime 'nvidia'"),
    "runtime-in-an-import": (
        'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n',
        {"/etc/containerd/conf.d/nvidia.toml": "version = 2\n" + RUNC + NVIDIA},
        "ok", r"runtime 'nvidia' → /usr/bin/nvidia-container-runtime in "
              r"/etc/containerd/conf.d/nvidia.toml"),
    # containerd 1.6 resolves a relative glob against its working directory, 1.7+ against
    # the importing file's directory; a relative literal path is the file's directory for all
    "runtime-in-a-relative-literal-import": (
        'version = 2\nimports = ["conf.d/nvidia.toml"]\n', {"/etc/containerd/conf.d/nvidia.toml":
                                                            "version = 2\n" + RUNC + NVIDIA},
        "ok", r"runtime 'nvidia' → /usr/bin/nvidia-container-runtime in "
              r"/etc/containerd/conf.d/nvidia.toml"),
    "runtime-in-a-relative-import": (
        'version = 2\nimports = ["conf.d/*.toml"]\n', {"/etc/containerd/conf.d/nvidia.toml":
                                                      "version = 2\n" + RUNC + NVIDIA},
        "warn", r"containerd 1\.6: no runtime 'nvidia'; containerd 1\.7 and 2\.1\+: runtime "
                r"'nvidia' runs /usr/bin/nvidia-container-runtime "
                r"\(/etc/containerd/conf.d/nvidia.toml\)"),
    "glob-star-does-not-cross-a-slash": (
        'version = 2\nimports = ["/etc/*.toml"]\n' + RUNC, {"/etc/containerd/conf.d/nvidia.toml":
                                                             "version = 2\n" + NVIDIA},
        "fail", r"no 'nvidia' runtime"),
    "version-1-file-under-root": (
        "[plugins.cri.containerd.runtimes.runc]\nruntime_type = 'io.containerd.runc.v2'\n"
        "[plugins.cri.containerd.runtimes.nvidia]\nruntime_type = 'io.containerd.runc.v2'\n"
        "[plugins.cri.containerd.runtimes.nvidia.options]\n"
        "BinaryName = '/usr/bin/nvidia-container-runtime'\n", {},
        "warn", r"containerd 2\.1\+: /etc/containerd/config.toml is a version 1 config \(no "
        r"'version' key\): containerd 2\.1 ignores its CRI settings"),
    "missing-default-runtime": (
        f'version = 2\n[{CRI}.containerd]\ndefault_runtime_name = "crun"\n{RUNC}{NVIDIA}', {},
        "fail", r"default runtime 'crun' is not among its runtimes"),
}


@pytest.mark.parametrize("name", sorted(STATUS))
def test_status_says_what_containerd_makes_of_imports(name: str, make_host: HostFactory,
                                                      cli: Cli) -> None:
    import re

    main, imports, state, pattern = STATUS[name]
    host = make_host("nc4as-t4-v3", "ready", extra={CONFIG: main, **imports})
    check = status_check(host.root, cli)
    assert check["state"] == state, check
    assert re.search(pattern, str(check["detail"])), check["detail"]


@pytest.mark.parametrize(("pattern", "path", "matches"), [
    ("conf.d/*.toml", "/etc/containerd/conf.d/99-gpunode-nvidia.toml", True),
    ("/etc/*.toml", "/etc/containerd/conf.d/99-gpunode-nvidia.toml", False),  # fnmatch: True
    ("/etc/containerd/*/*.toml", "/etc/containerd/conf.d/99-gpunode-nvidia.toml", True),
    ("/etc/containerd/conf.d/99-gpunode-nvidia.toml", "/etc/containerd/conf.d/"
     "99-gpunode-nvidia.toml", True),
    ("./conf.d/../conf.d/*.toml", "/etc/containerd/conf.d/99-gpunode-nvidia.toml", True),
    ("/etc/containerd/conf.d/9?-*.toml", "/etc/containerd/conf.d/99-gpunode-nvidia.toml", True),
    ("/etc/containerd/conf.d/[0-8]*.toml", "/etc/containerd/conf.d/99-gpunode-nvidia.toml",
     False),
    ("/etc/containerd/conf.d/?9-gpunode-nvidia.toml",  # no '*': containerd takes it literally
     "/etc/containerd/conf.d/99-gpunode-nvidia.toml", False),
])
def test_imports_match_as_containerd_globs(pattern: str, path: str, matches: bool) -> None:
    """Go's filepath.Match: '*' and '?' stop at '/'; only a pattern with '*' is a glob."""
    assert schema.import_matches(CONFIG, pattern, path) is matches


@pytest.mark.parametrize("name", ["runc", "crun-default"])
def test_the_default_runtime_is_never_pointed_at_the_nvidia_runtime(
    name: str, make_host: HostFactory, cli: Cli
) -> None:
    """--runtime-name naming containerd's default runtime (or runc) would send every pod of the
    node through the NVIDIA runtime: refused, nothing written."""
    config = (f'version = 2\n[{CRI}.containerd]\ndefault_runtime_name = "{name}"\n'
              f'[{CRI}.containerd.runtimes.{name}]\nruntime_type = "io.containerd.runc.v2"\n')
    host = make_host("nc4as-t4-v3", "driver", extra={"/etc/containerd/config.toml": config})
    check_refusal(cli, host.root, ["--root", str(host.root), "containerd", "configure", "--force",
                                   "--config", "/etc/containerd/config.toml", "--runtime-name",
                                   name], 1, f"runtime '{name}' is containerd's default runtime")


def test_an_unset_config_variable_in_execstart_is_named(make_host: HostFactory, cli: Cli) -> None:
    """Flatcar's unit reads --config ${CONTAINERD_CONFIG}; a drop-in that resets Environment=
    leaves it empty: the refusal names the unit file and the variable, not an empty path."""
    host = make_host("nc4as-t4-v3", "driver", extra={
        "/etc/systemd/system/containerd.service.d/20-reset.conf": "[Service]\nEnvironment=\n"})
    check_refusal(cli, host.root, ["--root", str(host.root), "containerd", "configure",
                                   "--force"], 1,
                  r"containerd\.service: ExecStart's --config '\$\{CONTAINERD_CONFIG\}' "
                  r"expands to '', not an absolute path")


@pytest.mark.parametrize("command", ["configure", "revert"])
@pytest.mark.parametrize("value", ["", "etc/containerd/config.toml"], ids=["empty", "relative"])
def test_containerd_config_flag_must_name_a_host_path(
    command: str, value: str, make_host: HostFactory, cli: Cli
) -> None:
    """An empty --config once meant the default file, silently; a relative one names nothing."""
    host = make_host("nc4as-t4-v3", "driver")
    force = ["--force"] if command == "configure" else []
    check_refusal(cli, host.root, ["--root", str(host.root), "containerd", command, *force,
                                   "--config", value], 2,
                  r"containerd --config '.*': must be an absolute path")
