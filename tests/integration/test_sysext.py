"""The system extension packaging/build_sysext.py builds, built once per session: what the image
holds, that the bundled gpunode runs with no virtualenv and no Python of the machine, and a
Flatcar-style boot in a real systemd that merges the image and starts gpunode.service from it."""

from __future__ import annotations

import ast
import configparser
import contextlib
import hashlib
import json
import os
import pkgutil
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpunode
from conftest import REPO
from gpunode.delivery import ignition
from gpunode_testing import fixtures
from gpunode_testing.systemd_ns import MACHINE_PATHS, SystemdNamespace
from helpers.ignition_example import SHA512, URL
from helpers.sysext import FLATCAR_ENSURE_SYSEXT, IMAGE_NAME, Built, load_build_script

# The systemd harness's own reads, and the machine's systemd-sysext.service (flatcar_boot).
pytestmark = [
    pytest.mark.allow_paths(*MACHINE_PATHS, "/lib/systemd/system/systemd-sysext.service"),
    # The sysext bundles one interpreter, Debian 12's packaged CPython 3.11, and is built and
    # tested with it: the 3.11 run of the suite (Makefile `test`); the others build no sysext.
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the sysext is built and "
                       "tested with the CPython 3.11 it bundles (the suite's 3.11 run)"),
]

UNITS = REPO / "units"
NO_VENV = {"PATH": "/usr/bin:/bin"}  # no virtualenv, no PYTHONPATH, no PYTHONHOME

EXPECTED_PATHS = {
    "usr/bin/gpunode",
    "usr/lib/gpunode/gpunode",
    "usr/lib/gpunode/bin/python3.11",
    "usr/lib/gpunode/lib/python3.11/os.py",
    "usr/lib/gpunode/lib/python3.11/gpunode/cli/main.py",
    "usr/lib/systemd/system/gpunode.service",
    "usr/lib/systemd/system/gpunode-label.service",
    "usr/lib/systemd/system/gpunode-watch.service",
    "usr/lib/systemd/system/multi-user.target.d/10-gpunode.conf",
    "usr/lib/systemd/system/containerd.service.d/10-gpunode-env.conf",
    "usr/lib/extension-release.d/extension-release.gpunode",
}


def image_paths(image: Path) -> set[str]:
    listing = subprocess.run(["unsquashfs", "-l", str(image)], capture_output=True, text=True,
                             check=True).stdout
    return {line.removeprefix("squashfs-root/") for line in listing.splitlines()
            if line.startswith("squashfs-root/")}


def test_image_lists_the_bundle_the_units_the_drop_in_and_the_release_file(built: Built) -> None:
    paths = image_paths(built.image)
    assert paths >= EXPECTED_PATHS
    # Byte code beside every module, hash-based (no source stat at import): gpunode's own and
    # the standard library's.
    for module in ("gpunode/cli/main", "os", "json/decoder"):
        assert f"usr/lib/gpunode/lib/python3.11/{Path(module).parent}/__pycache__/" \
            f"{Path(module).name}.cpython-311.pyc".replace("/./", "/") in paths, module
    # No test suite, Tk or site-packages of the build machine's Python.
    assert not {p for p in paths if p.startswith(("usr/lib/gpunode/lib/python3.11/test/",
                                                  "usr/lib/gpunode/lib/python3.11/tkinter",
                                                  "usr/lib/gpunode/lib/python3.11/site-"))}
    # Nothing outside /usr (sysext merges /usr and /opt; /etc in an image is ignored) and no
    # os-release of its own (systemd-sysext refuses such images).
    assert all(p == "usr" or p.startswith("usr/") for p in paths)
    assert "usr/lib/os-release" not in paths


def test_the_launchers_run_the_bundled_interpreter_isolated_and_relative_to_themselves(
        built: Built) -> None:
    for launcher, python in (("usr/bin/gpunode", "../lib/gpunode/bin/python3.11"),
                             ("usr/lib/gpunode/gpunode", "bin/python3.11")):
        path = built.tree / launcher
        assert os.access(path, os.X_OK) and not path.is_symlink()
        assert path.read_text().splitlines()[-1] == (
            f'exec "$here/{python}" -IS -c \'from gpunode.cli.main import run; run()\' "$@"')
        assert (path.parent / python).resolve() == \
            (built.tree / "usr/lib/gpunode/bin/python3.11").resolve()


