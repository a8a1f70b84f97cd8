"""Build gpunode's system extension for Flatcar: gpunode-<version>-x86-64.raw, a squashfs.

    .venv/bin/python packaging/build_sysext.py [--id flatcar|_any] [--out DIR] [--work DIR]
    make sysext                                  # the same, into packaging/build/

Flatcar has no Python, so the image carries its own: a CPython 3.11 (its executable, standard
library and shared libraries; `--python`, below), relocated to /usr/lib/gpunode, with gpunode
and its dependencies (tomlkit, pyudev, structlog, PyYAML, pyelftools, pystemd with lxml and
psutil, as this script's environment has them) beside the standard library, all byte compiled.
The image holds

    usr/bin/gpunode                                                 the launcher (below)
    usr/lib/gpunode/gpunode, bin/python3.11, lib/...                the bundle
    usr/lib/systemd/system/gpunode.service, gpunode-label.service,
                           gpunode-watch.service                    byte for byte from units/
    usr/lib/systemd/system/multi-user.target.d/10-gpunode.conf      Wants= the three units
    usr/lib/systemd/system/containerd.service.d/10-gpunode-env.conf units/containerd-env.conf
    usr/lib/extension-release.d/extension-release.gpunode

**Why a relocated interpreter.** A PyInstaller one-dir bundle adds a bootloader, an archive
importer and run-time hooks to every start (`make bench` compares the bundle with the
virtualenv). This interpreter needs none: the launcher is
`exec <dir>/bin/python3.X -IS -c 'from gpunode.cli.main import run; run()'`
(-I: no PYTHON* variables, no user site, no script directory on the path; -S: no site, since
everything lies in the standard library's directory), the byte code is unchecked hash-based
(no source stat at import, the same bytes from every build). Python finds its
standard library from where its executable lies (lib/python3.11/os.py), and each ELF file its
libraries through an RPATH set with patchelf ($ORIGIN/../lib), so the programs gpunode runs
get the caller's environment: no LD_LIBRARY_PATH is set for them to inherit, and they load the
node's own libcrypto, not the bundle's. The launcher finds the interpreter relative to its
own path, so the unpacked tree runs anywhere (tests, the benchmark, an image bake) and the
merged one from /usr.

**Which CPython.** `--python` names the interpreter to bundle; by default the distribution's
own /usr/bin/python3.X (of the 3.X running this script) where the build machine has one, else
the interpreter running this script; the build prints which. Debian's is built with
profile-guided and link-time optimisation, links libpython in statically and has the
common extension modules (_socket, math, select, fcntl, ...) built in: it starts faster than a
plain `./configure && make` build with a shared libpython (`make bench` prints the bundle's
`python -c pass` beside the venv's). Either must be CPython of
the same 3.X and ABI as this script's environment, whose packages (PyYAML's extension module
among them) are bundled.

**glibc floor.** The bundle needs at least the glibc of the machine that built it: built on
Debian 12 that is glibc 2.36 (the interpreter and its libraries link against it; glibc itself
is never bundled, the node's is used). Flatcar stable ships a newer glibc than 2.36, so the
bundle runs there. Build on a machine whose glibc is at most the oldest Flatcar's you target.
libudev is not bundled either: pyudev loads the node's libudev.so.1 (Flatcar has it) through
ctypes at run time, and gpunode reads sysfs when it cannot. pystemd's modules link libsystemd,
so the build machine's libsystemd.so.0 is bundled (with libgcrypt, libzstd, liblz4, liblzma and
libcap): a D-Bus client, whose wire protocol does not change with the node's systemd.

**Enabling the units.** Units inside an extension cannot be enabled at build time: `systemctl
enable` writes symlinks to /etc, which the image does not carry (links in the image's own
multi-user.target.wants/ would work as well; a drop-in is one plain file to read and test).
`multi-user.target.d/10-gpunode.conf` says `Wants=gpunode.service gpunode-label.service
gpunode-watch.service`, so
whenever the extension is merged and the manager has (re)loaded its units, reaching
multi-user.target starts them. On Flatcar, systemd-sysext.service merges the images early in
the boot and ensure-sysext.service then runs `systemctl daemon-reload` and `systemctl restart
--no-block multi-user.target`, which queues them (newer Flatcar merges in the initrd, before the
manager first loads its units). Flatcar's sysext documentation recommends `Upholds=` instead:
that starts a unit again whenever it is not active, so a failed gpunode.service (one job a boot)
would be re-run in a loop until its start limit trips, and gpunode-label.service (a oneshot
without RemainAfterExit, inactive after every success) would be re-run after each success;
gpunode-label.service retries failures itself (Restart=on-failure), and gpunode-watch.service, a
daemon, restarts itself (Restart=always).
`EXTENSION_RELOAD_MANAGER=1` asks systemd >= 255 to reload the manager after a merge (older
versions ignore it).

**Name.** systemd-sysext accepts an image only when the name of its extension-release file
matches the image's file name without .raw, so install the image the way Flatcar's sysupdate and
gpunode's Ignition snippet do: /opt/extensions/gpunode/gpunode-<version>-x86-64.raw, linked as
/etc/extensions/gpunode.raw. The release file also carries the xattr
`user.extension-release.strict=0`, which lets systemd accept the versioned file name itself
(it is the only extension-release file in the image; tested with systemd 252).

**Reproducible.** SOURCE_DATE_EPOCH (from the environment, else the last commit's time, else 0)
fixes every timestamp in the image and the squashfs creation time; PYTHONHASHSEED=0 and
hash-based .pyc files with the install path as their file name fix the byte code; modes are
normalised (0755 directories and executables, 0644 other files), owners are root, other
xattrs are dropped. Two builds of the same sources with the same tools give the same bytes,
whatever the checkout's or the work directory's path.

Needs: mksquashfs (Debian squashfs-tools), ldd (libc-bin), strip (binutils) and patchelf.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "gpunode" / "delivery" / "units"  # package data; units/ at the top links here
DEFAULT_OUT = REPO / "packaging" / "build"
NAME = "gpunode"
ARCHITECTURE = "x86-64"
SYSEXT_LEVEL = "1.0"
IDS = ("flatcar", "_any")
UNIT_NAMES = ("gpunode.service", "gpunode-label.service", "gpunode-watch.service")
BUNDLE_DIR = Path("usr/lib/gpunode")
BIN_LINK = Path("usr/bin/gpunode")
DROP_IN = Path("usr/lib/systemd/system/multi-user.target.d/10-gpunode.conf")
# containerd reads /etc/gpunode/containerd.env, which gpunode writes: no daemon-reload at
# first boot (gpunode/containerd/ledger.py ENV_FILE, SHIPPED_DROPIN).
CONTAINERD_DROP_IN = Path("usr/lib/systemd/system/containerd.service.d/10-gpunode-env.conf")
RELEASE = Path(f"usr/lib/extension-release.d/extension-release.{NAME}")
STRICT_XATTR = "user.extension-release.strict"
STDLIB = f"python{sys.version_info.major}.{sys.version_info.minor}"  # the interpreter, its lib/

DROP_IN_TEXT = f"""\
# Installed by the gpunode system extension ({NAME}-<version>-{ARCHITECTURE}.raw).
# Units inside an extension cannot be enabled by links in /etc when the image is built: this
# makes multi-user.target want them whenever the extension is merged. Wants=, not the Upholds=
# that Flatcar's sysext docs suggest: Upholds= starts a unit again whenever it is not active,
# which re-runs a failed gpunode.service, and gpunode-label.service after every success, in a loop.
[Unit]
Wants={" ".join(UNIT_NAMES)}
"""

# What of the build machine's standard library a node never imports: test suites, Tk, IDLE,
# packaging and build tools, the curses, dbm, sqlite and readline bindings (and the libraries
# they would bring along).
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter",
               "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "venv", "distutils",
               "unittest", "sqlite3", "dbm", "curses", "__pycache__", "__phello__"}
DYNLOAD_SKIP = ("_tkinter", "_test", "xxlimited", "_xxtestfuzz", "_ctypes_test", "_curses",
                "readline", "_sqlite3", "_dbm", "_gdbm", "nis", "_crypt", "ossaudiodev", "spwd",
                "xxsubtype")
# The node's glibc is used, never a copy of the build machine's.
GLIBC = ("libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "libutil.so",
         "ld-linux", "libresolv.so", "linux-vdso")
# gpunode's package data (pyproject's package-data), where importlib.resources finds it; the
# units are there too, so the bundled `gpunode ignition` embeds the very units the image
# installs.
PACKAGE_DATA = ("gpunode/driver/build.sh", "gpunode/delivery/units/containerd-env.conf",
                *(f"gpunode/delivery/units/{unit}" for unit in UNIT_NAMES))
# Modules gpunode imports lazily that the bundle must hold; checked after the build.
LAZY_IMPORTS = ("yaml", "tomlkit", "pyudev", "structlog", "structlog.dev", "elftools.elf.elffile",
                "bz2", "http.client", "urllib.request", "ssl", "ctypes",
                # only some commands need them: digests, globs, trees, sockets, package data
                "hashlib", "fnmatch", "shutil", "socket", "importlib.resources",
                # systemd over D-Bus (its Cython modules and the libsystemd they link)
                "pystemd", "pystemd.dbuslib", "pystemd.dbusexc")
# The launchers: the bundled interpreter isolated (-I: no PYTHON* variables, no user site, no
# script directory on the path) and without site (-S: gpunode and its dependencies lie in the
# standard library's directory), found from where the launcher itself lies, so the unpacked
# tree runs anywhere (the tests, the benchmark, an image bake) and the merged one from /usr.
LAUNCHER = """#!/bin/sh
# gpunode's launcher (packaging/build_sysext.py): the bundled Python 3, isolated, no site.
here=${{0%/*}}
[ "$here" != "$0" ] || here=.
# called through a link elsewhere: from where the launcher itself lies
[ ! -L "$0" ] || here=$(dirname "$(readlink -f "$0")")
exec "$here/{python}" -IS -c 'from gpunode.cli.main import run; run()' "$@"
"""
class BuildError(RuntimeError):
    """The image could not be built; the message says why."""


@dataclass(frozen=True)
class Interpreter:
    """The CPython the bundle carries, as it describes itself."""

    executable: Path  # the real file (a virtualenv's python: the one it was made from)
    version: str
    stdlib: Path
    dynload: Path  # its extension modules (sysconfig's DESTSHARED)


# Run by the interpreter to bundle (-I -S: what it is without site or PYTHON* variables).
DESCRIBE = ("import json, os, sys, sysconfig; print(json.dumps({'implementation': "
            "sys.implementation.name, 'version': '.'.join(map(str, sys.version_info[:3])), "
            "'minor': list(sys.version_info[:2]), 'soabi': sysconfig.get_config_var('SOABI'), "
            "'executable': os.path.realpath(getattr(sys, '_base_executable', sys.executable)), "
            "'stdlib': sysconfig.get_paths()['stdlib'], "
            "'dynload': sysconfig.get_config_var('DESTSHARED')}))")


def default_python() -> str:
    """The distribution's packaged python3.X where there is one, else this interpreter."""
    packaged = Path("/usr/bin") / STDLIB
    if packaged.is_file() and os.access(packaged, os.X_OK):
        return str(packaged)
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def interpreter(python: str) -> Interpreter:
    """`python` described by itself: a CPython of this script's 3.X and ABI, or BuildError."""
    try:
        done = subprocess.run([python, "-IS", "-c", DESCRIBE], capture_output=True,
                              text=True, timeout=60, check=False)
        described = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        raise BuildError(f"--python {python}: cannot run it: {e}") from None
    if not isinstance(described, dict):
        raise BuildError(f"--python {python}: not a Python that runs `-IS -c` "
                         f"(exit {done.returncode}): {done.stderr.strip()[-400:]}")
    wanted = (sys.implementation.name, list(sys.version_info[:2]),
              sysconfig.get_config_var("SOABI"))
    found = (described.get("implementation"), described.get("minor"), described.get("soabi"))
    if found != wanted:
        raise BuildError(f"--python {python}: {found[0]} {described.get('version')} "
                         f"({found[2]}); the bundle needs {wanted[0]} "
                         f"{'.'.join(map(str, wanted[1]))} ({wanted[2]}), as this script's "
                         "environment, whose packages it carries (run the script with that "
                         "Python's virtualenv to bundle another 3.X)")
    paths = [described.get(key) for key in ("executable", "version", "stdlib", "dynload")]
    if not all(isinstance(value, str) and value for value in paths):
        raise BuildError(f"--python {python}: it does not say where its executable, standard "
                         "library and extension modules lie (sysconfig)")
    return Interpreter(Path(paths[0]), paths[1], Path(paths[2]), Path(paths[3]))


def version() -> str:
    text = (REPO / "gpunode" / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if not found:
        raise BuildError(f"{REPO / 'gpunode/__init__.py'}: no __version__ = \"...\" line")
    return found.group(1)


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH, else the last commit's time, else 0."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    try:
        done = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"],
                              capture_output=True, text=True, check=False)
    except OSError:
        return 0
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else 0


def image_name(ver: str) -> str:
    return f"{NAME}-{ver}-{ARCHITECTURE}.raw"


def release_text(os_id: str) -> str:
    return (f"ID={os_id}\nSYSEXT_LEVEL={SYSEXT_LEVEL}\nARCHITECTURE={ARCHITECTURE}\n"
            "EXTENSION_RELOAD_MANAGER=1\n")


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False,
                              **kwargs)  # type: ignore[call-overload]
    except OSError as e:
        raise BuildError(f"cannot run {argv[0]}: {e.strerror}") from e
    if done.returncode != 0:
        raise BuildError(f"{' '.join(map(str, argv[:4]))} ... exited with {done.returncode}:\n"
                         f"{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done


# -- tools -----------------------------------------------------------------------------------


def check_tools() -> None:
    missing = [tool for tool in ("mksquashfs", "ldd", "patchelf", "strip")
               if shutil.which(tool) is None]
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: apt-get install squashfs-tools "
                         "patchelf binutils libc-bin")


# -- the bundle: a CPython, relocated ---------------------------------------------------------


def bundle(work: Path, python: Interpreter) -> Path:
    """work/bundle, laid out as usr/lib/gpunode: bin/python3.X (`python`), lib/ (every
    library it and its extension modules link but glibc: libpython where it has one, libssl,
    libffi, ...), lib/python3.X/ (the standard library, gpunode and its dependencies, byte
    compiled), and the launcher `gpunode`. Each ELF file finds its libraries through its own
    RPATH ($ORIGIN/...), so the programs gpunode runs inherit no library path."""
    out = work / "bundle"
    stdlib = out / "lib" / STDLIB
    (out / "bin").mkdir(parents=True)
    (out / "lib").mkdir()
    copy_file(str(python.executable), str(out / "bin" / STDLIB))  # its libpython: a library
    copy_tree(python.stdlib, stdlib, STDLIB_SKIP)
    (stdlib / "lib-dynload").mkdir(exist_ok=True)
    for module in sorted(python.dynload.glob("*.so")):
        if not module.name.startswith(DYNLOAD_SKIP):
            copy_file(str(module), str(stdlib / "lib-dynload" / module.name))
    copy_tree(REPO / "gpunode", stdlib / "gpunode", {"__pycache__"},
              {data.removeprefix("gpunode/") for data in PACKAGE_DATA})
    for dist in dependencies("gpunode"):
        for file in dist.files or ():
            if file.parts[0].endswith(".dist-info") or "__pycache__" in file.parts or \
                    file.parts[0] == "..":
                continue
            target = stdlib / Path(*file.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_file(str(dist.locate_file(file)), str(target))
    link_libraries(out)
    compile_all(out / "bin" / STDLIB, stdlib)
    for relative, python in (("gpunode", STDLIB), ("bin/gpunode", STDLIB)):
        launcher = out / relative
        launcher.write_text(LAUNCHER.format(python=f"bin/{python}" if relative == "gpunode"
                                            else python))
        launcher.chmod(0o755)
    return out


def copy_tree(source: Path, target: Path, skip: set[str], data: set[str] | None = None) -> None:
    """The .py files under source (and `data`, paths relative to it), without `skip`."""
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if skip & set(relative.parts) or relative.parts[0].startswith("config-") \
                or not path.is_file():  # config-3.X-<triplet>/: what C extensions build with
            continue
        if path.suffix == ".py" or str(relative) in (data or set()):
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            copy_file(str(path), str(target / relative))


def dependencies(name: str) -> list[importlib.metadata.Distribution]:
    """The installed distributions `name` requires, transitively: not their extras, and not
    those whose environment marker this Python does not meet (typing-extensions before 3.11);
    one that is required here must be installed."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(importlib.metadata.requires(name) or ())
    while todo:
        requirement = todo.pop()
        project, _, marker = requirement.partition(";")
        project = re.split(r"[\s<>=!~\[(]", project.strip(), maxsplit=1)[0]
        key = project.lower().replace("_", "-")
        if key in found or not applies(marker):
            continue
        try:
            found[key] = importlib.metadata.distribution(project)
        except importlib.metadata.PackageNotFoundError:
            raise BuildError(f"{name} needs {requirement}, which is not installed") from None
        todo += found[key].requires or ()
    return [found[key] for key in sorted(found)]


def applies(marker: str) -> bool:
    """Whether a requirement's environment marker holds here; an extra never does."""
    if not marker.strip():
        return True
    if "extra" in marker:
        return False
    try:
        from packaging.markers import Marker  # pytest's dependency: in the test virtualenv
    except ImportError:
        raise BuildError("reading a requirement's marker needs the packaging module: "
                         "pip install packaging") from None
    return bool(Marker(marker).evaluate())


def elf_files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
            and p.read_bytes()[:4] == b"\x7fELF"]


def link_libraries(out: Path) -> None:
    """Copy into out/lib what the ELF files link (ldd's answer) but glibc and what the bundle
    has, then strip every ELF file and point its RPATH at out/lib."""
    lib = out / "lib"
    seen: set[str] = set()
    todo = elf_files(out)
    while todo:
        elf = todo.pop()
        for line in run(["ldd", str(elf)]).stdout.splitlines():
            name, arrow, rest = line.strip().partition(" => ")
            if not arrow or name.startswith(GLIBC) or name in seen:
                continue
            path = rest.split(" (")[0].strip()
            if path == "not found" or not path:
                raise BuildError(f"{elf}: {name} not found (ldd)")
            seen.add(name)
            if not (lib / name).exists():
                copy_file(os.path.realpath(path), str(lib / name))
                todo.append(lib / name)
    for elf in elf_files(out):
        run(["strip", "--strip-unneeded", str(elf)])
        origin = os.path.relpath(lib, elf.parent)
        run(["patchelf", "--force-rpath", "--set-rpath",
             "$ORIGIN" if origin == "." else f"$ORIGIN/{origin}", str(elf)])


def compile_all(python: Path, stdlib: Path) -> None:
    """Byte code beside every module, as the node's /usr/lib/gpunode will hold it: unchecked
    hash-based .pyc (no source stat on import, the same bytes from every build), compiled by
    the bundled interpreter itself."""
    code = ("import compileall, py_compile, sys; sys.exit(not compileall.compile_dir("
            f"{str(stdlib)!r}, ddir={'/' + str(BUNDLE_DIR / 'lib' / STDLIB)!r}, quiet=1, "
            "force=True, workers=0, "
            "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH))")
    # -B: the compiler's own imports (from this same standard library) write no timestamp
    # .pyc that compile_dir would then find current and keep; -S -B, not -I, which would
    # ignore PYTHONHASHSEED (the environment is that and PATH: no other PYTHON* applies)
    run([str(python), "-B", "-S", "-c", code],
        env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}, cwd=str(stdlib))


def bundled_modules(bundle_dir: Path) -> set[str]:
    """Modules the bundle can import: its interpreter's built-in modules (Debian's has
    _socket, binascii, math, ... in its executable) and every module file under lib/python3.X
    (lib-dynload's extension modules at the top level)."""
    stdlib = bundle_dir / "lib" / STDLIB
    modules = set(run([str(bundle_dir / "bin" / STDLIB), "-IS", "-c",
                       "import sys; print(*sys.builtin_module_names)"],
                      env={"PATH": "/usr/bin:/bin"}).stdout.split())
    for path in stdlib.rglob("*"):
        if path.suffix not in (".py", ".so") or "__pycache__" in path.parts:
            continue
        parts = path.relative_to(stdlib).parts
        if parts[0] == "lib-dynload":
            parts = parts[1:]
        name = path.name.partition(".")[0]
        modules.add(".".join(parts[:-1]) if name == "__init__" else
                    ".".join((*parts[:-1], name)))
    return modules


def gpunode_modules() -> set[str]:
    found = {"gpunode"}
    for info in pkgutil.walk_packages([str(REPO / "gpunode")], prefix="gpunode."):
        found.add(info.name)
    return found


def check_bundle(bundle_dir: Path) -> None:
    modules = bundled_modules(bundle_dir)
    missing = sorted((gpunode_modules() | set(LAZY_IMPORTS)) - modules)
    if missing:
        raise BuildError(f"the bundle lacks modules gpunode imports: {', '.join(missing)}")
    stdlib = bundle_dir / "lib" / STDLIB
    differ = [data for data in PACKAGE_DATA if not (stdlib / data).is_file()
              or (stdlib / data).read_bytes() != (REPO / data).read_bytes()]
    if differ:
        raise BuildError(f"the bundle lacks gpunode's package data: {', '.join(differ)}")
    done = subprocess.run([str(bundle_dir / "gpunode"), "--version"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin"}, check=False)
    if done.returncode != 0 or not done.stdout.startswith("gpunode "):
        raise BuildError(f"the bundled gpunode does not run: {done.stdout}{done.stderr}")
    # the extension modules load with the libraries the bundle carries (libsystemd's: RPATH)
    done = subprocess.run([str(bundle_dir / "bin" / STDLIB), "-IS", "-c",
                           "import pystemd.dbuslib, yaml"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, check=False)
    if done.returncode != 0:
        raise BuildError(f"the bundle cannot load pystemd: {done.stderr.strip()[-400:]}")


# -- the image -------------------------------------------------------------------------------


def copy_file(source: str, target: str) -> None:
    """Contents and mode; not the xattrs shutil.copy2 would bring along."""
    shutil.copyfile(source, target)
    shutil.copymode(source, target)


def stage(root: Path, bundle_dir: Path, os_id: str) -> None:
    """The image's tree under root (fresh)."""
    shutil.copytree(bundle_dir, root / BUNDLE_DIR, symlinks=True, copy_function=copy_file)
    (root / BIN_LINK).parent.mkdir(parents=True)
    (root / BIN_LINK).write_text(LAUNCHER.format(python=f"../lib/gpunode/bin/{STDLIB}"))
    (root / BIN_LINK).chmod(0o755)
    system = root / "usr/lib/systemd/system"
    system.mkdir(parents=True)
    for unit in UNIT_NAMES:
        (system / unit).write_bytes((UNITS / unit).read_bytes())
    (root / DROP_IN).parent.mkdir(parents=True)
    (root / DROP_IN).write_text(DROP_IN_TEXT)
    (root / CONTAINERD_DROP_IN).parent.mkdir(parents=True)
    (root / CONTAINERD_DROP_IN).write_bytes((UNITS / "containerd-env.conf").read_bytes())
    (root / RELEASE).parent.mkdir(parents=True)
    (root / RELEASE).write_text(release_text(os_id))


def normalise(root: Path) -> None:
    """Modes 0755/0644, no xattrs but the release file's strict=0 (mksquashfs sets the times)."""
    for path in [root, *sorted(root.rglob("*"))]:
        if path.is_symlink():
            continue
        for attr in os.listxattr(path):
            os.removexattr(path, attr)
        executable = path.is_dir() or path.stat().st_mode & 0o111
        path.chmod(0o755 if executable else 0o644)
    try:
        os.setxattr(root / RELEASE, STRICT_XATTR, b"0")
    except OSError as e:
        raise BuildError(f"cannot set {STRICT_XATTR} on {root / RELEASE} (the work directory's "
                         f"file system must support user xattrs; use --work): {e}") from e


def squash(root: Path, image: Path, sde: int) -> None:
    partial = image.with_name(image.name + ".partial")
    partial.unlink(missing_ok=True)
    # -mkfs-time/-all-time: every inode and the superblock get SOURCE_DATE_EPOCH (mksquashfs
    # refuses the variable and the options together, so the variable is not passed on).
    env = {key: value for key, value in os.environ.items() if key != "SOURCE_DATE_EPOCH"}
    run(["mksquashfs", str(root), str(partial), "-noappend", "-all-root", "-reproducible",
         "-mkfs-time", str(sde), "-all-time", str(sde), "-comp", "zstd",
         "-Xcompression-level", "19", "-quiet", "-no-progress"], env=env)
    partial.replace(image)


def fresh_work_dir(work: Path) -> None:
    """Empty work, but only a directory this script made (or an empty one)."""
    marker = work / ".gpunode-sysext-work"
    if work.exists() and any(work.iterdir()) and not marker.exists():
        raise BuildError(f"--work {work}: not empty and not a work directory of this script "
                         "(no .gpunode-sysext-work); refusing to empty it")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    marker.touch()


def sha512(path: Path) -> str:
    digest = hashlib.sha512()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(os_id: str, out: Path, work: Path, python: str | None = None) -> Path:
    if os_id not in IDS:
        raise BuildError(f"--id {os_id}: must be one of {', '.join(IDS)}")
    check_tools()
    interp = interpreter(python or default_python())
    ver, sde = version(), source_date_epoch()
    out.mkdir(parents=True, exist_ok=True)
    fresh_work_dir(work)
    started = time.monotonic()
    bundle_dir = bundle(work, interp)
    check_bundle(bundle_dir)
    bundled = time.monotonic()
    root = work / "root"
    stage(root, bundle_dir, os_id)
    normalise(root)
    image = out / image_name(ver)
    squash(root, image, sde)
    digest = sha512(image)
    (out / f"{image.name}.sha512").write_text(f"{digest}  {image.name}\n")
    size = image.stat().st_size
    print(f"image    {image}\n"
          f"id       ID={os_id} SYSEXT_LEVEL={SYSEXT_LEVEL} ARCHITECTURE={ARCHITECTURE}\n"
          f"python   {interp.executable} (CPython {interp.version})\n"
          f"size     {size} bytes ({size / 2**20:.1f} MiB; bundle "
          f"{tree_size(bundle_dir) / 2**20:.1f} MiB unpacked)\n"
          f"sha512   {digest}\n"
          f"time     {time.monotonic() - started:.1f} s (the bundle "
          f"{bundled - started:.1f} s), SOURCE_DATE_EPOCH={sde}")
    return image


def tree_size(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--id", default="flatcar", choices=IDS,
                        help="extension-release ID: flatcar (default) or _any (any OS)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where the image and its .sha512 go (default {DEFAULT_OUT})")
    parser.add_argument("--work", type=Path,
                        help="scratch directory, emptied first (default OUT/work-ID)")
    parser.add_argument("--python",
                        help=f"the CPython {STDLIB[6:]} to bundle (default: /usr/bin/{STDLIB} "
                        "where there is one, else the Python running this script)")
    args = parser.parse_args(argv)
    work = args.work or args.out / f"work-{args.id}"
    try:
        build(args.id, args.out.resolve(), work.resolve(), args.python)
    except BuildError as e:
        print(f"build_sysext: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
