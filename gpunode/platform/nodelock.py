"""The node lock: one gpunode command at a time changes a node.

`boot`, `driver load`, `driver build`, `containerd configure` (not `--dry-run`) and
`containerd revert` each read the node, decide and write; two at once would each decide from
the other's half-done state (and race on the same device nodes and config files). Each takes
an exclusive flock(2) on /run/gpunode/lock under the root (created 0600; /run is emptied at
every boot, and a lock held by a process dies with it, so a crash never leaves the node
locked). Read-only commands (status, detect, plan, driver status) take no lock and never wait.

Taking the lock is also the one moment that proves no other gpunode command is writing: the
holder first sweeps the stale temp files a kill inside an atomic write leaves
(`.<name>.<random>.gpunode-tmp`, host.Host's pattern) from every directory gpunode writes.

`probe()` tells `gpunode status` whether a command holds the lock right now, without waiting
and without creating the file.

A command waits a bounded time, then fails naming the process that holds the lock (its pid
and command are written into the file). `boot` waits longest: two boots (the unit at startup
and an operator's, or a retry) should run one after the other, and a boot that loads a driver
or restarts containerd takes tens of seconds, so it waits up to 5 minutes — well inside
gpunode.service's 30-minute timeout. The other commands are run by hand and wait 10 seconds:
a person should hear soon that something else is at work.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator

from gpunode import log
from gpunode.cdi.spec import SPEC_PATH as CDI_SPEC
from gpunode.containerd import journal
from gpunode.containerd.journal import JOURNAL
from gpunode.containerd.ledger import (
    BACKUP_SUFFIX,
    DROPIN,
    ENV_FILE,
    IMPORT_FILE,
    LEDGER,
    MEMLOCK_DROPIN,
    TOOLKIT_CONFIG,
    WRITABLE_CONFIG,
)
from gpunode.errors import GpunodeError, HostError, LockBusy, LockTimeout
from gpunode.platform import flatcar
from gpunode.platform.host import Host
from gpunode.platform.integers import parse_uint
from gpunode.platform.nodepaths import KUBELET_DROPIN, TEMP_SUFFIX

LOCK_PATH = "/run/gpunode/lock"
BOOT_WAIT_SECONDS = 300.0
WAIT_SECONDS = 10.0


@contextlib.contextmanager
def held(host: Host, command: str, wait: float) -> Iterator[None]:
    """Hold the node lock for the block; wait up to `wait` seconds for it."""
    shown = host.display(LOCK_PATH)

    def waiting(note: str) -> None:
        log.get().info("lock.waiting", lock=shown, holder=_holder(note), command=command,
                       wait_s=wait)

    with contextlib.ExitStack() as stack:
        try:
            lock = stack.enter_context(host.lock(LOCK_PATH, wait, waiting, mode=0o600))
        except LockTimeout as exc:
            raise LockBusy(f"another gpunode command ({_holder(exc.note)}) is changing this "
                           f"node and holds {shown}; gave up after waiting {wait:g} s",
                           "wait for it to finish and run this again; 'ps' shows what the "
                           "holder is doing") from None
        lock.write(f"{os.getpid()} {command}\n")
        sweep_stale_temps(host)  # holding the lock: no other gpunode writer is at work
        yield


def _holder(note: str) -> str:
    """'pid 1234, gpunode boot' from the lock file's note, as far as it can be read."""
    text = note.split()
    if not text or parse_uint(text[0]) is None:
        return "pid unknown"
    return f"pid {text[0]}" + (f", gpunode {' '.join(text[1:])}" if len(text) > 1 else "")


# Every directory gpunode writes a file, device node or link into (host.write_atomic,
# make_char_device, symlink), with the names it writes there (a pattern), besides the
# containerd config's own directory (from the ledger). Another program's temp file that happens
# to end in .gpunode-tmp is never gpunode's to remove.
def _file(path: str, suffix: str = "") -> tuple[str, str]:
    """(its directory, a pattern for its name) of one file gpunode writes."""
    directory, _, name = path.rpartition("/")
    return directory, re.escape(name) + (f"(?:{re.escape(suffix)})?" if suffix else "")


