"""The container runtime step: plan the config change, write it safely, restart only if needed.

`plan()` reads and decides (nothing written); `apply()` writes the backup, the config, the
drop-in and the ledger, then restarts containerd only when it is running and something changed,
and puts everything back if containerd does not come back. `revert()` undoes exactly what the
ledger says gpunode did.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

from gpunode import command, log
from gpunode.config import ContainerdConfig
from gpunode.containerd import discover, edit
from gpunode.containerd.discover import CONTAINERD_UNIT, ActiveConfig, active_config
from gpunode.errors import GpunodeError, HostError
from gpunode.host import Host
from gpunode.systemd import Systemd, SystemdError

WRITABLE_CONFIG = "/etc/containerd/config.toml"
DROPIN = "/etc/systemd/system/containerd.service.d/10-gpunode.conf"
LEDGER = "/var/lib/gpunode/containerd.json"
IMPORT_FILE = "/etc/containerd/conf.d/99-gpunode-nvidia.toml"  # drop-in mode's file
BACKUP_SUFFIX = ".gpunode-orig"
DEFAULT_SOCKET = "/run/containerd/containerd.sock"
READ_ONLY_PREFIXES = ("/usr/",)  # Flatcar's /usr is a read-only, verified partition


class ContainerdStepError(GpunodeError):
    """The container runtime step cannot go on; the message says why."""


@dataclass(frozen=True)
class Plan:
    active: ActiveConfig
    target: str  # the file gpunode writes
    before: str | None  # the target's text now; None when gpunode creates it
    edit: edit.Edit  # its text starts from the target's text, or the copied original's
    copied_from: str | None = None  # the read-only file a writable copy is made from
    dropin_text: str | None = None  # the drop-in to write; None when none is needed
    runtime_name: str = "nvidia"
    source_text: str = ""
    import_text: str | None = None  # drop-in mode: the imported file gpunode owns
    import_before: str | None = None

    @property
    def import_changed(self) -> bool:
        return self.import_text is not None and self.import_text != self.import_before

    @property
    def changed(self) -> bool:
        return (self.edit.changed or self.before is None or self.dropin_text is not None
                or self.import_changed)

    def describe(self) -> list[str]:
        lines = []
        if self.copied_from:
            lines.append(f"copy {self.copied_from} to {self.target} (the original is on "
                         "read-only /usr)")
        if self.dropin_text is not None:
            lines.append(f"write {DROPIN} so containerd reads {self.target}")
        if self.import_changed:
            lines.append(f"write {IMPORT_FILE} with runtime '{self.runtime_name}' (drop-in mode)")
        lines += [f"{self.target}: {line}" for line in self.edit.describe()]
        return lines or [f"{self.target}: runtime '{self.runtime_name}' is already as configured"]

    def diff(self) -> str:
        """A unified diff; a new writable copy is shown against the original it copies."""
        before = self.before if self.before is not None else self.source_text
        text = "".join(difflib.unified_diff(
            before.splitlines(keepends=True), self.edit.text.splitlines(keepends=True),
            fromfile=self.copied_from or self.target, tofile=self.target))
        if self.import_changed and self.import_text is not None:
            text += "".join(difflib.unified_diff(
                (self.import_before or "").splitlines(keepends=True),
                self.import_text.splitlines(keepends=True),
                fromfile=IMPORT_FILE if self.import_before else "/dev/null", tofile=IMPORT_FILE))
        if self.dropin_text is not None:
            text += "".join(difflib.unified_diff([], self.dropin_text.splitlines(keepends=True),
                                                 fromfile="/dev/null", tofile=DROPIN))
        return text


@dataclass(frozen=True)
class Outcome:
    changed: bool
    restarted: bool
    target: str
    descriptions: tuple[str, ...] = ()


def spec_from(config: ContainerdConfig) -> edit.RuntimeSpec:
    return edit.RuntimeSpec(name=config.runtime_name, binary=config.runtime_path,
                            set_as_default=config.set_as_default, enable_cdi=config.enable_cdi,
                            cdi_spec_dirs=config.cdi_spec_dirs)


# -- plan ----------------------------------------------------------------------------------------


class Probe(Protocol):
    """What gpunode asks the containerd binary itself; None where it cannot be asked."""

    def version(self, binary: str) -> tuple[int, int] | None: ...

    def dump(self, binary: str, path: str) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class CommandProbe:
    """Runs the node's containerd (`binary_override`: a test's real containerd instead)."""

    binary_override: str | None = None

    def version(self, binary: str) -> tuple[int, int] | None:
        binary = self.binary_override or binary
        try:
            line = command.run([binary, "--version"], 10)
        except GpunodeError as exc:
            log.get().warning("containerd.version_unknown", exc=exc)
            return None
        match = re.search(r"\s(\d+)\.(\d+)\.\d+", line)
        return (int(match.group(1)), int(match.group(2))) if match else None

    def dump(self, binary: str, path: str) -> dict[str, Any] | None:
        """containerd's own reading of the file, with the defaults it fills into runc."""
        binary = self.binary_override or binary
        try:
            return edit.parse(command.run([binary, "--config", path, "config", "dump"], 20),
                              f"{binary} config dump")
        except GpunodeError as exc:
            log.get().warning("containerd.dump_unavailable", exc=exc,
                              effect="the runtime is copied from the file alone")
            return None


