"""Build gpunode's system extension for Flatcar: gpunode-<version>-x86-64.raw, a squashfs.

    .venv/bin/python packaging/build_sysext.py [--id flatcar|_any] [--out DIR] [--work DIR]
    make sysext                                  # the same, into packaging/build/

Flatcar has no Python, so the image carries its own: a PyInstaller one-dir bundle of gpunode
(CPython 3.11 with tomlkit, pyudev, structlog, PyYAML and the shared libraries
they link) in /usr/lib/gpunode, and /usr/bin/gpunode linking to it. The
image holds

    usr/bin/gpunode -> ../lib/gpunode/gpunode
    usr/lib/gpunode/gpunode, usr/lib/gpunode/_internal/...      the bundle
    usr/lib/systemd/system/gpunode.service, gpunode-label.service,
                           gpunode-watch.service                    byte for byte from units/
    usr/lib/systemd/system/multi-user.target.d/10-gpunode.conf      Wants= the three units
    usr/lib/systemd/system/containerd.service.d/10-gpunode-env.conf units/containerd-env.conf
    usr/lib/extension-release.d/extension-release.gpunode

**glibc floor.** The bundle needs at least the glibc of the machine that built it: built on
Debian 12 that is glibc 2.36 (libpython and the extension modules link against it; glibc
itself is never bundled, the node's is used). Flatcar stable ships a newer glibc than 2.36,
so the bundle runs there. Build on a machine whose glibc is at most the oldest Flatcar's
you target. libudev is not bundled either: pyudev loads the node's libudev.so.1 (Flatcar has it)
through ctypes at run time, and gpunode reads sysfs when it cannot.

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
that starts a unit again whenever it is not active, so a failed gpunode.service (a oneshot)
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
fixes every timestamp in the image and the squashfs creation time; PYTHONHASHSEED=0 fixes
PyInstaller's byte code; modes are normalised (0755 directories and executables, 0644 other
files), owners are root, other xattrs are dropped. Two builds of the same sources with the
same tools give the same bytes, whatever the checkout's or the work directory's path.

Needs: mksquashfs (Debian squashfs-tools), ldd/objdump/objcopy (libc-bin, binutils), and the
PyInstaller of packaging/requirements.txt, which this script installs into its own virtualenv
when it is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "gpunode" / "units"  # package data; units/ at the top links here
REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"
# gpunode.entry:main, after restoring the environment PyInstaller's bootloader changed.
ENTRY = Path(__file__).resolve().parent / "gpunode_main.py"
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
STDLIB = f"python{sys.version_info.major}.{sys.version_info.minor}"  # as PyInstaller names it

DROP_IN_TEXT = f"""\
# Installed by the gpunode system extension ({NAME}-<version>-{ARCHITECTURE}.raw).
# Units inside an extension cannot be enabled by links in /etc when the image is built: this
# makes multi-user.target want them whenever the extension is merged. Wants=, not the Upholds=
# that Flatcar's sysext docs suggest: Upholds= starts a unit again whenever it is not active,
# which re-runs a failed gpunode.service, and gpunode-label.service after every success, in a loop.
[Unit]
Wants={" ".join(UNIT_NAMES)}
"""

# Packages whose submodules are imported where PyInstaller's analysis cannot see it: gpunode's
# lazy imports (inside functions: the analysis does find those, but collecting all of gpunode
# makes "nothing missing" independent of how a module is imported), structlog.dev (imported
# only on a terminal).
COLLECT_SUBMODULES = ("gpunode", "structlog")
# Never imported on a node, but pulled in by hooks or optional imports: Tk, test and packaging
# tools, readline (with libreadline and libtinfo), pystemd and lxml (the test extras have them;
# gpunode speaks D-Bus itself), and multiprocessing (only ProcessPoolExecutor uses it; gpunode
# does not): its presence adds PyInstaller's multiprocessing run-time hook, ~20 ms on every
# start.
EXCLUDE_MODULES = ("tkinter", "_tkinter", "pytest", "_pytest", "setuptools", "pip",
                   "pydoc_data", "lib2to3", "ensurepip", "idlelib", "unittest", "doctest",
                   "readline", "pystemd", "lxml", "multiprocessing", "concurrent.futures.process")
# gpunode's package data (pyproject's package-data): PyInstaller collects no data files by
# itself. Each lands at the same path under _internal/, where importlib.resources finds it
# (PyInstaller's resource reader serves on-disk files); checked after the build. The units are
# there too, so the bundled `gpunode ignition` embeds the very units the image installs.
PACKAGE_DATA = ("gpunode/driver/build.sh", "gpunode/units/containerd-env.conf",
                *(f"gpunode/units/{unit}" for unit in UNIT_NAMES))
# Modules gpunode imports lazily that the bundle must hold; checked after the build.
LAZY_IMPORTS = ("yaml", "tomlkit", "pyudev", "structlog", "structlog.dev",
                "bz2", "http.client", "urllib.request", "ssl",
                # gpunode.host's (only some commands need them) and the build script's reader
                "hashlib", "fnmatch", "shutil", "socket", "importlib.resources")


class BuildError(RuntimeError):
    """The image could not be built; the message says why."""


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


def pinned(requirement: str) -> tuple[str, str]:
    for line in REQUIREMENTS.read_text().splitlines():
        name, _, ver = line.partition("==")
        if name.strip().lower() == requirement:
            return name.strip(), ver.strip()
    raise BuildError(f"{REQUIREMENTS}: no {requirement}==VERSION line")


def ensure_pyinstaller() -> str:
    """The pinned PyInstaller in this interpreter's environment; pip-installs it when missing."""
    name, want = pinned("pyinstaller")
    try:
        have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have != want:
        print(f"installing {name}=={want} (found {have or 'none'}) from {REQUIREMENTS.name}",
              flush=True)
        run([sys.executable, "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)])
    return want


def check_tools() -> None:
    missing = [tool for tool in ("mksquashfs", "ldd", "objdump", "objcopy")
               if shutil.which(tool) is None]
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: apt-get install squashfs-tools "
                         "binutils libc-bin")


# -- the bundle ------------------------------------------------------------------------------


def pyinstaller(work: Path, sde: int) -> Path:
    """Run PyInstaller; return the one-dir bundle (work/dist/gpunode)."""
    # --strip: the interpreter's libpython and extension modules carry debug info (pyenv builds
    # do: libpython 22 MB → 4 MB); nothing on a node reads it.
    argv = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN",
            "--onedir", "--strip", "--name", NAME, "--distpath", str(work / "dist"),
            "--workpath", str(work / "pyi"), "--specpath", str(work), "--paths", str(REPO)]
    for package in COLLECT_SUBMODULES:
        argv += ["--collect-submodules", package]
    for module in EXCLUDE_MODULES:
        argv += ["--exclude-module", module]
    for data in PACKAGE_DATA:
        argv += ["--add-data", f"{REPO / data}{os.pathsep}{Path(data).parent}"]
    argv.append(str(ENTRY))
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTHON", "PYINSTALLER"))}
    env.update(SOURCE_DATE_EPOCH=str(sde), PYTHONHASHSEED="0",
               PYINSTALLER_CONFIG_DIR=str(work / "pyi-config"))
    run(argv, cwd=work, env=env)
    return work / "dist" / NAME


