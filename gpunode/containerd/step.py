"""The container runtime step: plan the config change, write it safely, restart only if needed.

`plan()` reads and decides (nothing written); `preview()` is what `plan` and `--dry-run` show
(the pending rollback first, while an interrupted change is recorded); `configure()` is
recover, plan, apply: the one call of `containerd configure` and of boot. `apply()` writes the
backup, the config, the drop-in and the ledger as one transaction (gpunode.containerd.journal:
any prefix of it that a kill leaves is rolled back by the next run's `recover()`), then
restarts containerd only when it is running and something changed (restart.py), and puts
everything back (the directories it made included) if containerd does not come back.
`gpunode containerd revert` is revert.py; the probe of the binary itself is probe.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from gpunode import log
from gpunode.config import ContainerdConfig
from gpunode.containerd import (
    discover,
    edit,
    extras,
    journal,
    ledger,
    locate,
    restart,
    schema,
    tomltext,
    wiring,
    writes,
)
from gpunode.containerd.discover import (
    CONTAINERD_UNIT,
    ActiveConfig,
    active_config,
)
from gpunode.containerd.journal import JOURNAL
from gpunode.containerd.ledger import (
    DROPIN,
    IMPORT_FILE,
    WRITABLE_CONFIG,
    Ledger,
)
from gpunode.containerd.probe import CommandProbe, NoProbe, Probe
from gpunode.errors import ContainerdStepError, GpunodeError
from gpunode.platform.host import Host
from gpunode.platform.systemd import Systemd


@dataclass(frozen=True)
class Plan:
    """The containerd change, decided from the files as they are before anything is written."""

    active: ActiveConfig
    target: str  # the file gpunode writes
    before: str | None  # the target's text now; None when gpunode creates it
    edit: edit.Edit  # its text starts from the target's text, or the copied original's
    copied_from: str | None = None  # the read-only file a writable copy is made from
    dropin_text: str | None = None  # what points containerd at the copy; None: not needed
    dropin_path: str = DROPIN  # where: the drop-in, or ENV_FILE (then no daemon-reload)
    runtime_name: str = "nvidia"
    source_text: str = ""
    import_text: str | None = None  # drop-in mode: the imported file gpunode owns
    import_before: str | None = None
    ledger: Ledger | None = None  # what gpunode changed before, validated
    files: tuple[extras.FileChange, ...] = ()  # beside the config: memlock drop-in, toolkit
    gpu_access: str = "runtime"  # "cdi": no runtime, only what CDI needs

    @property
    def import_changed(self) -> bool:
        return self.import_text is not None and self.import_text != self.import_before

    @property
    def config_changed(self) -> bool:
        return (self.edit.changed or self.before is None or self.dropin_text is not None
                or self.import_changed)

    @property
    def changed(self) -> bool:
        return self.config_changed or bool(self.files)

    def describe(self) -> list[str]:
        lines = []
        if self.copied_from:
            lines.append(f"copy {self.copied_from} to {self.target} (the original is on "
                         "read-only /usr)")
        if self.dropin_text is not None:
            lines.append(f"write {self.dropin_path} so containerd reads {self.target}")
        if self.import_changed:
            lines.append(f"write {IMPORT_FILE} with runtime '{self.runtime_name}' (drop-in mode)")
        lines += [f"{self.target}: {line}" for line in self.edit.describe()]
        lines += [change.description for change in self.files]
        if self.gpu_access == "cdi":
            return lines or [f"{self.target}: CDI is already as containerd needs it"]
        return lines or [f"{self.target}: runtime '{self.runtime_name}' is already as configured"]

    def diff(self) -> str:
        """A unified diff; a new writable copy is shown against the original it copies."""
        before = self.before if self.before is not None else self.source_text
        text = tomltext.unified_diff(before, self.edit.text, self.copied_from or self.target,
                                     self.target)
        if self.import_changed and self.import_text is not None:
            text += tomltext.unified_diff(self.import_before or "", self.import_text,
                                          IMPORT_FILE if self.import_before else "/dev/null",
                                          IMPORT_FILE)
        if self.dropin_text is not None:
            text += tomltext.unified_diff("", self.dropin_text, "/dev/null", self.dropin_path)
        for change in self.files:
            text += extras.diff(change)
        return text


@dataclass(frozen=True)
class Outcome:
    """What a configure did: the config changes made, and whether containerd was restarted."""

    changed: bool
    restarted: bool
    target: str
    descriptions: tuple[str, ...] = ()
    restart_pending: bool = False  # containerd runs with the old config (restart not allowed)


def spec_from(config: ContainerdConfig, daemon: schema.Daemon | None = None,
              doc: dict[str, Any] | None = None) -> edit.RuntimeSpec:
    """The runtime spec, its CDI keys decided for this containerd and file (wiring.py)."""
    return wiring.runtime_spec(config, daemon, doc if doc is not None else {"version": 2})


# -- plan ----------------------------------------------------------------------------------------


def plan(host: Host, config: ContainerdConfig, systemd: Systemd | None,
         explicit: str | None = None, force: bool = False, probe: Probe | None = None,
         located: locate.Located | GpunodeError | None = None) -> Plan:
    """The change, from the files as they are (after `recover()`: while an interrupted change
    is pending, `preview()` is what configure and boot would do). `located`: boot's early
    locating (locate.early), its probes already started."""
    spec = spec_from(config)
    probe = probe or (CommandProbe() if host.is_live else NoProbe())
    try:  # whatever was started (boot's early locating too) is reaped however this ends
        binaries = [spec.binary] if config.runtime_wanted else []
        if config.runtime_wanted and config.mode_runtimes:
            binaries += [binary for _, binary in wiring.mode_runtime_binaries(spec.binary)]
        for binary in binaries if not force else ():
            if not host.is_executable_file(binary):
                raise ContainerdStepError(
                    f"runtime binary {host.display(binary)} is not an executable file on this host",
                    "install the NVIDIA Container Toolkit (on Flatcar: sysext-bakery's "
                    "nvidia-runtime sysext), set containerd.runtime_path, use CDI alone "
                    '(containerd.gpu_access = "cdi"), or pass --force to configure it anyway')
        files = extras.plan(host, config)
        if isinstance(located, GpunodeError):
            raise located
        found = located or locate.locate(host, config, systemd, explicit)
        active, binary, source_text = found.active, found.active.binary, found.source_text
        copied_from, target, source = found.copied_from, found.target, found.source
        before = None if copied_from else source_text
        shown = host.display(source)
        common: dict[str, Any] = {
            "active": active, "target": target, "before": before, "copied_from": copied_from,
            "dropin_text": found.dropin, "dropin_path": found.dropin_path,
            "runtime_name": spec.name, "source_text": source_text,
            "ledger": found.recorded, "files": files, "gpu_access": config.gpu_access}
        # A first run asks containerd for its version, and only then, where a runtime is to be
        # added and gpunode does not know that version's defaults, for its own reading of the
        # file (locate.start_probes).
        locate.start_probes(found, probe)
        if config.mode == "drop-in" and config.runtime_wanted:
            refused = _import_refusal(probe, binary, copied_from)
            if refused is None:
                daemon = probe.version(binary)
                spec = spec_from(config, daemon, edit.parse(source_text, shown))
                effective = _dump_unless_known(probe, binary, host.real(source), daemon)
                extra = [edit.RuntimeSpec(name=name, binary=path) for name, path in
                         wiring.mode_runtime_binaries(spec.binary)] if config.mode_runtimes else []
                main, import_text = edit.configure_dropin(source_text, spec, shown, IMPORT_FILE,
                                                          effective, extra, daemon)
                return Plan(edit=main, import_text=import_text,
                            import_before=host.read_optional(IMPORT_FILE), **common)
            log.get().warning("containerd.dropin_refused", reason=refused, fallback="in-place")
        # Judged by what containerd makes of the file and its imports (resolved from where the
        # file will be), as the version that reads it, when it can be asked.
        daemon = probe.version(binary)
        if locate.wants_dump(config, found) and daemon not in edit.schema.KNOWN_DEFAULTS:
            probe.prefetch(binary, host.real(source), version=False)  # beside the views below
        doc = edit.parse(source_text, shown)
        imports = {d: discover.load_layers(host, target, doc, daemon=d)[1:]
                   for d in edit.readers(edit.schema.config_version(doc), daemon)}
        spec = spec_from(config, daemon, doc)
        if not config.runtime_wanted:  # CDI mode: only what CDI needs, no runtime
            return Plan(edit=wiring.configure_cdi(source_text, spec, shown, daemon, imports),
                        **common)
        result = edit.configure(source_text, spec, shown, daemon=daemon, imports=imports)
        effective = None
        if result.added_runtime or config.mode_runtimes:
            effective = _dump_unless_known(probe, binary, host.real(source), daemon)
            if effective is not None and result.added_runtime:
                result = edit.configure(source_text, spec, shown, effective, daemon, imports)
        if config.mode_runtimes:
            result = wiring.with_mode_runtimes(result, spec.binary, shown, daemon, imports,
                                               effective)
        return Plan(edit=result, **common)
    finally:
        probe.discard()  # a dump started and not needed after all


def _dump_unless_known(probe: Probe, binary: str, path: str,
                       daemon: edit.schema.Daemon | None) -> dict[str, Any] | None:
    """containerd's `config dump` of `path`; None without asking for a version whose dump the
    edit reads from its own views (schema.KNOWN_DEFAULTS: the same values, checked against
    the real binaries)."""
    return None if daemon in edit.schema.KNOWN_DEFAULTS else probe.dump(binary, path)


def _import_refusal(probe: Probe, binary: str, copied_from: str | None) -> str | None:
    """Why drop-in mode cannot be used here, or None when it can."""
    if copied_from is not None:
        return (f"containerd's config {copied_from} is on read-only /usr, so gpunode writes a "
                "copy anyway; the runtime goes into that copy")
    version = probe.version(binary)
    if version is None:
        return f"the version of {binary} is unknown (it cannot be run here)"
    if version < schema.MERGES_FROM:
        return (f"containerd {version[0]}.{version[1]} lets an imported file replace the main "
                "file's whole CRI plugin table instead of merging it (containerd#5837, fixed in "
                "2.1): the main file's CRI settings and runc would be lost")
    return None


# -- apply ---------------------------------------------------------------------------------------


def recover(host: Host, systemd: Systemd, explicit: str | None = None) -> None:
    """Roll back a change an earlier run could not finish (killed, power cut); configure,
    revert and boot call this before they read anything. A journal is only followed for a
    config gpunode edits here (`_known_targets`)."""
    if not journal.pending(host):
        return  # nothing interrupted: no need to ask containerd's unit for its config
    undone = journal.recover(host, _known_targets(host, systemd, explicit))
    if undone:
        log.get().warning("containerd.interrupted_change_undone", undone=undone,
                          note="an earlier gpunode run was interrupted before it finished; "
                          "its change was rolled back, and this run starts from there")
        if any(line.endswith((DROPIN, ledger.MEMLOCK_DROPIN)) for line in undone):
            systemd.daemon_reload()  # a unit drop-in was put back: systemd must read it again


def _known_targets(host: Host, systemd: Systemd | None, explicit: str | None) -> set[str]:
    """The configs an interrupted change may have edited: the writable copy, the ledger's
    target, the file containerd reads, and the one this command names (--config or
    containerd.config_path)."""
    targets = {WRITABLE_CONFIG, *([explicit] if explicit else [])}
    try:
        recorded = ledger.read(host)
    except ledger.LedgerError:
        recorded = None  # reported by the command itself, once, right after this
    if recorded is not None:
        targets.add(recorded.target)
    with contextlib.suppress(GpunodeError):  # a unit it cannot read: the plan reports it
        targets.add(active_config(host, systemd).path)
    return targets


def configure(host: Host, config: ContainerdConfig, systemd: Systemd, restart_timeout: float,
              explicit: str | None = None, force: bool = False,
              report: dict[str, Any] | None = None,
              probe: Probe | None = None, restart_allowed: bool = True,
              located: locate.Located | GpunodeError | None = None) -> tuple[Plan, Outcome]:
    """`containerd configure` and boot's containerd step: roll back an interrupted change,
    plan from the files as that leaves them, apply. `report` (the step's log fields) says
    what happened as it happens, so a failure's event is as true as a success's (apply).
    `restart_allowed` False (the watch's repair under its restart policy) leaves a running
    containerd running with the old config: its restart is pending. `located`: boot's early
    locating (locate.early: none where a rollback was pending, so recover() has none to do)."""
    recover(host, systemd, explicit or config.config_path)
    the_plan = plan(host, config, systemd, explicit, force=force, probe=probe, located=located)
    return the_plan, apply(host, the_plan, systemd, restart_timeout, report, restart_allowed)


@dataclass(frozen=True)
class PendingRollback:
    """The plan while an interrupted change is pending: configure and boot roll it back
    first, and decide the rest from the files as they are then."""

    target: str
    undo: tuple[str, ...]  # what the rollback does (journal.preview)
    changed: bool = True

    def describe(self) -> list[str]:
        undo = "; ".join(self.undo) or "nothing left to put back"
        return [f"roll back the interrupted change recorded in {JOURNAL} ({undo}), then "
                f"configure {self.target} from the rolled-back files (that plan is computed "
                "after the rollback)"]

    def diff(self) -> str:
        return "".join(f"# {line}\n" for line in self.describe())


def preview(host: Host, config: ContainerdConfig, systemd: Systemd | None,
            explicit: str | None = None, force: bool = False,
            probe: Probe | None = None) -> Plan | PendingRollback:
    """What configure (and boot) would do: the plan, or, while an interrupted change is
    pending, the rollback they start with. Nothing is written."""
    targets = _known_targets(host, systemd, explicit or config.config_path)
    pending = journal.preview(host, targets)
    if pending is None:
        return plan(host, config, systemd, explicit, force=force, probe=probe)
    target = pending[0] or explicit or config.config_path or WRITABLE_CONFIG
    return PendingRollback(target, tuple(pending[1]))


def apply(host: Host, the_plan: Plan, systemd: Systemd, restart_timeout: float,
          report: dict[str, Any] | None = None, restart_allowed: bool = True) -> Outcome:
    """Write the plan and restart containerd when it runs. `report` gets `config`,
    `planned_change` (the plan changes something) and `changed` (the files are changed now):
    `changed` turns true only once the transaction has committed, and false again once a
    refused config is put back. A write that fails (disk full) leaves the files as they were,
    and the failure's event says changed: false; `interrupted` says a rollback failed too and
    the journal holds the change for the next run to roll back."""
    report = {} if report is None else report
    report.update(config=the_plan.target, planned_change=the_plan.changed, changed=False)
    descriptions = tuple(the_plan.describe())
    if not the_plan.changed:
        return Outcome(changed=False, restarted=False, target=the_plan.target,
                       descriptions=descriptions)
    running = systemd.active_state(CONTAINERD_UNIT) == "active"
    commit = writes.configure_writes(host, the_plan)  # every content decided before any write
    try:
        done = journal.commit(host, commit, the_plan.target)
    except GpunodeError:
        if journal.pending(host):
            report.update(interrupted=True)
        raise
    report.update(changed=True)
    # A unit drop-in (the writable copy's, the LimitMEMLOCK one) is read on a daemon-reload;
    # at first boot that comes before containerd starts, which then starts once, with it.
    unit_changed = any(f.restarts for f in the_plan.files)
    reload = (the_plan.dropin_text is not None and the_plan.dropin_path == DROPIN) or unit_changed
    if reload:
        systemd.daemon_reload()
    if not (the_plan.config_changed or unit_changed):  # the toolkit reads its own per container
        return Outcome(changed=True, restarted=False, target=the_plan.target,
                       descriptions=descriptions)
    if not running:
        restart.note_not_restarted(systemd, the_plan.target)
        return Outcome(changed=True, restarted=False, target=the_plan.target,
                       descriptions=descriptions)
    if not restart_allowed:
        report.update(restart_pending=True)
        return Outcome(changed=True, restarted=False, target=the_plan.target,
                       descriptions=descriptions, restart_pending=True)
    try:
        restart.restart(host, systemd, the_plan.edit.text, restart_timeout)
    except GpunodeError as failure:
        journal.commit(host, done.undo, done.target, remove_dirs=done.created)
        report.update(changed=False)
        if reload:
            systemd.daemon_reload()
        try:
            previous = restart.config_text(host, the_plan.target, the_plan.copied_from)
            restart.restart(host, systemd, previous, restart_timeout)
        except GpunodeError as second:
            raise ContainerdStepError(
                f"containerd did not come back after the change ({failure}); the previous "
                f"config was restored, but containerd did not come back with it either "
                f"({second})", "see 'journalctl -u containerd'") from second
        raise ContainerdStepError(
            f"containerd did not come back after the change ({failure}); the previous config "
            "was restored and containerd is running with it again",
            "see 'journalctl -u containerd' for why it refused the new config") from failure
    return Outcome(changed=True, restarted=True, target=the_plan.target,
                   descriptions=descriptions)
