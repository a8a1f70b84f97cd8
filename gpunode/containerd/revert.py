"""`gpunode containerd revert`: undo what the ledger says gpunode did to containerd's config,
only where a file or value is still what gpunode wrote, as one journalled transaction; restart
containerd when it runs, and put gpunode's config back if containerd does not come back."""

from __future__ import annotations

from gpunode.containerd import journal, ledger, restart, schema, step, tomltext, undo
from gpunode.containerd.discover import CONTAINERD_UNIT
from gpunode.containerd.journal import Write
from gpunode.containerd.ledger import (
    DROPIN,
    IMPORT_FILE,
    LEDGER,
    MEMLOCK_DROPIN,
    TOOLKIT_CONFIG,
    Ledger,
)
from gpunode.containerd.writes import refuse_hard_links
from gpunode.errors import ContainerdStepError, FileError, GpunodeError
from gpunode.platform import safeio
from gpunode.platform.host import Host
from gpunode.platform.systemd import Systemd
from gpunode.platform.tomlread import loads_toml


def revert(host: Host, systemd: Systemd, restart_timeout: float,
           expected_target: str | None = None) -> step.Outcome:
    step.recover(host, systemd, expected_target)
    recorded = ledger.read(host)
    if recorded is None:
        return step.Outcome(changed=False, restarted=False, target="",
                       descriptions=("nothing to revert: gpunode has not changed containerd's "
                                     "config",))
    target = recorded.target
    if expected_target is not None and expected_target != target:
        raise ContainerdStepError(f"gpunode changed {target}, not {expected_target}",
                                  f"run 'gpunode containerd revert --config {target}'")
    writes, notes = _revert_writes(host, recorded)
    refuse_hard_links(host, [w.path for w in writes if w.data is not None])
    done = journal.commit(host, writes, target, remove_dirs=recorded.created_dirs)
    notes += [f"remove {d} (gpunode created it; now empty)" for d in
              reversed(recorded.created_dirs) if not host.exists(d)]
    dropin_removed = any(w.path in (DROPIN, MEMLOCK_DROPIN) and w.data is None for w in writes)
    if dropin_removed:
        systemd.daemon_reload()
    restarted = False
    if systemd.active_state(CONTAINERD_UNIT) == "active":
        try:
            restart.restart(host, systemd, restart.config_text(host, target, recorded.copied_from),
                     restart_timeout)
        except GpunodeError as failure:
            journal.commit(host, done.undo, done.target, remove_dirs=done.created)
            if dropin_removed:
                systemd.daemon_reload()
            raise ContainerdStepError(f"containerd did not come back after the revert "
                                      f"({failure}); gpunode's config was put back") from failure
        restarted = True
    else:
        restart.note_not_restarted(systemd, target)
    return step.Outcome(changed=True, restarted=restarted, target=target, descriptions=tuple(notes))


def _revert_writes(host: Host, recorded: Ledger) -> tuple[list[Write], list[str]]:
    """The files a revert writes or removes, and what it says about each (kept ones too)."""
    target = recorded.target
    writes: list[Write] = []
    notes: list[str] = []
    changes = tuple(tomltext.Change(c.path, c.before, c.after) for c in recorded.changes)
    if recorded.import_file is not None:
        if _still_ours(host, recorded, IMPORT_FILE):
            writes.append(Write(IMPORT_FILE, None))
            notes.append(f"remove {IMPORT_FILE}")
        elif host.exists(IMPORT_FILE):
            changes = tuple(c for c in changes if c.path != ("imports",))
            notes.append(f"keep {IMPORT_FILE} and the import of it: it was changed since "
                         "gpunode wrote it")
    current = host.read_optional_bytes(target, limit=schema.MAX_CONFIG_BYTES)
    if current is None:
        notes.append(f"{target} is gone: nothing to undo in it")
        result = None
    else:
        result = _reverted_target(host, recorded, current, changes, notes)
    if recorded.copied_from is not None:
        _revert_copy(host, recorded, current, result, writes, notes)
    else:
        if result is not None and result != current:
            writes.append(Write(target, result))
        _settle_backup(host, recorded, result, writes, notes)
        if recorded.dropin is not None and _still_ours(host, recorded, recorded.dropin):
            writes.append(Write(recorded.dropin, None))
            notes.append(f"remove {recorded.dropin}")
    if MEMLOCK_DROPIN in recorded.written and _still_ours(host, recorded, MEMLOCK_DROPIN):
        writes.append(Write(MEMLOCK_DROPIN, None))
        notes.append(f"remove {MEMLOCK_DROPIN}")
    if TOOLKIT_CONFIG in recorded.written and host.exists(TOOLKIT_CONFIG):
        notes.append(f"keep the mode gpunode set in {TOOLKIT_CONFIG} (containerd.toolkit_mode): "
                     "the toolkit's own file; set its mode back by hand if wanted")
    writes.append(Write(LEDGER, None))
    return writes, notes