class NoProbe:
    """Under --root the tree's containerd is not this machine's to run."""

    def version(self, binary: str) -> tuple[int, int] | None:
        return None

    def dump(self, binary: str, path: str) -> dict[str, Any] | None:
        return None


def plan(host: Host, config: ContainerdConfig, systemd: Systemd | None,
         explicit: str | None = None, force: bool = False, probe: Probe | None = None) -> Plan:
    spec = spec_from(config)
    probe = probe or (CommandProbe() if host.is_live else NoProbe())
    if not force and not host.is_executable_file(spec.binary):
        raise ContainerdStepError(
            f"runtime binary {host.display(spec.binary)} is not an executable file on this host",
            "install the NVIDIA container toolkit, set containerd.runtime_path, or pass --force "
            "to configure it anyway")
    if explicit or config.config_path:
        path = explicit or config.config_path or ""
        active = ActiveConfig(path, "--config" if explicit else "containerd.config_path")
    else:
        active = active_config(host, systemd)
    binary = active.raw_exec[0].lstrip("-@+!:") if active.raw_exec else "/usr/bin/containerd"
    target, copied_from, dropin = _target(host, active)
    source = copied_from or target
    source_text = _read_config(host, source)
    before = None if copied_from else source_text
    shown = host.display(source)
    common: dict[str, Any] = {
        "active": active, "target": target, "before": before, "copied_from": copied_from,
        "dropin_text": dropin, "runtime_name": spec.name, "source_text": source_text}
    if config.mode == "drop-in":
        refused = _import_refusal(probe, binary, copied_from)
        if refused is None:
            effective = probe.dump(binary, str(host.path(source)))
            main, import_text = edit.configure_dropin(source_text, spec, shown, IMPORT_FILE,
                                                      effective)
            return Plan(edit=main, import_text=import_text,
                        import_before=host.read_optional(IMPORT_FILE), **common)
        log.get().warning("containerd.dropin_refused", reason=refused, fallback="in-place")
    # Judged by what containerd makes of the file and its imports (resolved from where the
    # file will be), as the version that reads it, when it can be asked.
    daemon = probe.version(binary)
    doc = edit.parse(source_text, shown)
    imports = {d: discover.load_layers(host, target, doc, daemon=d)[1:]
               for d in edit.readers(edit.schema.config_version(doc), daemon)}
    result = edit.configure(source_text, spec, shown, daemon=daemon, imports=imports)
    if result.added_runtime:
        effective = probe.dump(binary, str(host.path(source)))
        if effective is not None:
            result = edit.configure(source_text, spec, shown, effective, daemon, imports)
    return Plan(edit=result, **common)


