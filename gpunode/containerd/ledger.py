"""The ledger, /var/lib/gpunode/containerd.json: what gpunode changed in containerd's config.

`configure` writes it (inside the same transaction as the files, gpunode.containerd.journal),
`revert` reads it to undo exactly that. It is read back by one validated parser: every key's
type is checked, and a missing or wrong-typed key is one clear error naming the file and the
key, before anything is written. Paths it names must be the ones gpunode itself writes, so a
damaged ledger can never make revert touch another file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from gpunode.containerd.tomltext import Hunk
from gpunode.errors import LedgerError
from gpunode.platform import records
from gpunode.platform.host import Host
from gpunode.platform.records import kind as _kind

LEDGER = "/var/lib/gpunode/containerd.json"
WRITABLE_CONFIG = "/etc/containerd/config.toml"
DROPIN = "/etc/systemd/system/containerd.service.d/10-gpunode.conf"
# With gpunode's shipped drop-in (units/containerd-env.conf, in the sysext at SHIPPED_DROPIN)
# containerd reads CONTAINERD_CONFIG from this file at every start: pointing it at the writable
# copy then needs no daemon-reload, which costs the first boot more than the rest of the step.
ENV_FILE = "/etc/gpunode/containerd.env"
SHIPPED_DROPIN = "/usr/lib/systemd/system/containerd.service.d/10-gpunode-env.conf"
POINTERS = (DROPIN, ENV_FILE)  # what may point containerd at the writable copy
IMPORT_FILE = "/etc/containerd/conf.d/99-gpunode-nvidia.toml"  # drop-in mode's file
# Beside the config (containerd/extras.py): the LimitMEMLOCK drop-in, the toolkit's config.
MEMLOCK_DROPIN = "/etc/systemd/system/containerd.service.d/20-gpunode-memlock.conf"
TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
BACKUP_SUFFIX = ".gpunode-orig"
READ_ONLY_PREFIXES = ("/usr/",)  # Flatcar's /usr is a read-only, verified partition
SCHEMA = 1


@dataclass(frozen=True)
class Change:
    """One value gpunode set (a whole runtime table it added, too); before None: was absent."""

    path: tuple[str, ...]
    before: Any
    after: Any


@dataclass(frozen=True)
class Ledger:
    """What gpunode changed in containerd's config and beside it: everything revert may undo."""

    target: str  # the config file gpunode edits (or its writable copy)
    copied_from: str | None = None  # the read-only original of a writable copy
    backup: str | None = None  # <target>.gpunode-orig, when gpunode wrote it
    dropin: str | None = None  # what points containerd at the copy (POINTERS), when written
    import_file: str | None = None  # drop-in mode's imported file, when gpunode wrote it
    added_runtime: str | None = None
    changes: tuple[Change, ...] = ()
    written_sha256: str | None = None  # the target as gpunode last wrote it
    # Someone else changed the target between two configures: the backup is then no longer
    # "the target minus gpunode's changes", and revert must not restore it wholesale.
    others_edited: bool = False
    written: dict[str, str] = field(default_factory=dict)  # whole files gpunode wrote → sha256
    created_dirs: tuple[str, ...] = ()  # directories gpunode created, parents first
    # Each configure's line changes to the target (tomltext.text_hunks), for a byte-exact revert.
    hunks: tuple[tuple[Hunk, ...], ...] = ()

    def to_json(self) -> bytes:
        document = {
            "schema_version": SCHEMA, "target": self.target, "copied_from": self.copied_from,
            "backup": self.backup, "dropin": self.dropin, "import_file": self.import_file,
            "added_runtime": self.added_runtime,
            "changes": [{"path": list(c.path), "before": to_json_value(c.before),
                         "after": to_json_value(c.after)} for c in self.changes],
            "written_sha256": self.written_sha256, "others_edited": self.others_edited,
            "written": dict(sorted(self.written.items())),
            "created_dirs": list(self.created_dirs),
            "hunks": [[{"context": list(c), "before": list(b), "after": list(a)}
                       for c, b, a in run] for run in self.hunks],
        }
        return (json.dumps(document, indent=2) + "\n").encode()

    def with_dirs(self, dirs: list[str]) -> Ledger:
        return replace(self, created_dirs=tuple(dict.fromkeys([*self.created_dirs, *dirs])))


