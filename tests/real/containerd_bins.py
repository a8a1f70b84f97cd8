"""Real containerd binaries (1.6, 1.7, 2.x) for tests that must see what the daemon sees.

Why real binaries: how containerd merges a config with its `imports` differs between versions
(containerd#5837: on 1.x an imported plugin table replaces the main file's table wholesale; 2.x
merges), and only `containerd --config FILE config dump` tells what a given version really makes
of a file. Reimplementing that in Python would test our assumptions, not containerd.

Where they come from: the Debian archive, one suite per version (bookworm → 1.6, trixie → 1.7,
sid → 2.x), fetched with `apt-get download` against a private apt state (own sources list, lists,
cache and dpkg status) so that the machine's apt configuration is never touched, then unpacked
with `dpkg -x`. The mirror is the one the machine's own apt sources use; no host name is written
here. Only the `containerd` binary is kept, under

    $GPUNODE_TEST_CACHE/containerd/<version>/bin/containerd   (default /var/cache/gpunode-tests)

An flock on `<version>/.lock` makes concurrent pytest processes fetch once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from real import cache

VERSIONS = ("1.6", "1.7", "2")

# Debian suite whose `containerd` package has that version; "2" accepts any 2.x (sid moves on).
SUITES = {"1.6": "bookworm", "1.7": "trixie", "2": "sid"}
PACKAGE = "containerd"

# A 1.6 installed on the machine (Debian bookworm's package) is used instead of a fetched one.
SYSTEM_BINARY = Path("/usr/bin/containerd")
PREFER_SYSTEM = ("1.6",)

DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")

# Overrides the mirror taken from the machine's apt sources, e.g. "http://mirror.example/debian".
MIRROR_ENV = "GPUNODE_DEBIAN_MIRROR"

FETCH_TIMEOUT_S = 900
RUN_TIMEOUT_S = 60


class ContainerdError(RuntimeError):
    """A command failed; carries the command line, exit code and stderr so a test says why."""

    def __init__(self, what: str, cmd: Sequence[str | os.PathLike[str]], code: int, stderr: str):
        self.cmd = [str(part) for part in cmd]
        self.returncode = code
        self.stderr = stderr
        super().__init__(
            f"{what}\n  command: {' '.join(self.cmd)}\n  exit code: {code}\n"
            f"  stderr:\n{textwrap.indent(stderr.strip() or '(empty)', '    ')}"
        )


@dataclass(frozen=True)
class Binary:
    """A verified containerd binary and the exact line its `--version` printed."""

    path: Path
    version_line: str


def cache_dir(version: str) -> Path:
    """Where one version lives; GPUNODE_TEST_CACHE moves the whole test cache (CI may cache it)."""
    return cache.root() / "containerd" / version


def ensure_containerd(version: str) -> Path:
    """Path of a working containerd `version` ("1.6", "1.7" or "2" for any 2.x); fetched once."""
    return ensure_binary(version).path


def ensure_binary(version: str) -> Binary:
    """Like ensure_containerd, with the `--version` line (for reports and the golden files)."""
    if version not in SUITES:
        raise ValueError(f"unknown containerd version {version!r}; expected one of {VERSIONS}")
    if version in PREFER_SYSTEM and SYSTEM_BINARY.exists():
        line = version_line(SYSTEM_BINARY)
        if _matches(line, version):
            return Binary(SYSTEM_BINARY, line)

    directory = cache_dir(version)
    binary = directory / "bin" / "containerd"
    with cache.locked(directory):
        if not binary.exists():
            _fetch(version, directory)
        line = version_line(binary)
    if not _matches(line, version):
        raise ContainerdError(
            f"{binary} is not containerd {version}.x (remove {directory} to refetch)",
            [binary, "--version"],
            0,
            line,
        )
    return Binary(binary, line)


def version_line(binary: Path) -> str:
    """The first line of `containerd --version`, e.g. 'containerd github.com/… 1.6.20~ds1 …'."""
    return _run([binary, "--version"], f"{binary} --version failed").strip().splitlines()[0]


def dump_config(binary: Path, config: Path) -> str:
    """`containerd --config CONFIG config dump`: the config after imports and plugin defaults.

    This is the daemon's own load path (version migration, imports, per-plugin decoding) without
    starting anything: it creates no directories and opens no sockets, so any root/state is fine.
    Warnings (e.g. unknown keys that the daemon would ignore) go to stderr and are not returned.
    """
    return _run([binary, "--config", config, "config", "dump"], "containerd config dump failed")


def default_config(binary: Path) -> str:
    """`containerd config default`: the built-in defaults, what a node gets with no config file."""
    return _run([binary, "config", "default"], "containerd config default failed")


def _matches(line: str, version: str) -> bool:
    """Whether a `--version` line names `version`.x ("2" accepts any 2.x)."""
    # "containerd github.com/containerd/containerd[/v2] 1.6.20~ds1 1.6.20~ds1-1+deb12u3"
    fields = line.split()
    return len(fields) >= 3 and fields[2].lstrip("v").startswith(version + ".")


def _fetch(version: str, directory: Path) -> None:
    """Download the suite's containerd .deb with a private apt state and keep its binary."""
    suite = SUITES[version]
    cache.remove_leftovers(directory, "fetch-*")  # left by a killed fetch; we hold the lock
    with tempfile.TemporaryDirectory(dir=directory, prefix="fetch-") as tmp_name:
        tmp = Path(tmp_name)
        apt = _private_apt(tmp, suite)
        try:
            _run(
                [*apt, "update", "-o", "APT::Update::Error-Mode=any"],
                f"apt-get update for Debian {suite} failed (network or mirror down?)",
                timeout=FETCH_TIMEOUT_S,
            )
            _run(
                [*apt, "download", PACKAGE],
                f"apt-get download {PACKAGE} from Debian {suite} failed",
                cwd=tmp,
                timeout=FETCH_TIMEOUT_S,
            )
        except FileNotFoundError as err:
            raise RuntimeError(f"fetching containerd needs apt-get and dpkg: {err}") from err
        debs = sorted(tmp.glob(f"{PACKAGE}_*.deb"))
        if len(debs) != 1:
            raise RuntimeError(f"expected one {PACKAGE} .deb in {tmp}, found {debs}")
        _run(["dpkg", "-x", debs[0], tmp / "root"], f"dpkg -x {debs[0].name} failed")
        extracted = tmp / "root" / "usr" / "bin" / "containerd"
        (directory / "bin").mkdir(exist_ok=True)
        (directory / "PACKAGE").write_text(debs[0].name + "\n")
        # Rename last: a binary in place means a complete fetch, whoever looks next.
        shutil.move(extracted, tmp / "containerd")
        (tmp / "containerd").replace(directory / "bin" / "containerd")