def _import_refusal(probe: Probe, binary: str, copied_from: str | None) -> str | None:
    """Why drop-in mode cannot be used here, or None when it can."""
    if copied_from is not None:
        return (f"containerd's config {copied_from} is on read-only /usr, so gpunode writes a "
                "copy anyway; the runtime goes into that copy")
    version = probe.version(binary)
    if version is None:
        return f"the version of {binary} is unknown (it cannot be run here)"
    if version < (2, 1):
        return (f"containerd {version[0]}.{version[1]} lets an imported file replace the main "
                "file's whole CRI plugin table instead of merging it (containerd#5837, fixed in "
                "2.1): the main file's CRI settings and runc would be lost")
    return None


def _target(host: Host, active: ActiveConfig) -> tuple[str, str | None, str | None]:
    """(file to write, read-only original it is copied from, drop-in text) for the active file."""
    if not active.path.startswith(READ_ONLY_PREFIXES):
        return active.path, None, None
    ledger = read_ledger(host)
    if host.exists(WRITABLE_CONFIG) and not (ledger and ledger.get("copied_from")):
        raise ContainerdStepError(
            f"containerd reads {active.path} (read-only), and {host.display(WRITABLE_CONFIG)} "
            "exists but is not the config containerd uses; gpunode will not overwrite it",
            f"point containerd at {WRITABLE_CONFIG} (a containerd.service.d drop-in), or "
            "remove it, then run gpunode again")
    return WRITABLE_CONFIG, active.path, _dropin_text(active)


def _dropin_text(active: ActiveConfig) -> str:
    header = ("# Written by gpunode: containerd reads a writable copy of its config, which has "
              "the NVIDIA runtime.\n[Service]\n")
    flag = active.raw_flag or ""
    if flag.startswith("${") and flag.endswith("}"):
        return header + f"Environment={flag[2:-1]}={WRITABLE_CONFIG}\n"
    argv = list(active.raw_exec) or ["/usr/bin/containerd"]
    argv = _with_config(argv, WRITABLE_CONFIG)
    return header + "ExecStart=\nExecStart=" + " ".join(argv) + "\n"


def _with_config(argv: list[str], path: str) -> list[str]:
    for i, word in enumerate(argv):
        if word in ("--config", "-c") and i + 1 < len(argv):
            return [*argv[: i + 1], path, *argv[i + 2 :]]
        if word.startswith(("--config=", "-c=")):
            return [*argv[:i], word.split("=", 1)[0] + "=" + path, *argv[i + 1 :]]
    return [*argv, "--config", path]


def _read_config(host: Host, path: str) -> str:
    try:
        raw = host.read_bytes(path)
    except HostError as exc:
        raise ContainerdStepError(str(exc), "check the path containerd.service names") from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContainerdStepError(f"{host.display(path)}: not UTF-8 text (byte {exc.start})",
                                  "fix the file by hand") from exc


# -- apply ---------------------------------------------------------------------------------------


def apply(host: Host, the_plan: Plan, systemd: Systemd, restart_timeout: float) -> Outcome:
    descriptions = tuple(the_plan.describe())
    if not the_plan.changed:
        return Outcome(changed=False, restarted=False, target=the_plan.target,
                       descriptions=descriptions)
    running = systemd.active_state(CONTAINERD_UNIT) == "active"
    saved = _snapshot(host, (the_plan.target, DROPIN, LEDGER, IMPORT_FILE))
    _write(host, the_plan)
    if the_plan.dropin_text is not None:
        systemd.daemon_reload()
    if not running:
        _note_not_restarted(systemd, the_plan.target)
        return Outcome(changed=True, restarted=False, target=the_plan.target,
                       descriptions=descriptions)
    try:
        _restart(host, systemd, the_plan.edit.text, restart_timeout)
    except GpunodeError as failure:
        _restore(host, saved)
        if the_plan.dropin_text is not None:
            systemd.daemon_reload()
        try:
            _restart(host, systemd, saved[the_plan.target] or "", restart_timeout)
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