WRITTEN = (
    ("/dev", r"nvidia[\w-]*"),  # device nodes (driver.devices)
    ("/dev/nvidia-caps", r"nvidia-cap\d+"),
    ("/dev/char", r"\d+:\d+"),  # their /dev/char links
    ("/run/gpunode", r"[\w.-]+"),  # gpunode's own: the boot record, the watch's state
    _file(JOURNAL), _file(LEDGER), _file(WRITABLE_CONFIG, BACKUP_SUFFIX), _file(IMPORT_FILE),
    _file(DROPIN), _file(ENV_FILE), _file(KUBELET_DROPIN), _file(flatcar.ENABLED_SYSEXT),
    _file(CDI_SPEC), _file(MEMLOCK_DROPIN), _file(TOOLKIT_CONFIG),
    # gpunode image bake (gpunode/bake/image.py): its artifacts' stages
    # (".<file>.bake.gpunode-tmp", and write_atomic's temporaries of them), links and files
    ("/opt/extensions/gpunode", r"[\w.+-]+"), ("/etc/flatcar/sysext", r"\.?flatcar-[\w.+-]+"),
    ("/etc/extensions", r"gpunode\.raw|flatcar-[\w.+-]+"), ("/etc/gpunode", r"baked\.json"),
)


def sweep_stale_temps(host: Host) -> list[str]:
    """Remove gpunode's own temp files left by a kill; those removed. Only host.Host's temp
    names (".<name>.<random>.gpunode-tmp") for a name gpunode writes, directly in a directory
    gpunode writes (a symlinked directory is skipped), never a directory, never through a
    symlink (a temp that is itself a link is unlinked)."""
    removed = []
    for directory, names in (*WRITTEN, *_config_dirs(host)):
        try:
            st = host.lstat(directory)
            entries = host.list_dir(directory) if st and stat.S_ISDIR(st.st_mode) else []
        except HostError:
            continue  # not ours to read: nothing of ours can be in it
        entries = [e for e in entries if e.startswith(".") and e.endswith(TEMP_SUFFIX)]
        if not entries:
            continue  # the usual case
        temp = re.compile(rf"\.(?:{names})\.[A-Za-z0-9_]+{re.escape(TEMP_SUFFIX)}")
        for entry in entries:
            path = f"{directory.rstrip('/')}/{entry}"
            found = temp.fullmatch(entry) and host.lstat(path)
            if found and not stat.S_ISDIR(found.st_mode):
                try:
                    host.remove(path)
                except HostError as exc:
                    log.get().warning("lock.stale_temp_kept", path=host.display(path), exc=exc)
                    continue
                removed.append(path)
    try:
        removed += journal.sweep_stage(host)  # a directory: the one gpunode stages /var/lib in
    except HostError as exc:
        log.get().warning("lock.stale_temp_kept", path=exc.path, exc=exc)
    if removed:
        log.get().info("lock.stale_temps_removed", removed=[host.display(p) for p in removed],
                       note="left by an earlier gpunode run that was killed while writing")
    return removed


def _config_dirs(host: Host) -> list[tuple[str, str]]:
    """The directory of the containerd config gpunode edits, as its ledger says, and the
    names it writes there (the config and its backup)."""
    from gpunode.containerd import ledger

    try:
        recorded = ledger.read(host)
    except GpunodeError:
        return []  # a damaged ledger is reported by the command that needs it
    if recorded is None:
        return []
    directory, _, name = recorded.target.rpartition("/")
    return [(directory or "/", re.escape(name) + r"(\.gpunode-orig)?")]


def probe(host: Host) -> str | None:
    """'pid 1234, gpunode boot' when a gpunode command holds the node lock right now, else
    None. Never waits, never creates the lock file, never follows a symlink."""
    try:
        note = host.lock_holder(LOCK_PATH)
    except HostError:
        return None  # a lock file gpunode could not use: nobody holds it either
    return None if note is None else _holder(note)