def test_the_launcher_runs_by_a_relative_name_and_through_a_link(built: Built,
                                                                  tmp_path: Path) -> None:
    link = tmp_path / "bin" / "gpunode"
    link.parent.mkdir()
    link.symlink_to(built.tree / "usr/bin/gpunode")
    # an unrelated interpreter where the link's own directory would lead: not taken
    decoy = tmp_path / "lib/gpunode/bin/python3.11"
    decoy.parent.mkdir(parents=True)
    decoy.write_text("#!/bin/sh\necho decoy; exit 3\n")
    decoy.chmod(0o755)
    for argv, cwd in ((["sh", "gpunode", "--version"], built.tree / "usr/bin"),
                      ([str(link), "--version"], tmp_path)):
        done = subprocess.run(argv, cwd=cwd, env=NO_VENV, capture_output=True, text=True,
                              timeout=60, check=False)
        assert (done.returncode, done.stdout) == (0, f"gpunode {gpunode.__version__}\n"), \
            done.stderr


def test_every_elf_file_finds_its_libraries_in_the_bundle_or_glibc(built: Built) -> None:
    """RPATHs, not LD_LIBRARY_PATH: ldd resolves every library of every ELF file in the
    bundle inside it, but glibc's, which is the node's."""
    bundle = built.tree / "usr/lib/gpunode"
    elves = [p for p in bundle.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"]
    assert any(p.name == "python3.11" for p in elves)
    assert any(p.name.startswith("_ssl.") for p in elves)
    glibc = load_build_script().GLIBC
    for elf in elves:
        listing = subprocess.run(["ldd", str(elf)], capture_output=True, text=True,
                                 check=True).stdout
        for line in listing.splitlines():
            name, arrow, where = line.strip().partition(" => ")
            if arrow and not name.startswith(glibc):
                assert where.startswith(str(bundle)), (elf, line)


def test_everything_in_the_image_is_owned_by_root(built: Built) -> None:
    listing = subprocess.run(["unsquashfs", "-lls", str(built.image)], capture_output=True,
                             text=True, check=True).stdout
    owners = {line.split()[1] for line in listing.splitlines() if "squashfs-root" in line}
    assert owners == {"root/root"}


def test_extension_release_matches_flatcar_at_sysext_level_1_0_on_x86_64(built: Built) -> None:
    release = built.tree / "usr/lib/extension-release.d/extension-release.gpunode"
    fields = dict(line.split("=", 1) for line in release.read_text().splitlines() if line)
    assert fields["ID"] == "flatcar"
    assert fields["SYSEXT_LEVEL"] == "1.0"
    assert fields["ARCHITECTURE"] == "x86-64"
    # Lets systemd accept the versioned file name, not only /etc/extensions/gpunode.raw.
    assert os.getxattr(release, "user.extension-release.strict") == b"0"


def test_the_bundle_carries_the_distributions_cpython_where_the_build_machine_has_one(
        built: Built) -> None:
    """Debian's /usr/bin/python3.11 (profile-guided, link-time optimised, libpython and the
    common extension modules linked in), not the interpreter that ran the build, where the
    machine has one; the build says which."""
    packaged = Path("/usr/bin/python3.11")
    expected = packaged if packaged.is_file() else \
        Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    ask = ["-IS", "-c", "import sys; print(sys.version, sorted(sys.builtin_module_names))"]
    bundled = subprocess.run([str(built.tree / "usr/lib/gpunode/bin/python3.11"), *ask],
                             env=NO_VENV, capture_output=True, text=True, timeout=60,
                             check=True).stdout
    assert bundled == subprocess.run([str(expected), *ask], env=NO_VENV, capture_output=True,
                                     text=True, timeout=60, check=True).stdout
    version = bundled.split()[0]
    assert f"python   {expected.resolve()} (CPython {version})\n" in built.stdout


def test_a_python_the_bundle_cannot_carry_is_refused_before_anything_is_built(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = load_build_script()
    other = tmp_path / "python3.12"  # answers as another 3.X would
    answer = {"implementation": "cpython", "version": "3.12.1", "minor": [3, 12],
              "soabi": "cpython-312-x86_64-linux-gnu"}
    other.write_text(f"#!/bin/sh\necho '{json.dumps(answer)}'\n")
    other.chmod(0o755)
    vague = tmp_path / "python3.11"  # this 3.X and ABI, but no paths
    vague.write_text("#!/bin/sh\necho '" + json.dumps({
        "implementation": sys.implementation.name, "minor": list(sys.version_info[:2]),
        "soabi": sysconfig.get_config_var("SOABI"), "stdlib": 3}) + "'\n")
    vague.chmod(0o755)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = {str(tmp_path / "missing"): "cannot run it",
             "/bin/false": "not a Python that runs `-IS -c` (exit 1)",
             str(other): "cpython 3.12.1 (cpython-312-x86_64-linux-gnu); the bundle needs "
                         "cpython 3.11",
             str(vague): "it does not say where its executable, standard library",
             str(fifo): "cannot run it"}
    for python, message in cases.items():
        out = tmp_path / "out"
        assert script.main(["--python", python, "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"build_sysext: error: --python {python}: ") and message in err, err
        assert err.count("\n") == 1 and not out.exists()


def test_release_text_for_any_os_names_id_any() -> None:
    text = load_build_script().release_text("_any")
    assert text.splitlines()[:3] == ["ID=_any", "SYSEXT_LEVEL=1.0", "ARCHITECTURE=x86-64"]


def test_units_in_the_image_are_those_of_units_byte_for_byte(built: Built) -> None:
    system = built.tree / "usr/lib/systemd/system"
    for unit in ("gpunode.service", "gpunode-label.service", "gpunode-watch.service"):
        assert (system / unit).read_bytes() == (UNITS / unit).read_bytes(), unit


def test_drop_in_makes_multi_user_target_want_the_three_units(built: Built) -> None:
    parser = configparser.ConfigParser()
    parser.read_string((built.tree / "usr/lib/systemd/system/multi-user.target.d/"
                        "10-gpunode.conf").read_text())
    assert parser.sections() == ["Unit"]
    assert dict(parser["Unit"]) == {
        "wants": "gpunode.service gpunode-label.service gpunode-watch.service"}


def test_sha512_file_names_the_image_and_its_digest(built: Built) -> None:
    digest = hashlib.sha512(built.image.read_bytes()).hexdigest()
    sha_file = built.image.with_name(built.image.name + ".sha512")
    assert sha_file.read_text() == f"{digest}  {built.image.name}\n"
    assert digest in built.stdout


def test_bundle_holds_every_gpunode_module_and_each_lazy_import(built: Built) -> None:
    script = load_build_script()
    bundled = script.bundled_modules(built.tree / "usr/lib/gpunode")
    ours = {"gpunode"} | {m.name for m in pkgutil.walk_packages(gpunode.__path__, "gpunode.")}
    assert ours - bundled == set()
    assert set(script.LAZY_IMPORTS) - bundled == set()


def test_bundle_holds_no_test_support(built: Built) -> None:
    """Fixture hosts and harnesses (gpunode_testing) and the test tools never reach a node."""
    bundled = load_build_script().bundled_modules(built.tree / "usr/lib/gpunode")
    test_support = {m for m in bundled if m == "gpunode.fixtures"
                    or m.split(".")[0] in ("gpunode_testing", "pytest", "_pytest")}
    assert test_support == set()
    named = [p for p in built.tree.rglob("*") if "fixtures" in p.name or "gpunode_testing" in
             p.name]
    assert named == []


def test_gpunode_never_imports_the_test_support_package() -> None:
    """No module of gpunode imports gpunode_testing, so the bundle cannot need it."""
    importers = []
    for path in sorted(Path(gpunode.__path__[0]).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "gpunode_testing" for name in names):
                importers.append(str(path.relative_to(REPO)))
    assert importers == []


def test_bundle_holds_gpunode_package_data_where_importlib_resources_finds_it(
        built: Built) -> None:
    """Every file pyproject.toml ships as package data is in the bundle, byte for byte."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    shipped = {f"{package.replace('.', '/')}/{name}" for package, names in declared.items()
               for name in names}
    assert shipped == set(load_build_script().PACKAGE_DATA) == {
        "gpunode/driver/build.sh", "gpunode/delivery/units/gpunode.service",
        "gpunode/delivery/units/gpunode-label.service",
        "gpunode/delivery/units/gpunode-watch.service",
        "gpunode/delivery/units/containerd-env.conf"}
    stdlib = built.tree / "usr/lib/gpunode/lib/python3.11"
    for data in shipped:
        assert (stdlib / data).read_bytes() == (REPO / data).read_bytes()


def test_bundled_gpunode_prints_its_version_without_a_virtualenv(built: Built) -> None:
    for program in ("usr/lib/gpunode/gpunode", "usr/bin/gpunode"):
        done = subprocess.run([str(built.tree / program), "--version"], env=NO_VENV,
                              capture_output=True, text=True, timeout=60, check=False)
        assert (done.returncode, done.stdout) == (0, f"gpunode {gpunode.__version__}\n"), \
            done.stderr


def test_bundled_gpunode_status_says_ready_on_a_ready_fixture_node(
    built: Built, tmp_path: Path
) -> None:
    root = tmp_path / "node"
    fixtures.build(fixtures.MACHINES["nc4as-t4-v3"], root, fixtures.Options(state="ready"))
    done = subprocess.run([str(built.tree / "usr/bin/gpunode"), "--root", str(root), "status",
                           "--json"], env=NO_VENV, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verdict"] == "ready"


@pytest.mark.parametrize("fmt", ["butane", "clc"])
def test_bundled_gpunode_renders_the_snippet_the_checkout_renders(
        built: Built, tmp_path: Path, fmt: str) -> None:
    """The bundle's package data holds the units, so `gpunode ignition` works on a node too."""
    argv = ["ignition", "--format", fmt, "--sysext-url", URL, "--sysext-sha512", SHA512]
    done = subprocess.run([str(built.tree / "usr/bin/gpunode"), "--log-format", "json", *argv],
                          env=NO_VENV, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ignition.render(ignition.snippet(URL, SHA512, None), fmt)


# -- a Flatcar-style boot in a real systemd ----------------------------------------------------


@pytest.fixture
def workdir(built: Built) -> Iterator[Path]:
    path = built.dir / f"ns-{secrets.token_hex(4)}"
    path.mkdir()
    yield path
    with contextlib.suppress(OSError):
        shutil.rmtree(path)


def flatcar_boot(built: Built, workdir: Path) -> SystemdNamespace:
    """systemd with Flatcar's os-release, the image linked as /etc/extensions/gpunode.raw (as
    gpunode's Ignition snippet installs it), systemd-sysext.service and Flatcar's
    ensure-sysext.service enabled, and no PCI device (a CPU node: boot records no-gpu).
    containerd.service (not started) runs workdir/containerd, which records its environment."""
    (workdir / "os-release").write_text(fixtures.FLATCAR_OS_RELEASE)
    (workdir / "no-pci-devices").mkdir()
    containerd = workdir / "containerd"
    containerd.write_text(f"#!/bin/sh\nenv > {workdir / 'containerd.env'}\n"
                          "echo 'containerd github.com/containerd/containerd v1.7.20 0'\n")
    containerd.chmod(0o755)
    units = {"systemd-sysext.service": Path("/lib/systemd/system/systemd-sysext.service")
             .read_text(), "ensure-sysext.service": FLATCAR_ENSURE_SYSEXT,
             "containerd.service": f"[Service]\nExecStart={containerd} --config "
                                   "/etc/containerd/config.toml\n"}
    prepare = [
        # systemd makes / shared when it boots a machine, not in a container (the harness's
        # container=docker): systemd-sysext merges in a child mount namespace and relies on
        # the overlay propagating back. The namespace's mounts are private copies of the
        # machine's, so this shares them only within the namespace.
        "mount -n --make-rshared /",
        "rm -f /etc/os-release",  # Debian's is a link into /usr, which is not overlaid here
        f"cp {workdir / 'os-release'} /etc/os-release",
        "mkdir -p /etc/extensions",
        f"ln -s {built.image} /etc/extensions/gpunode.raw",
        f"mount -n --bind {workdir / 'no-pci-devices'} /sys/bus/pci/devices",
    ]
    # /var/lib copy-on-write: gpunode keeps its containerd ledger there (/usr must stay the
    # machine's: systemd-sysext merges onto it).
    return SystemdNamespace(units, workdir, prepare=prepare, overlays=("var/lib",),
                            enable=("systemd-sysext.service", "ensure-sysext.service"))


def test_flatcar_boot_merges_the_image_and_starts_gpunode_from_it(
    built: Built, workdir: Path
) -> None:
    with flatcar_boot(built, workdir) as ns:
        ns.wait_active("gpunode.service")
        assert "gpunode" in ns.run(["systemd-sysext", "status"]).stdout
        assert ns.run(["findmnt", "-n", "-o", "FSTYPE", "/usr"]).stdout.strip() == "overlay"
        assert ns.run(["cat", "/usr/bin/gpunode"]).stdout == \
            (built.tree / "usr/bin/gpunode").read_text()
        version = ns.run(["/usr/bin/gpunode", "--version"])
        assert version.stdout == f"gpunode {gpunode.__version__}\n"

        # The drop-in, not links in /etc, made multi-user.target want the three units.
        wants = ns.unit_property("multi-user.target", "Wants").split()
        assert {"gpunode.service", "gpunode-label.service", "gpunode-watch.service"} <= \
            set(wants)
        assert ns.run(["test", "-e", "/etc/systemd/system/multi-user.target.wants/"
                       "gpunode.service"], check=False).returncode != 0
        unit = ns.unit_properties("gpunode.service", "Result", "ExecMainStatus", "FragmentPath")
        assert (unit["Result"], unit["ExecMainStatus"]) == ("success", "0")
        assert ns.run(["cat", unit["FragmentPath"]]).stdout == \
            (UNITS / "gpunode.service").read_text()
        record = json.loads(ns.run(["cat", "/run/gpunode/state.json"]).stdout)
        assert record["outcome"] == "no-gpu"
        ns.wait_for(lambda: ns.unit_property("gpunode-label.service",
                                             "ExecMainStartTimestampMonotonic") not in ("", "0"),
                    30, "gpunode-label.service to have run", unit="gpunode-label.service")
        # The bundled gpunode runs as the watch daemon under its unit's hardening: READY.
        ns.wait_active("gpunode-watch.service")
        assert ns.unit_property("gpunode-watch.service", "NRestarts") == "0"

        # The versioned file name itself merges too (the release file's strict=0 xattr).
        ns.run(["rm", "/etc/extensions/gpunode.raw"])
        ns.run(["mkdir", "-p", "/run/extensions"])
        ns.run(["cp", str(built.image), f"/run/extensions/{IMAGE_NAME}"])
        ns.run(["systemd-sysext", "refresh"])
        status = ns.run(["systemd-sysext", "status"]).stdout
        assert IMAGE_NAME.removesuffix(".raw") in status
        assert ns.run(["/usr/bin/gpunode", "--version"]).stdout.startswith("gpunode ")


def test_programs_gpunode_runs_get_the_callers_library_path_not_the_bundles(
    built: Built, workdir: Path
) -> None:
    with flatcar_boot(built, workdir) as ns:
        ns.wait_active("gpunode.service")
        # configure runs containerd (--version, config dump): here workdir/containerd.
        ns.run(["/usr/bin/gpunode", "--log-format", "json", "containerd", "configure",
                "--force"], env={"LD_LIBRARY_PATH": "/opt/callers"})
        environment = (workdir / "containerd.env").read_text().splitlines()
        # the caller's, not one that names the bundle's libraries (their RPATHs find them)
        assert [v for v in environment if v.startswith("LD_LIBRARY_PATH")] == [
            "LD_LIBRARY_PATH=/opt/callers"]


def driver_sysext(workdir: Path, name: str) -> Path:
    """A stand-in for one of Flatcar's driver sysexts: its extension-release as Flatcar's
    build_sysext writes it (ID=flatcar, this OS's VERSION_ID), and one file in /usr."""
    version = configparser.ConfigParser()
    version.read_string("[os]\n" + fixtures.FLATCAR_OS_RELEASE)
    tree = workdir / f"{name}-tree"
    release = tree / f"usr/lib/extension-release.d/extension-release.flatcar-{name}"
    release.parent.mkdir(parents=True)
    release.write_text(f"ID=flatcar\nVERSION_ID={version['os']['VERSION_ID']}\n"
                       "ARCHITECTURE=x86-64\nSYSEXT_ID=flatcar-" + name + "\n")
    marker = tree / f"usr/share/{name}/README"
    marker.parent.mkdir(parents=True)
    marker.write_text(f"{name} stand-in\n")
    image = workdir / f"flatcar-{name}.raw"
    subprocess.run(["mksquashfs", str(tree), str(image), "-all-root", "-noappend", "-quiet"],
                   capture_output=True, check=True)
    return image


def baked_driver(workdir: Path) -> tuple[str, str, Path, str]:
    """(driver sysext name, where a bake keeps it on the node, the image to copy there, Python
    that runs the driver step's merge of it: gpunode.driver.step.merge_baked)."""
    name = "nvidia-drivers-580"
    version = fixtures.FLATCAR_OS_RELEASE.split("VERSION=")[1].split("\n")[0]
    baked = f"/etc/flatcar/sysext/flatcar-{name}-{version}.raw"
    merge = ("from pathlib import Path\n"
             "from gpunode.platform.host import Host\n"
             "from gpunode.driver import step\n"
             "from gpunode.driver.modules import KmodTools\n"
             f"step.merge_baked(Host(Path('/')), {name!r}, {baked!r}, KmodTools())\n")
    return name, baked, driver_sysext(workdir, name), merge


def test_a_baked_driver_sysext_merges_from_run_extensions_while_gpunode_runs_from_its_own(
    built: Built, workdir: Path
) -> None:
    """The driver step's merge (gpunode.driver.step.merge_baked, run by the checkout's Python
    inside the namespace) with the real systemd-sysext: the chosen baked file linked from
    /run/extensions merges next to gpunode's own sysext, though a process holds a file of the
    merged /usr open the whole time (gpunode itself runs from there at boot)."""
    name, baked, image, merge = baked_driver(workdir)
    with flatcar_boot(built, workdir) as ns:
        ns.wait_active("gpunode.service")
        ns.run(["mkdir", "-p", "/etc/flatcar/sysext"])
        ns.run(["cp", str(image), baked])
        ns.run(["systemd-run", "--unit=holder", "sh", "-c",
                "exec 3</usr/lib/gpunode/gpunode; exec sleep 300"])
        ns.wait_active("holder.service")
        done = ns.run([sys.executable, "-c", merge], env={"PYTHONPATH": str(REPO)},
                      check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        status = ns.run(["systemd-sysext", "status"]).stdout
        assert f"flatcar-{name}" in status and "gpunode" in status
        assert ns.run(["readlink", f"/run/extensions/flatcar-{name}.raw"]).stdout.strip() == \
            baked
        assert ns.run(["cat", f"/usr/share/{name}/README"]).stdout == f"{name} stand-in\n"
        assert ns.unit_property("holder.service", "ActiveState") == "active"
        assert ns.run(["/usr/bin/gpunode", "--version"]).stdout.startswith("gpunode ")


# What gpunode.service's [Service] says about how gpunode runs, not what it runs.
NOT_SANDBOXING = {"Type", "NotifyAccess", "RemainAfterExit", "ExecStart", "TimeoutStartSec"}


def unit_sandboxing(unit: str) -> list[str]:
    """gpunode.service's other [Service] settings, as `systemd-run -p` arguments (read as
    gpunode reads units: gpunode.platform.systemd_unit)."""
    from gpunode.platform.systemd_unit import _service_assignments

    return [arg for key, value in _service_assignments((UNITS / unit).read_text())
            if key not in NOT_SANDBOXING for arg in ("-p", f"{key}={value}")]


def test_the_driver_merge_from_inside_gpunode_service_reaches_the_node(
    built: Built, workdir: Path
) -> None:
    """The same merge run as gpunode.service runs it (its own settings, the bundled Python of
    the merged /usr): what it merges is the node's /usr, for containerd, the kubelet and every
    later unit, not a mount namespace of gpunode's own that ends with it (PrivateTmp= and
    ProtectHome= would make one: src/core/execute.c exec_needs_mount_namespace)."""
    name, baked, image, merge = baked_driver(workdir)
    with flatcar_boot(built, workdir) as ns:
        ns.wait_active("gpunode.service")
        ns.run(["mkdir", "-p", "/etc/flatcar/sysext"])
        ns.run(["cp", str(image), baked])
        done = ns.run(["systemd-run", "--wait", "--pipe", "--quiet",
                       *unit_sandboxing("gpunode.service"),
                       "/usr/lib/gpunode/bin/python3.11", "-IS", "-c", merge],
                      check=False, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert ns.run(["cat", f"/usr/share/{name}/README"], check=False).stdout == \
            f"{name} stand-in\n"
        assert f"flatcar-{name}" in ns.run(["systemd-sysext", "status"]).stdout


def test_a_second_build_elsewhere_gives_the_same_bytes(built: Built) -> None:
    """Reproducible: another work and output directory, the same image (timestamps, byte
    code, modes and owners fixed)."""
    out, work = built.dir / "again-out", built.dir / "again-work"
    done = subprocess.run([sys.executable, str(REPO / "packaging/build_sysext.py"), "--out",
                           str(out), "--work", str(work)], capture_output=True, text=True,
                          timeout=1200, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / IMAGE_NAME).read_bytes() == built.image.read_bytes()