def _note_not_restarted(systemd: Systemd, target: str) -> None:
    if systemd.available:
        log.get().info("containerd.not_running", target=target,
                       note="containerd will read the new config when it starts")
    else:
        log.get().warning("containerd.unmanaged", target=target,
                          note="containerd is not managed by a reachable systemd here: it reads "
                          "the new config when it next starts; whoever runs it must restart it "
                          "if it is running now")


def _write(host: Host, the_plan: Plan) -> None:
    target = the_plan.target
    ledger = read_ledger(host) or {"schema_version": 1, "target": target,
                                   "copied_from": the_plan.copied_from, "backup": None,
                                   "dropin": None, "added_runtime": None, "changes": []}
    if the_plan.before is not None and not host.exists(target + BACKUP_SUFFIX):
        # The file as it was before gpunode's first change, kept once.
        host.write_atomic(target + BACKUP_SUFFIX, the_plan.before.encode(), mode=0o644)
        ledger["backup"] = target + BACKUP_SUFFIX
    host.make_dirs(target.rpartition("/")[0])
    host.write_atomic(target, the_plan.edit.text.encode(), mode=0o644)
    if the_plan.import_changed and the_plan.import_text is not None:
        host.make_dirs(IMPORT_FILE.rpartition("/")[0])
        host.write_atomic(IMPORT_FILE, the_plan.import_text.encode(), mode=0o644)
        ledger["import_file"] = IMPORT_FILE
    if the_plan.dropin_text is not None:
        host.make_dirs(DROPIN.rpartition("/")[0])
        host.write_atomic(DROPIN, the_plan.dropin_text.encode(), mode=0o644)
        ledger["dropin"] = DROPIN
    _merge_ledger(ledger, the_plan.edit)
    ledger["written_sha256"] = hashlib.sha256(the_plan.edit.text.encode()).hexdigest()
    host.make_dirs(LEDGER.rpartition("/")[0])
    host.write_atomic(LEDGER, (json.dumps(ledger, indent=2) + "\n").encode(), mode=0o600)


def _merge_ledger(ledger: dict[str, Any], result: edit.Edit) -> None:
    """Accumulate what gpunode changed; a key's first `before` is the one a revert restores."""
    if result.added_runtime:
        ledger["added_runtime"] = result.added_runtime
    known = {tuple(c["path"]): c for c in ledger["changes"]}
    for change in result.changes:
        entry = known.get(change.path)
        if entry is None:
            ledger["changes"].append({"path": list(change.path), "before": change.before,
                                      "after": change.after})
        else:
            entry["after"] = change.after


def _snapshot(host: Host, paths: tuple[str, ...]) -> dict[str, str | None]:
    return {path: host.read_optional(path) for path in paths}


def _restore(host: Host, saved: dict[str, str | None]) -> None:
    for path, text in saved.items():
        if text is None:
            host.remove(path)
        else:
            host.write_atomic(path, text.encode())


def _restart(host: Host, systemd: Systemd, config_text: str, timeout: float) -> None:
    started = time.monotonic()
    systemd.restart(CONTAINERD_UNIT, timeout)
    _wait_for_socket(host, _socket_path(config_text), timeout - (time.monotonic() - started))


def _socket_path(config_text: str) -> str:
    try:
        doc = edit.parse(config_text, "containerd config")
    except edit.EditError:
        return DEFAULT_SOCKET
    grpc = doc.get("grpc")
    address = grpc.get("address") if isinstance(grpc, dict) else None
    return address if isinstance(address, str) and address else DEFAULT_SOCKET


