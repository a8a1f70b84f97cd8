"""The no-op boot: decide "nothing changed since the last successful boot" from cheap reads.

A successful `gpunode boot` writes /run/gpunode/inputs.json: for every file it depends on
(agent config, containerd's config, drop-ins and unit, the driver's /proc files, the device
nodes, the PCI function list, the kernel and boot id) a signature — lstat fields, or the
content for /proc files and listings for directories. A later `gpunode boot` in the same boot
recomputes them; when all are equal it logs one event and exits, without importing the
pipeline (which costs several times Python's own start). /run is empty after a reboot, so the
first boot of every kernel always runs in full.

The CPU node's boot (no_gpu_boot below) is decided here too, before anything else is
imported: sysfs lists no NVIDIA function at all, there is no agent config and no CDI spec to
clean up. Then the boot record says "no-gpu", as the whole pipeline would write it
(gpunode.pipeline.bootrecord), and nothing else happens — every CPU pool of a fleet sharing a GPU
image pays for Python's start and a directory listing, not for gpunode's imports.

This module must stay cheap to import: os, stat, sys, time, gpunode.platform.safeio (os, stat, errno),
gpunode.platform.timestamps (time), gpunode.pipeline.bootrecord and gpunode.platform.nodepaths (nothing); json only
where a stamp is written (with `re`, it costs more than a CPU node's whole boot): a stamp is
read by json's own C scanner (_json_document).
That is why it is the one module that reads the host without gpunode.platform.host.Host: importing Host
(dataclasses, fcntl; pathlib too, then) doubled the start of a no-op boot, ~20 ms to ~40 ms,
measured with `python -X importtime -c "import gpunode.pipeline.fastpath, gpunode.platform.host"` here (and
tests/integration/test_cli_process.py asserts a no-op boot imports no dataclasses). The
boundary holds all the same: every path is mapped by safeio.resolve, which resolves symlinks
inside the root exactly as Host does (tests/unit/test_host.py checks that they agree), and only
stat, lstat, readlink, listdir and safeio.read are done on what it returns.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from gpunode.pipeline import bootrecord
from gpunode.platform import nodepaths, safeio, timestamps

TYPE_CHECKING = False  # typing's import costs as much as this module's whole CPU-node boot
if TYPE_CHECKING:
    from typing import Any

STAMP = "/run/gpunode/inputs.json"
STAMP_VERSION = 2
_CONTENT_PREFIXES = ("/proc/",)
# Its lines carry use counts that change whenever a process opens a GPU; which modules are
# loaded is what a boot depends on.
_NAMES_ONLY = ("/proc/modules",)
_STAMP_LIMIT = 1 << 20  # a stamp is a few KiB
_CONTENT_LIMIT = 1 << 20  # the /proc files signed are a few lines


class _Unreadable(Exception):
    """An input cannot be signed (a FIFO, a loop, a link out of the root): never "unchanged"."""


def signature(root: str, path: str) -> Any:
    """What must stay equal for `path` (a host path, as the steps declare it in gpunode.pipeline.boot):
    a directory named with a trailing "/" by its listing, a /proc file by its content
    (/proc/modules by the module names), anything else by its stat fields.

    Paths resolve inside the root (gpunode.platform.safeio.resolve), never on the machine gpunode runs
    on. A symlink is signed by its own lstat and target text *and* by what it points at, so an
    edit of the target (e.g. /etc/containerd/config.toml → a file elsewhere) is a change, and
    a link to nothing (a mask to /dev/null in a tree without it) is not the same as no link.
    """
    try:
        if path.endswith("/"):
            return sorted(os.listdir(safeio.resolve(root, path.rstrip("/"))))
        if path.startswith(_CONTENT_PREFIXES):
            text = safeio.read(safeio.resolve(root, path), _CONTENT_LIMIT).decode(
                "utf-8", errors="replace")
            if path in _NAMES_ONLY:
                return sorted(line.split(" ", 1)[0] for line in text.splitlines() if line)
            return text
        entry = safeio.resolve(root, path, follow=False)
        st = os.lstat(entry)
        fields = [st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_rdev]
        if stat.S_ISLNK(st.st_mode):
            fields.append(os.readlink(entry))
            try:
                target = os.stat(safeio.resolve(root, path))
            except (FileNotFoundError, NotADirectoryError):
                return [*fields, None]
            fields += [target.st_mode, target.st_ino, target.st_size, target.st_mtime_ns,
                       target.st_rdev]
        return fields
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, safeio.Refused) as exc:
        raise _Unreadable(str(exc)) from None


def compute(root: str, paths: list[str], version: str, config: str | None) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    for path in sorted(set(paths)):
        try:
            inputs[path] = signature(root, path)
        except _Unreadable as exc:
            inputs[path] = {"unreadable": str(exc)}  # never equal: unchanged() re-signs first
    return {"stamp_version": STAMP_VERSION, "gpunode": version, "config": config,
            "inputs": inputs}


def unchanged(root: str, version: str, config: str | None) -> bool:
    """True when the last successful boot's inputs are all as they were. A stamp that cannot
    be read or understood (not a file, not UTF-8 JSON, wrong types) is simply not "unchanged":
    the full boot runs and writes a new one."""
    try:
        text = safeio.decode(safeio.read(safeio.resolve(root, STAMP), _STAMP_LIMIT))
        stamp = _json_document(text)
    except (OSError, safeio.Refused, ValueError, RecursionError):
        return False
    if not isinstance(stamp, dict) or stamp.get("stamp_version") != STAMP_VERSION:
        return False
    if stamp.get("gpunode") != version or stamp.get("config") != config:
        return False
    inputs = stamp.get("inputs")
    if not isinstance(inputs, dict) or not inputs:
        return False
    # json turns the stat tuples into lists; signature() returns lists for the same reason
    for path, value in inputs.items():
        if not path.startswith("/") or isinstance(value, dict):
            return False
        try:
            if signature(root, path) != value:
                return False
        except _Unreadable:
            return False
    return True


class _JsonDefaults:
    """What json's default decoder hands its C scanner (json.decoder.JSONDecoder.__init__)."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name: str) -> None:
        raise ValueError(f"{name} is not in a stamp")