def _reverted_target(host: Host, recorded: Ledger, current: bytes,
                     changes: tuple[tomltext.Change, ...], notes: list[str]) -> bytes:
    target = recorded.target
    try:
        text = safeio.decode(current)
    except safeio.Refused as exc:
        raise ContainerdStepError(f"{host.display(target)}: {exc}",
                                  "fix the file by hand, then run the revert again") from None
    reverted = undo.revert(text, recorded.added_runtime, changes, host.display(target),
                           recorded.hunks)
    notes += [f"{target}: {line}" for line in reverted.describe()]
    result = reverted.text.encode()
    clean = journal.sha256(current) == recorded.written_sha256 and not recorded.others_edited
    if clean and recorded.backup is not None:
        # Nobody else touched the file since gpunode's first change: its backup is exactly
        # the file without gpunode's changes (blank lines at the end included).
        backup = host.read_optional_bytes(recorded.backup)
        if backup is not None and _same_document(backup, reverted.text):
            return backup
    return result


def _same_document(data: bytes, text: str) -> bool:
    try:
        return bool(tomltext.pruned(loads_toml(safeio.decode(data), "<backup>"))
                    == tomltext.pruned(loads_toml(text, "<reverted>")))
    except (safeio.Refused, FileError):
        return False


def _revert_copy(host: Host, recorded: Ledger, current: bytes | None, result: bytes | None,
                 writes: list[Write], notes: list[str]) -> None:
    """The writable copy and its drop-in go together, or stay together."""
    target, original = recorded.target, recorded.copied_from or ""
    source = host.read_optional_bytes(original)
    clean = (current is not None and journal.sha256(current) == recorded.written_sha256
             and not recorded.others_edited)
    # A copy someone removed leaves nothing to keep: the drop-in must not point at it.
    copy_is_original = clean or current is None or (result is not None and result == source)
    pointer = recorded.dropin or DROPIN
    dropin_ours = recorded.dropin is None or _still_ours(host, recorded, pointer)
    if copy_is_original and dropin_ours:
        if current is not None:
            writes.append(Write(target, None))
            notes.append(f"remove {target} (gpunode's copy of {original})")
        if recorded.dropin is not None and host.exists(pointer):
            writes.append(Write(pointer, None))
            notes.append(f"remove {pointer}")
        return
    if result is not None and result != current:
        writes.append(Write(target, result))
    why = (f"{pointer} was changed since gpunode wrote it" if not dropin_ours else
           f"{target} has changes made since gpunode copied it from {original}")
    notes.append(f"keep {target} and {pointer} (containerd keeps reading the copy): {why}")


def _settle_backup(host: Host, recorded: Ledger, result: bytes | None, writes: list[Write],
                   notes: list[str]) -> None:
    """The backup is a safety copy: removed only when the reverted file equals it."""
    if recorded.backup is None:
        return
    backup = host.read_optional_bytes(recorded.backup)
    if backup is None:
        return
    if backup == result:
        writes.append(Write(recorded.backup, None))
        notes.append(f"remove {recorded.backup} (the reverted file equals it)")
    else:
        notes.append(f"keep {recorded.backup}: {recorded.target} after the revert differs "
                     "from it (changes made since gpunode's first change stay); it is the file "
                     "as it was before gpunode's first change, remove it when it is no longer "
                     "needed")


def _still_ours(host: Host, recorded: Ledger, path: str) -> bool:
    """The whole file gpunode wrote is still as gpunode wrote it (a ledger from before
    gpunode recorded it: assumed so)."""
    data = host.read_optional_bytes(path)
    if data is None:
        return False
    digest = recorded.written.get(path)
    return digest is None or journal.sha256(data) == digest