def gpunode_modules() -> set[str]:
    found = {"gpunode"}
    for info in pkgutil.walk_packages([str(REPO / "gpunode")], prefix="gpunode."):
        found.add(info.name)
    return found


def bundled_modules(bundle: Path) -> set[str]:
    """Modules the one-dir bundle can import: its PYZ archive (read with PyInstaller's own
    reader) and its extension modules (files beside it, e.g.
    python3.11/lib-dynload/_bz2.cpython-311-...so)."""
    from PyInstaller.archive.readers import CArchiveReader

    package = CArchiveReader(str(bundle / NAME))
    pyz = next((name for name, entry in package.toc.items() if entry[-1] == "z"), None)
    if pyz is None:
        raise BuildError(f"{bundle / NAME}: no PYZ archive in the bundle")
    modules = set(package.open_embedded_archive(pyz).toc)
    internal = bundle / "_internal"
    for path in internal.rglob("*.cpython-*.so"):
        relative = path.relative_to(internal)
        if relative.parts[:2] == (STDLIB, "lib-dynload"):
            relative = relative.relative_to(STDLIB, "lib-dynload")
        modules.add(".".join((*relative.parent.parts, path.name.partition(".")[0])))
    return modules


def check_bundle(bundle: Path) -> None:
    modules = bundled_modules(bundle)
    missing = sorted((gpunode_modules() | set(LAZY_IMPORTS)) - modules)
    if missing:
        raise BuildError(f"the bundle lacks modules gpunode imports: {', '.join(missing)}")
    differ = [data for data in PACKAGE_DATA if not (bundle / "_internal" / data).is_file()
              or (bundle / "_internal" / data).read_bytes() != (REPO / data).read_bytes()]
    if differ:
        raise BuildError(f"the bundle lacks gpunode's package data: {', '.join(differ)}")


# -- the image -------------------------------------------------------------------------------


def copy_file(source: str, target: str) -> None:
    """Contents and mode; not the xattrs shutil.copy2 would bring along."""
    shutil.copyfile(source, target)
    shutil.copymode(source, target)


def stage(root: Path, bundle: Path, os_id: str) -> None:
    """The image's tree under root (fresh)."""
    shutil.copytree(bundle, root / BUNDLE_DIR, symlinks=True, copy_function=copy_file)
    (root / BIN_LINK).parent.mkdir(parents=True)
    (root / BIN_LINK).symlink_to(Path("../lib/gpunode") / NAME)
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


def build(os_id: str, out: Path, work: Path) -> Path:
    if os_id not in IDS:
        raise BuildError(f"--id {os_id}: must be one of {', '.join(IDS)}")
    check_tools()
    ensure_pyinstaller()
    ver, sde = version(), source_date_epoch()
    out.mkdir(parents=True, exist_ok=True)
    fresh_work_dir(work)
    started = time.monotonic()
    bundle = pyinstaller(work, sde)
    check_bundle(bundle)
    bundled = time.monotonic()
    root = work / "root"
    stage(root, bundle, os_id)
    normalise(root)
    image = out / image_name(ver)
    squash(root, image, sde)
    digest = sha512(image)
    (out / f"{image.name}.sha512").write_text(f"{digest}  {image.name}\n")
    size = image.stat().st_size
    print(f"image    {image}\n"
          f"id       ID={os_id} SYSEXT_LEVEL={SYSEXT_LEVEL} ARCHITECTURE={ARCHITECTURE}\n"
          f"size     {size} bytes ({size / 2**20:.1f} MiB; bundle "
          f"{tree_size(bundle) / 2**20:.1f} MiB unpacked)\n"
          f"sha512   {digest}\n"
          f"time     {time.monotonic() - started:.1f} s (PyInstaller "
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
    args = parser.parse_args(argv)
    work = args.work or args.out / f"work-{args.id}"
    try:
        build(args.id, args.out.resolve(), work.resolve())
    except BuildError as e:
        print(f"build_sysext: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