# TOML values JSON has no form for (a date or time, inf, nan), as the ledger writes them: one
# object each, {"$toml": kind, "value": text}, read back to the very value tomllib gives.
TOML_TAG = "$toml"


def to_json_value(value: Any) -> Any:
    """A TOML value (from tomllib) as JSON can hold it, and from_json_value reads back."""
    import datetime
    import math

    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json_value(v) for v in value]
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        kind = type(value).__name__  # datetime, date, time (a datetime is also a date)
        return {TOML_TAG: kind, "value": value.isoformat()}
    if isinstance(value, float) and not math.isfinite(value):
        return {TOML_TAG: "float", "value": repr(value)}  # inf, -inf, nan
    return value


def from_json_value(value: Any, fail: Any) -> Any:
    """to_json_value's value read back; `fail(reason)` for a tag that names no TOML value."""
    import datetime

    if isinstance(value, list):
        return [from_json_value(v, fail) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) != {TOML_TAG, "value"}:
        return {k: from_json_value(v, fail) for k, v in value.items()}
    kinds = {"datetime": datetime.datetime.fromisoformat, "date": datetime.date.fromisoformat,
             "time": datetime.time.fromisoformat, "float": _non_finite}
    kind, text = value[TOML_TAG], value["value"]
    if kind not in kinds or not isinstance(text, str):
        fail(f"has a {TOML_TAG} value of kind {kind!r}; valid are {', '.join(kinds)}")
    try:
        return kinds[kind](text)
    except ValueError:
        fail(f"has a {TOML_TAG} {kind} value {text[:40]!r} that is not one")


def _non_finite(text: str) -> float:
    if text not in ("inf", "-inf", "nan"):
        raise ValueError(text)
    return float(text)


def read(host: Host) -> Ledger | None:
    """The ledger, or None when gpunode has changed nothing; a bad one is one clear error."""
    shown = host.display(LEDGER)
    data = host.read_optional_bytes(LEDGER)
    if data is None:
        return None
    return parse(records.loads_json(data, shown, _error), shown)


_HINT = ("it is gpunode's record of what it changed in containerd's config, needed to undo it: "
         "put back a good copy, or, if gpunode's changes are already gone, remove it")


def _error(message: str) -> LedgerError:
    return LedgerError(message, _HINT)


def parse(document: Any, shown: str) -> Ledger:
    if not isinstance(document, dict):
        raise LedgerError(f"{shown}: not a JSON object", _HINT)
    reader = _Reader(document, shown, _error)
    reader.schema("schema_version", SCHEMA)
    target = reader.path("target")
    ledger = Ledger(
        target=target,
        copied_from=reader.path("copied_from", optional=True),
        backup=reader.path("backup", optional=True),
        dropin=reader.path("dropin", optional=True),
        import_file=reader.path("import_file", optional=True, default_absent=True),
        added_runtime=reader.text("added_runtime", optional=True),
        changes=reader.changes(),
        written_sha256=reader.text("written_sha256", optional=True),
        others_edited=reader.flag("others_edited"),
        written=reader.digests("written"),
        created_dirs=tuple(reader.paths("created_dirs")),
        hunks=reader.hunks(),
    )
    _check_paths(ledger, reader)
    return ledger


