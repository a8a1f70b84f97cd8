"""Recoverable multi-file writes: a change to several files either happens whole or not at all.

`containerd configure` and `revert` change up to six files (the config or its /etc copy, the
`.gpunode-orig` backup, the imported drop-in file, the containerd.service.d drop-in, the ledger)
and the directories holding them. Each file is replaced atomically (host.write_atomic), but a
SIGKILL or power cut *between* two files would leave a mix that no later run understands. So a
change is one transaction, an undo journal:

1. Before the first change, the journal (`JOURNAL`, written atomically and fsynced, 0600: it
   holds config contents) records every file's content, mode and owner as it is now (absent
   included), the sha256 of what it will become, the directories the change will create, and
   those it may remove.
2. The directories are made and the files written (or removed), in order, each atomically;
   emptied directories are removed.
3. The journal is removed (and its directory fsynced): that is the commit.

On a tree without /var/lib (an image root), the journal's directory is made and removed with
the journal in it, each in one rename through a temporary name (`.var.journal.gpunode-tmp`,
swept with the node lock held): a kill on either side of the journal never leaves a /var/lib
that no record says gpunode made.

Every later configure, revert and boot first calls `recover()`: with a journal present, the
interrupted change is rolled back (each file put back as the journal has it, created
directories removed when empty, removed ones made again), then the journal is removed. Rolling
*back* returns the node to the state the interrupted command started from, a state gpunode had
already checked, and the command then runs in full, restart decision included. A file that is
neither as the journal recorded it nor as the change would have made it was changed by someone
else since: nothing is rolled back and the error says which file (never a silent overwrite).
Rollback writes are themselves idempotent, so an interrupted recovery is finished by the next.

A journal may only name the files and directories gpunode owns for the config it edits
(ledger.owned_paths, the ledger's own rule) and only a config gpunode edits here: a damaged
journal naming /etc/passwd is refused, nothing written. The stale temp files a kill inside an
atomic write leaves (`.<name>.*.gpunode-tmp`) are swept when the node lock is taken
(gpunode.platform.nodelock), for every directory gpunode writes.

The journal lives directly in /var/lib (always there, persistent), not in /var/lib/gpunode,
so that a revert can remove gpunode's own directory inside the same transaction.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpunode.errors import ContainerdStepError, GpunodeError, JournalError
from gpunode.platform import records
from gpunode.platform.host import Host
from gpunode.platform.nodepaths import TEMP_SUFFIX

JOURNAL = "/var/lib/gpunode.containerd-journal"
SCHEMA = 1

Attrs = tuple[int, int, int]  # mode, uid, gid


@dataclass(frozen=True)
class Write:
    """One file of a transaction: its new content, or None to remove it.

    `attrs` gives the file exactly that mode and owner (a backup or copy keeps its source's);
    without it an existing file keeps its own and a new one gets `mode`."""

    path: str
    data: bytes | None
    attrs: Attrs | None = None
    mode: int = 0o644


def sha256(data: bytes | None) -> str | None:
    """The hex SHA-256 of `data` (the ledger's and the journal's digests)."""
    import hashlib  # OpenSSL's: only a change that is written is digested

    return None if data is None else hashlib.sha256(data).hexdigest()


def attrs_of(host: Host, path: str) -> Attrs | None:
    st = host.stat(path)
    return None if st is None else (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)


def missing_dirs(host: Host, paths: Iterable[str]) -> list[str]:
    """The directories that writing `paths` would create, parents first."""
    missing: list[str] = []
    for path in paths:
        directory = path.rpartition("/")[0]
        chain: list[str] = []
        while directory and directory not in missing and not host.exists(directory):
            chain.append(directory)
            directory = directory.rpartition("/")[0]
        missing += reversed(chain)
    return missing


@dataclass(frozen=True)
class Committed:
    """What a committed transaction did, for a caller that must put everything back later
    (containerd refused the new config): `commit(host, c.undo, c.target, c.created)`."""

    undo: list[Write]  # the previous content, mode and owner of each file
    target: str
    created: list[str]  # the directories it created, parents first


def commit(host: Host, writes: Sequence[Write], target: str,
           remove_dirs: Sequence[str] = ()) -> Committed:
    """Apply `writes` (then remove each of `remove_dirs` that is empty) as one transaction.

    `target` is the containerd config the change edits: every path written or removed must be
    one gpunode owns for it (ledger.owned_paths), the rule `recover()` holds a journal to."""
    problem = _foreign(target, [w.path for w in writes], (), remove_dirs, [target])
    if problem:
        raise ContainerdStepError(f"gpunode refuses to write {problem}",
                                  "this is a bug in gpunode: report it")
    if host.exists(JOURNAL):
        raise JournalError(f"{host.display(JOURNAL)}: an interrupted change is still pending",
                           "run 'gpunode containerd revert' or 'configure' again: they roll "
                           "it back first")
    undo = [Write(w.path, host.read_optional_bytes(w.path), attrs_of(host, w.path))
            for w in writes]
    created = missing_dirs(host, [JOURNAL, *(w.path for w in writes if w.data is not None)])
    record = {
        "schema_version": SCHEMA,
        "target": target,
        "files": [{"path": u.path, "before": _b64(u.data),
                   "attrs": list(u.attrs) if u.attrs else None,
                   "after_sha256": sha256(w.data)} for u, w in zip(undo, writes, strict=True)],
        "created_dirs": created,
        "removed_dirs": [d for d in remove_dirs if host.exists(d)],
    }
    _write_journal(host, json.dumps(record).encode(), created)
    try:
        for directory in created:
            host.make_dirs(directory)
        for write in writes:
            _apply(host, write)
        for directory in sorted(record["removed_dirs"], key=len, reverse=True):
            host.remove_dir(directory)
    except GpunodeError as failure:
        # Failed here and now (disk full, read-only file system): put everything back at once.
        try:
            recover(host, [target])
        except GpunodeError as second:
            raise ContainerdStepError(
                f"{failure}; putting the files back failed too ({second})",
                "the next 'gpunode containerd configure' or 'revert' rolls the change back "
                "once the cause is fixed") from failure
        raise
    # The journal's own directory, on a tree that had none: made for this change (`created`),
    # or one the change removes (a revert of the change that made /var/lib) that the journal
    # itself kept from being removed while it was there.
    own = [d for d in record["removed_dirs"] if JOURNAL.startswith(d.rstrip("/") + "/")]
    _drop_journal(host, [*created, *own])
    _remove_empty(host, [*created, *own])
    return Committed(undo, target, [d for d in created if host.exists(d)])


def _write_journal(host: Host, data: bytes, created: Sequence[str]) -> None:
    """Write the journal; on a tree without its directory (/var/lib, a fresh image root), in
    that directory made under a temporary name and renamed into place with the journal in
    it: a kill in between leaves only the temporary name (sweep_stage), never a /var/lib that
    no record says gpunode made (the next run would take it for the tree's own)."""
    attrs = (0o600, os.getuid(), os.getgid())
    outer = next((d for d in created if JOURNAL.startswith(d.rstrip("/") + "/")), None)
    if outer is None:
        host.write_atomic(JOURNAL, data, attrs=attrs)
        return
    stage = _stage_of(outer)
    host.remove_tree(stage)
    inside = stage + JOURNAL[len(outer):]
    host.make_dirs(inside.rpartition("/")[0])
    host.write_atomic(inside, data, attrs=attrs)
    host.rename(stage, outer)


def _drop_journal(host: Host, directories: Sequence[str]) -> list[str]:
    """Remove the journal — the commit — and with it, in the same rename, the outermost of
    `directories` (made for the change) that holds nothing else: a kill right after cannot
    leave a /var/lib that no record names. The directories removed with it."""
    chain = sorted((d for d in directories if JOURNAL.startswith(d.rstrip("/") + "/")),
                   key=len)
    outer = next((d for d in chain if _holds_only_journal(host, d)), None)
    if outer is None:
        host.remove(JOURNAL)
        return []
    stage = _stage_of(outer)
    host.remove_tree(stage)
    host.rename(outer, stage)
    host.remove_tree(stage)
    return [d for d in reversed(chain) if len(d) >= len(outer)]


def _holds_only_journal(host: Host, directory: str) -> bool:
    path = directory.rstrip("/")
    for name in JOURNAL[len(path) + 1:].split("/"):
        if host.list_dir(path) != [name]:
            return False
        path = f"{path}/{name}"
    st = host.lstat(path)
    return st is not None and stat.S_ISREG(st.st_mode)


def _stage_of(directory: str) -> str:
    parent, _, name = directory.rpartition("/")
    return f"{parent}/.{name}.journal{TEMP_SUFFIX}"


def sweep_stage(host: Host) -> list[str]:
    """Remove what a kill inside _write_journal left (a temporary directory); those removed.
    Called with the node lock held (gpunode.platform.nodelock), before any change."""
    removed = []
    directory = JOURNAL.rpartition("/")[0]
    while directory not in ("", "/"):
        stage = _stage_of(directory)
        st = host.lstat(stage)
        if st is not None and stat.S_ISDIR(st.st_mode):
            host.remove_tree(stage)
            removed.append(stage)
        directory = directory.rpartition("/")[0]
    return removed


def _remove_empty(host: Host, directories: Sequence[str]) -> list[str]:
    """Remove each of `directories` that is empty, deepest first; those removed."""
    return [d for d in sorted(directories, key=len, reverse=True) if host.remove_dir(d)]


def _apply(host: Host, write: Write) -> None:
    if write.data is None:
        host.remove(write.path)
    else:
        host.write_atomic(write.path, write.data, mode=write.mode, attrs=write.attrs)


def pending(host: Host) -> bool:
    return host.exists(JOURNAL)


def recover(host: Host, targets: Collection[str]) -> list[str]:
    """Roll back an interrupted transaction; what was undone.

    `targets` are the containerd configs gpunode may be editing here (the ledger's, the one
    containerd reads, --config): a journal whose change edits another file, or names a file
    or directory gpunode does not own for its target, is damaged and refused, nothing written."""
    record = _read(host)
    if record is None:
        return []
    _, files, befores = _checked(host, record, targets)
    done: list[str] = []
    for directory in record["removed_dirs"]:
        if not host.exists(directory):
            host.make_dirs(directory)
            done.append(f"make {directory} again")
    for write in _rollback_writes(host, files, befores):
        _apply(host, write)
        done.append(f"{'remove' if write.data is None else 'restore'} {write.path}")
    done += [f"remove {d}" for d in _remove_empty(host, record["created_dirs"])]
    done += [f"remove {d}" for d in _drop_journal(host, record["created_dirs"])]
    done += [f"remove {d}" for d in _remove_empty(host, record["created_dirs"])]
    return done


def preview(host: Host, targets: Collection[str]) -> tuple[str | None, list[str]] | None:
    """(the config the change edits, what `recover()` would do), nothing written; None when
    no change is pending. A journal recover would refuse is the same error here."""
    record = _read(host)
    if record is None:
        return None
    target, files, befores = _checked(host, record, targets)
    lines = [f"make {d} again" for d in record["removed_dirs"] if not host.exists(d)]
    lines += [f"{'remove' if w.data is None else 'restore'} {w.path}"
              for w in _rollback_writes(host, files, befores)]
    lines += [f"remove {d} when empty" for d in sorted(record["created_dirs"], key=len,
                                                        reverse=True) if host.exists(d)]
    return target, lines


def _rollback_writes(host: Host, files: list[dict[str, Any]],
                     befores: list[bytes | None]) -> list[Write]:
    """The writes that put each file back as the journal has it, last file first; a file
    already so (content, and mode and owner where it exists) needs none."""
    writes = []
    for entry, before in zip(reversed(files), reversed(befores), strict=True):
        attrs = tuple(entry["attrs"]) if entry["attrs"] else None
        if host.read_optional_bytes(entry["path"]) == before and (
                before is None or attrs_of(host, entry["path"]) == attrs):
            continue
        writes.append(Write(entry["path"], before, attrs))  # type: ignore[arg-type]
    return writes


def _checked(host: Host, record: dict[str, Any], targets: Collection[str],
             ) -> tuple[str | None, list[dict[str, Any]], list[bytes | None]]:
    """The journal's target, files and their previous contents, once it passed the path
    policy and every file is as the journal recorded it or as the change made it."""
    shown = host.display(JOURNAL)
    files: list[dict[str, Any]] = record["files"]
    target = record.get("target")
    if target is not None and not records.absolute(target):
        raise JournalError(f"{shown}: key 'target' must be an absolute path",
                           f"{shown} is damaged: check the files it names by hand, then "
                           "remove it and run gpunode again")
    if target is None:
        target = _inferred_target([f["path"] for f in files])
    problem = _foreign(target, [f["path"] for f in files], record["created_dirs"],
                       record["removed_dirs"], targets)
    if problem:
        raise JournalError(
            f"{shown}: names {problem}; the journal is damaged, and gpunode rolls nothing back",
            f"check that file by hand, then remove {shown} and run gpunode again")
    befores = [_unb64(f["before"], shown) for f in files]
    for entry, before in zip(files, befores, strict=True):
        now = host.read_optional_bytes(entry["path"])
        if now != before and sha256(now) != entry["after_sha256"]:
            raise JournalError(
                f"{shown}: a gpunode change to {host.display(entry['path'])} was interrupted, "
                "and the file has been changed by someone else since; gpunode rolls nothing "
                "back", f"put {host.display(entry['path'])} back as it was (the journal holds "
                "its previous content, base64) or accept the files as they are by removing "
                f"{shown}; then run gpunode again")
    return target, files, befores


def _inferred_target(paths: Sequence[str]) -> str | None:
    """The config a journal without a 'target' key edits: the one file it names that is
    neither a fixed file of gpunode's nor a backup."""
    from gpunode.containerd import ledger

    fixed = ledger.owned_paths("") - {"", ledger.BACKUP_SUFFIX}
    others = {p.removesuffix(ledger.BACKUP_SUFFIX) for p in paths if p not in fixed}
    return others.pop() if len(others) == 1 else None


def _foreign(target: str | None, files: Iterable[str], created_dirs: Iterable[str],
             removed_dirs: Iterable[str], targets: Collection[str]) -> str | None:
    """The first path that is not gpunode's to write for this change, said for a message;
    None when every one is."""
    from gpunode.containerd import ledger

    files = list(files)
    if target is None and not files:  # no file to put back: any config's directories
        owned = frozenset({JOURNAL}).union(*(ledger.owned_paths(t) for t in targets))
    elif target is None or target not in targets:
        known = ", ".join(sorted(targets)) or "none"
        return (f"{target!r} as the containerd config it edits, which is none that gpunode "
                f"edits here ({known})") if target else "no single containerd config it edits"
    else:
        owned = ledger.owned_paths(target) | {JOURNAL}
    for path in files:
        if path not in owned:
            return f"{path!r}, which is not a file gpunode writes for {target}"
    for key, directories in (("created_dirs", created_dirs), ("removed_dirs", removed_dirs)):
        for directory in directories:
            if not ledger.holds_owned(directory, owned):
                return f"{directory!r} in '{key}', which holds no file gpunode writes"
    return None


def _read(host: Host) -> dict[str, Any] | None:
    shown = host.display(JOURNAL)
    hint = (f"{shown} is gpunode's record of an interrupted change; if you know the files are "
            "as they should be, remove it")
    data = host.read_optional_bytes(JOURNAL)
    if data is None:
        return None
    record = records.loads_json(data, shown, lambda message: JournalError(message, hint))
    problem = _problem(record)
    if problem:
        raise JournalError(f"{shown}: {problem}", hint)
    return record  # type: ignore[no-any-return]


def _problem(record: Any) -> str | None:
    """What is wrong with a journal's shape, or None."""
    if not isinstance(record, dict) or not records.is_int(record.get("schema_version")) or \
            record.get("schema_version") != SCHEMA:
        return f"not a gpunode journal (schema_version {SCHEMA})"
    for key in ("created_dirs", "removed_dirs"):
        value = record.get(key)
        if not isinstance(value, list) or not all(records.absolute(v) for v in value):
            return f"key '{key}' must be a list of absolute paths"
    files = record.get("files")
    if not isinstance(files, list):
        return "key 'files' must be a list"
    for i, entry in enumerate(files):
        if not isinstance(entry, dict) or not records.absolute(entry.get("path")):
            return f"key 'files[{i}].path' must be an absolute path"
        if not isinstance(entry.get("before"), str | None):
            return f"key 'files[{i}].before' must be base64 text or null"
        if not isinstance(entry.get("after_sha256"), str | None):
            return f"key 'files[{i}].after_sha256' must be text or null"
        attrs = entry.get("attrs")
        if attrs is not None and not (isinstance(attrs, list) and len(attrs) == 3 and all(
                records.is_int(a) and a >= 0 for a in attrs)):
            return f"key 'files[{i}].attrs' must be [mode, uid, gid] or null"
    return None


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None, shown: str) -> bytes | None:
    if text is None:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise JournalError(f"{shown}: a file's 'before' is not base64 ({exc})",
                           "remove the journal if the files are as they should be") from exc