def _json_document(text: str) -> Any:
    """json.loads(text), without importing json: its decoder imports re and enum, ~5 ms of a
    no-op boot that is ~10 ms over Python's start. The C scanner json.loads itself runs
    (_json.make_scanner, set up as json's default decoder sets it up) parses the document;
    ValueError where json.loads would raise one (or the document has leading blanks, which a
    stamp gpunode wrote never has)."""
    try:
        import _json
    except ImportError:  # a Python built without the accelerator
        import json

        return json.loads(text)
    try:
        value, end = _json.make_scanner(_JsonDefaults())(text, 0)
    except (StopIteration, TypeError) as exc:  # StopIteration: no document at that index
        raise ValueError(f"not a JSON document ({exc})") from None
    if text[end:].strip():
        raise ValueError("extra data after the JSON document")
    return value


PLAIN = (("boot",), ("status",), ("status", "--json"))  # what clirun.plain runs itself


def plain_args(argv: list[str]) -> tuple[tuple[str, ...], str, str | None, str | None] | None:
    """(command words, root, config, log format) when argv is one of PLAIN after the global
    options, else None (use the full CLI): as given, for the command to resolve as the full
    CLI does (clirun.host_for)."""
    root, config, log_format = "/", None, None
    rest = list(argv)
    while rest and rest[0].startswith("--"):
        option = rest.pop(0)
        name, eq, value = option.partition("=")
        if name not in ("--root", "--config", "--log-format"):
            return None
        if not eq:
            if not rest:
                return None
            value = rest.pop(0)
        if name == "--root":
            if not value:
                return None  # the CLI refuses an empty --root
            root = value
        elif name == "--config":
            config = value
        else:
            log_format = value
    words = tuple(rest)
    if words not in PLAIN:
        return None
    return words, root, config, log_format


def command_word(argv: list[str]) -> str | None:
    """The command argv names (its first word after the global options), or None."""
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if word in ("--root", "--config", "--log-format"):
            rest[:1] = []  # the option's value
        elif not word.startswith("-"):
            return word
    return None


def report_unchanged(log_format: str | None) -> None:
    """The one event a no-op boot logs (the console format stays readable by hand)."""
    stamp = timestamps.utc_timestamp()
    if log_format == "console" or (log_format is None and sys.stderr.isatty()):
        sys.stderr.write(f"{stamp} [info     ] boot.unchanged  nothing changed since the last "
                         "successful boot\n")
    else:  # json.dumps's bytes, without its import (the time stamp is digits, T, - and :)
        sys.stderr.write('{"event":"boot.unchanged","outcome":"ok","level":"info",'
                         f'"timestamp":"{stamp}"}}\n')