def _check_paths(ledger: Ledger, reader: _Reader) -> None:
    """Each path is one gpunode itself writes for this target: nothing else is ever touched."""
    if ledger.copied_from is not None:
        if ledger.target != WRITABLE_CONFIG:
            reader.fail("target", f"must be {WRITABLE_CONFIG} when 'copied_from' is set")
        if not ledger.copied_from.startswith(READ_ONLY_PREFIXES):
            reader.fail("copied_from", "must be a file under /usr")
    for key, value, allowed in (("backup", ledger.backup, (ledger.target + BACKUP_SUFFIX,)),
                                ("dropin", ledger.dropin, POINTERS),
                                ("import_file", ledger.import_file, (IMPORT_FILE,))):
        if value is not None and value not in allowed:
            reader.fail(key, f"is {value!r}; gpunode only writes {' or '.join(map(repr, allowed))} "
                        "there")
    owned = owned_paths(ledger.target)
    for path in ledger.written:
        if path not in owned:
            reader.fail("written", f"names {path!r}, which is not a file gpunode writes")
    for directory in ledger.created_dirs:
        if not holds_owned(directory, owned):
            reader.fail("created_dirs", f"names {directory!r}, which holds no file gpunode "
                        "writes")


def owned_paths(target: str) -> frozenset[str]:
    """Every file gpunode's containerd step writes when it edits `target`: the target, its
    backup, the imported file, the containerd.service.d drop-ins, the toolkit's config and
    the ledger.

    The one path policy of the ledger and of the undo journal (gpunode.containerd.journal,
    which adds its own file): a damaged record naming any other file (/etc/passwd) is
    refused, never written."""
    return frozenset({target, target + BACKUP_SUFFIX, *POINTERS, IMPORT_FILE, MEMLOCK_DROPIN,
                      TOOLKIT_CONFIG, LEDGER})


def holds_owned(directory: str, owned: frozenset[str]) -> bool:
    """`directory` (created or removed by gpunode) holds one of the `owned` files."""
    if directory in ("/", "") or not directory.startswith("/") or "\0" in directory:
        return False
    return any(p.startswith(directory.rstrip("/") + "/") for p in owned)


class _Reader(records.Reader):
    """records.Reader with the ledger's own kinds of value."""

    def digests(self, key: str) -> dict[str, str]:
        _, value = self.get(key, default_absent=True)
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            self.fail(key, f"is {_kind(value)}, expected an object of path → sha256")
        return dict(value)

    def hunks(self) -> tuple[tuple[Hunk, ...], ...]:
        _, value = self.get("hunks", default_absent=True)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(run, list) for run in value):
            self.fail("hunks", f"is {_kind(value)}, expected a list of lists")
        runs = []
        for i, run in enumerate(value):
            found = []
            for j, hunk in enumerate(run):
                parts = [hunk.get(k) if isinstance(hunk, dict) else None
                         for k in ("context", "before", "after")]
                if not all(isinstance(p, list) and all(isinstance(x, str) for x in p)
                           for p in parts):
                    self.fail(f"hunks[{i}][{j}]", "must have context, before and after as "
                              "lists of strings")
                found.append((tuple(parts[0]), tuple(parts[1]), tuple(parts[2])))  # type: ignore[arg-type]
            runs.append(tuple(found))
        return tuple(runs)

    def changes(self) -> tuple[Change, ...]:
        _, value = self.get("changes", default_absent=False)
        if not isinstance(value, list):
            self.fail("changes", f"is {_kind(value)}, expected a list")
        found = []
        for i, entry in enumerate(value):
            key = f"changes[{i}]"
            if not isinstance(entry, dict):
                self.fail(key, f"is {_kind(entry)}, expected an object with path, before, after")
            missing = [k for k in ("path", "before", "after") if k not in entry]
            if missing:
                self.fail(f"{key}.{missing[0]}", "is missing")
            path = entry["path"]
            if not isinstance(path, list) or not path or not all(
                    isinstance(p, str) for p in path):
                self.fail(f"{key}.path", f"is {_kind(path)}, expected a non-empty list of "
                          "strings")
            def fail(reason: str, key: str = key) -> None:
                self.fail(key, reason)

            found.append(Change(tuple(path), from_json_value(entry["before"], fail),
                                from_json_value(entry["after"], fail)))
        return tuple(found)

