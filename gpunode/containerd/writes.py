"""The files one `containerd configure` writes, as one journalled transaction (journal.py):
the backup, the config, drop-in mode's imported file, the containerd.service.d drop-in, and
the ledger last, with what it records (the changes merged with earlier runs')."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from gpunode.containerd import edit, journal, ledger, schema, tomltext
from gpunode.containerd.extras import FileChange
from gpunode.containerd.journal import Write
from gpunode.containerd.ledger import BACKUP_SUFFIX, IMPORT_FILE, LEDGER, Ledger
from gpunode.errors import ContainerdStepError
from gpunode.platform.host import Host


class Plan(Protocol):
    """What of step.Plan the writes are made from."""

    target: str
    before: str | None
    edit: edit.Edit
    copied_from: str | None
    dropin_text: str | None
    dropin_path: str
    source_text: str
    import_text: str | None
    ledger: Ledger | None

    files: tuple[FileChange, ...]

    @property
    def import_changed(self) -> bool: ...

    @property
    def config_changed(self) -> bool: ...


def configure_writes(host: Host, the_plan: Plan) -> list[Write]:
    """Every file the configure writes, with its content, mode and owner: backup, config,
    imported file, drop-in, the files beside the config (extras.py), and the ledger last."""
    target = the_plan.target
    old = the_plan.ledger
    current = host.read_optional_bytes(target)
    text = the_plan.edit.text.encode()
    record = old or Ledger(target=target, copied_from=the_plan.copied_from)
    source = the_plan.copied_from or target
    writes: list[Write] = []
    backup = target + BACKUP_SUFFIX
    edits = the_plan.config_changed
    if edits and old is None and the_plan.before is not None and not host.exists(backup):
        # The file as it was before gpunode's first change, kept once, as private as it was.
        writes.append(Write(backup, the_plan.before.encode(), journal.attrs_of(host, target)))
        record = replace(record, backup=backup)
    if old is not None and journal.sha256(current) != old.written_sha256:
        record = replace(record, others_edited=True)
    # A new copy keeps its original's mode and owner; an existing file keeps its own.
    if edits:
        writes.append(Write(target, text, None if current is not None else
                            journal.attrs_of(host, source)))
    written = dict(record.written)
    if the_plan.import_changed and the_plan.import_text is not None:
        data = the_plan.import_text.encode()
        exists = host.exists(IMPORT_FILE)
        writes.append(Write(IMPORT_FILE, data, None if exists else journal.attrs_of(host, source)))
        written[IMPORT_FILE] = journal.sha256(data) or ""
        record = replace(record, import_file=IMPORT_FILE)
    if the_plan.dropin_text is not None:
        data = the_plan.dropin_text.encode()
        writes.append(Write(the_plan.dropin_path, data))
        written[the_plan.dropin_path] = journal.sha256(data) or ""
        record = replace(record, dropin=the_plan.dropin_path)
    for change in the_plan.files:
        writes.append(Write(change.path, change.data))
        if change.data is None:
            written.pop(change.path, None)
        else:
            written[change.path] = journal.sha256(change.data) or ""
    previous = current.decode("utf-8", "replace") if current is not None else the_plan.source_text
    hunks = (tuple(tomltext.text_hunks(previous, the_plan.edit.text)),) if edits else ()
    record = replace(record, changes=_merged(record.changes, the_plan.edit),
                     added_runtime=the_plan.edit.added_runtime or record.added_runtime,
                     written_sha256=journal.sha256(text if edits else current), written=written,
                     hunks=(*record.hunks, *hunks))
    record = record.with_dirs(journal.missing_dirs(host, [*(w.path for w in writes), LEDGER]))
    writes.append(Write(LEDGER, record.to_json(), mode=0o600))
    refuse_hard_links(host, [w.path for w in writes])
    return writes


def _merged(recorded: tuple[ledger.Change, ...], result: edit.Edit) -> tuple[ledger.Change, ...]:
    """What gpunode changed so far plus this edit. A key's first `before` is the one a revert
    restores; a runtime gpunode added is one change whose `after` is the whole table, and a
    later change inside it updates that table."""
    new = [ledger.Change(c.path, c.before, c.after) for c in result.changes]
    if result.added_runtime:
        path = (*schema.runtimes_path(result.version), result.added_runtime)
        table = schema.lookup(edit.parse(result.text, "the edited config"), path)
        new.insert(0, ledger.Change(path, None, table))
    entries = list(recorded)
    for change in new:
        for i, entry in enumerate(entries):
            if entry.path == change.path:
                entries[i] = replace(entry, after=change.after)
                break
            inside = change.path[: len(entry.path)] == entry.path
            if inside and isinstance(entry.after, dict) and entry.before is None:
                after = _with(entry.after, change.path[len(entry.path):], change.after)
                entries[i] = replace(entry, after=after)
                break
        else:
            entries.append(change)
    return tuple(entries)


def _with(table: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of `table` with `value` at `path` (None: removed)."""
    import copy

    result = copy.deepcopy(table)
    node = result
    for key in path[:-1]:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = copy.deepcopy(value)
    return result


def refuse_hard_links(host: Host, paths: list[str]) -> None:
    """An atomic rename would split a hard-linked file from its other names: refuse first."""
    for path in paths:
        st = host.stat(path)
        if st is not None and st.st_nlink > 1:
            raise ContainerdStepError(
                f"{host.display(path)} has {st.st_nlink} hard links; gpunode replaces a file "
                "by renaming a new one over it, which would leave the other names with the old "
                "content", f"make {host.display(path)} a file of its own (cp it to a new name "
                "and mv that over it), or point containerd at one name, then run gpunode again")