def pci_vendors(root: str) -> list[str] | None:
    """The vendor ID of every PCI function sysfs lists (lower case, without 0x); None where the
    listing or a function's vendor cannot be read, or is not an ID."""
    try:
        devices = safeio.resolve(root, nodepaths.SYSFS_PCI_DEVICES)
        vendors = []
        for name in os.listdir(devices):
            vendor = safeio.read(f"{devices}/{name}/vendor", 64).decode("ascii").strip()
            if not vendor.startswith("0x"):
                return None
            vendors.append(vendor[2:].lower())
    except (OSError, UnicodeDecodeError, safeio.Refused):
        return None
    return vendors


def nvidia_listed(vendors: list[str] | None) -> bool:
    return vendors is not None and nodepaths.NVIDIA_VENDOR_ID in vendors


def no_gpu_boot(root: str, log_format: str | None, vendors: list[str] | None) -> bool:
    """The CPU node's boot, when it can be decided from sysfs alone (`vendors`, pci_vendors'
    reading of it): True once its record is written and its events logged. False — the whole
    pipeline decides and reports — as soon as anything is not plain: an NVIDIA function (of
    any class), a function whose vendor cannot be read, no PCI listing, an agent config (it may
    ask for anything; the pipeline checks it), a CDI spec (gpunode's is removed on a node
    without GPU), or a record that cannot be replaced safely."""
    started = timestamps.utc_timestamp()
    start = _clock()
    if vendors is None or nvidia_listed(vendors):
        return False
    try:
        for path in (nodepaths.DEFAULT_CONFIG_PATH, nodepaths.CDI_SPEC_PATH):
            if os.path.lexists(safeio.resolve(root, path, follow=False)):
                return False
    except (OSError, safeio.Refused):
        return False
    duration = round(_clock() - start, 2)
    record = bootrecord.no_gpu(started, timestamps.utc_timestamp(), duration)
    if not _write_new(root, bootrecord.STATE_PATH, record):
        return False
    for line in no_gpu_events(duration, log_format, timestamps.utc_timestamp()):
        sys.stderr.write(line)
    return True


def _clock() -> float:
    return time.perf_counter() * 1000


def _write_new(root: str, path: str, data: bytes) -> bool:
    """`data` at `path` under `root`, all at once (a temporary file beside it, fsynced, renamed
    over it); False, with nothing changed, where the place is not plain: a parent that is not a
    directory, a target that is not one regular file (Host.write_atomic's refusals, reported
    by the whole pipeline instead)."""
    directory, _, name = path.rpartition("/")
    try:
        real = safeio.resolve(root, directory)
        os.makedirs(real, mode=0o755, exist_ok=True)
        try:
            st = os.lstat(f"{real}/{name}")
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                return False
        except FileNotFoundError:
            pass
        temp = f"{real}/.{name}.{os.getpid()}{nodepaths.TEMP_SUFFIX}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except (OSError, safeio.Refused):
        return False
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.rename(temp, f"{real}/{name}")
    except OSError:
        _unlink_quietly(temp)
        return False
    return True


def _unlink_quietly(path: str) -> None:
    """contextlib.suppress would import contextlib (~4 ms): more than this whole path."""
    try:
        os.unlink(path)
    except OSError:
        return


def no_gpu_events(duration_ms: float, log_format: str | None, stamp: str) -> list[str]:
    """The two lines a CPU node's boot logs, as gpunode/log.py renders the pipeline's (JSON, or
    the console line where stderr is a terminal), without the json module."""
    if log_format == "console" or (log_format is None and sys.stderr.isatty()):
        return [f"{stamp} [info     ] step.done       step=detect duration_ms={duration_ms!r} "
                "gpus=0 functions=0 changed=False\n",
                f"{stamp} [info     ] boot.done       outcome=no-gpu steps=['detect']\n"]
    return ['{"event":"step.done","step":"detect","duration_ms":' + repr(float(duration_ms))
            + ',"gpus":0,"functions":0,"changed":false,"level":"info","timestamp":"'
            + stamp + '"}\n',
            '{"event":"boot.done","outcome":"no-gpu","steps":["detect"],"level":"info",'
            '"timestamp":"' + stamp + '"}\n']