def _private_apt(tmp: Path, suite: str, components: str = "main") -> list[str]:
    """An apt-get command line whose sources, lists, cache, status and pins are all under tmp;
    its one source is the suite's `components` (NVIDIA's driver is in contrib, non-free and
    non-free-firmware).

    The machine's apt.conf.d still applies (proxies, Check-Valid-Until and the like), but no
    file of the machine's apt state is read for packages or written: no lock is taken either,
    since nothing shared is modified (our own flock serialises fetches).
    """
    mirror = os.environ.get(MIRROR_ENV) or _system_mirror()
    signed_by = f"[signed-by={DEBIAN_KEYRING}] " if DEBIAN_KEYRING.exists() else ""
    (tmp / "sources.list").write_text(f"deb {signed_by}{mirror} {suite} {components}\n")
    (tmp / "lists" / "partial").mkdir(parents=True)
    (tmp / "cache" / "archives" / "partial").mkdir(parents=True)
    (tmp / "status").touch()
    options = {
        "Dir::Etc::SourceList": tmp / "sources.list",
        "Dir::Etc::SourceParts": "/dev/null",
        "Dir::Etc::Preferences": "/dev/null",
        "Dir::Etc::PreferencesParts": "/dev/null",
        "Dir::State::Lists": tmp / "lists",
        "Dir::State::status": tmp / "status",
        "Dir::Cache": tmp / "cache",
        "Debug::NoLocking": "1",
        "APT::Sandbox::User": "root",  # tmp is private to root; _apt could not write there
        "Acquire::Languages": "none",
    }
    command = ["apt-get", "-q"]
    for key, value in options.items():
        command += ["-o", f"{key}={value}"]
    return command


def _system_mirror() -> str:
    """The Debian mirror URI the machine's apt sources use for its own release's main suite."""
    codename = _os_release().get("VERSION_CODENAME", "")
    listing = _run(
        ["apt-get", "indextargets", "--no-release-info", "--format", "$(SITE) $(RELEASE)"],
        "apt-get indextargets failed",
    )
    sites = [line.split()[0] for line in listing.splitlines() if line.split()[1:] == [codename]]
    if not sites:
        raise RuntimeError(
            f"no apt source for Debian {codename!r} on this machine to take the mirror from; "
            f"set {MIRROR_ENV} to a Debian mirror URI"
        )
    return sites[0]


def _os_release() -> dict[str, str]:
    """Key/values of /etc/os-release (the machine's Debian codename picks the apt source)."""
    pairs = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            pairs[key] = value.strip().strip('"')
    return pairs


def _run(
    cmd: Sequence[str | os.PathLike[str]],
    what: str,
    *,
    cwd: Path | None = None,
    timeout: float = RUN_TIMEOUT_S,
) -> str:
    """Run cmd and return stdout; on failure raise ContainerdError with command, code, stderr."""
    argv = [str(part) for part in cmd]
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        stderr = result.stderr or result.stdout
        raise ContainerdError(what, argv, result.returncode, stderr)
    return result.stdout