def _wait_for_socket(host: Host, path: str, timeout: float) -> None:
    deadline = time.monotonic() + max(timeout, 1.0)
    last = "not tried"
    directory, _, name = str(host.path(path)).rpartition("/")
    while time.monotonic() < deadline:
        try:
            # Through /proc/self/fd: a socket path under a long root exceeds sun_path's 108 bytes.
            fd = os.open(directory or "/", os.O_PATH)
        except OSError as exc:
            last = exc.strerror or str(exc)
        else:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                try:
                    client.connect(f"/proc/self/fd/{fd}/{name}")
                    return
                except OSError as exc:
                    last = exc.strerror or str(exc)
                finally:
                    os.close(fd)
        time.sleep(0.05)
    raise SystemdError(CONTAINERD_UNIT, "reach", f"{path} does not answer: {last}")


# -- revert --------------------------------------------------------------------------------------


def read_ledger(host: Host) -> dict[str, Any] | None:
    text = host.read_optional(LEDGER)
    if text is None:
        return None
    try:
        ledger = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ContainerdStepError(f"{host.display(LEDGER)}: not JSON ({exc})",
                                  "remove it only if you know what gpunode changed") from exc
    if not isinstance(ledger, dict) or ledger.get("schema_version") != 1:
        raise ContainerdStepError(f"{host.display(LEDGER)}: not a gpunode ledger (schema 1)")
    return ledger


def revert(host: Host, systemd: Systemd, restart_timeout: float,
           expected_target: str | None = None) -> Outcome:
    ledger = read_ledger(host)
    if ledger is None:
        return Outcome(changed=False, restarted=False, target="",
                       descriptions=("nothing to revert: gpunode has not changed containerd's "
                                     "config",))
    target = str(ledger["target"])
    if expected_target is not None and expected_target != target:
        raise ContainerdStepError(f"gpunode changed {target}, not {expected_target}",
                                  f"run 'gpunode containerd revert --config {target}'")
    current = _read_config(host, target)
    untouched = hashlib.sha256(current.encode()).hexdigest() == ledger.get("written_sha256")
    notes: list[str] = []
    saved = _snapshot(host, (target, DROPIN, LEDGER, IMPORT_FILE))
    if ledger.get("copied_from") and untouched:
        host.remove(target)
        notes.append(f"remove {target} (gpunode's copy of {ledger['copied_from']})")
    elif ledger.get("backup") and untouched and host.exists(ledger["backup"]):
        host.write_atomic(target, host.read_bytes(ledger["backup"]))
        notes.append(f"restore {target} from {ledger['backup']}")
    else:
        changes = tuple(edit.Change(tuple(c["path"]), c["before"], c["after"])
                        for c in ledger["changes"])
        result = edit.revert(current, ledger.get("added_runtime"), changes, host.display(target))
        host.write_atomic(target, result.text.encode())
        notes += [f"{target}: undo {line}" for line in result.describe()]
        if ledger.get("copied_from"):
            notes.append(f"keep {target} and {DROPIN}: the file was changed since gpunode "
                         "wrote it")
            ledger["dropin"] = None
    if ledger.get("backup") and host.exists(ledger["backup"]) and untouched:
        host.remove(ledger["backup"])
    if ledger.get("import_file"):
        host.remove(str(ledger["import_file"]))
        notes.append(f"remove {ledger['import_file']}")
    if ledger.get("dropin"):
        host.remove(DROPIN)
        notes.append(f"remove {DROPIN}")
        systemd.daemon_reload()
    host.remove(LEDGER)
    restarted = False
    if systemd.active_state(CONTAINERD_UNIT) == "active":
        try:
            _restart(host, systemd, host.read_optional(target) or "", restart_timeout)
        except GpunodeError as failure:
            _restore(host, saved)
            systemd.daemon_reload()
            raise ContainerdStepError(f"containerd did not come back after the revert "
                                      f"({failure}); gpunode's config was put back") from failure
        restarted = True
    return Outcome(changed=True, restarted=restarted, target=target, descriptions=tuple(notes))
