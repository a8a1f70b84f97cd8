"""containerd as `gpunode status` sees it: which config it reads and what runtime that gives
(its own `config dump` on a live host, else gpunode's model of each version's merge), when
its daemon started, whether a gpunode change to it is pending; and the checks made of that:
`containerd_runtime`, and `<name>_running` (containerd's with its pending restart, the
kubelet's alike)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpunode.config import AgentConfig
from gpunode.containerd import discover
from gpunode.containerd.discover import CONTAINERD_UNIT
from gpunode.errors import ContainerdConfigError, GpunodeError
from gpunode.platform import systemd
from gpunode.platform.host import Host
from gpunode.status.facts import (
    FAIL,
    OK,
    WARN,
    Check,
    ContainerdFacts,
    DaemonStart,
    Failure,
    StatusFacts,
)


def config_facts(host: Host, config: AgentConfig,
                 manager: systemd.Systemd | None = None) -> ContainerdFacts:
    """The runtime as containerd sees it: its own `config dump` on a live host where the binary
    runs; else gpunode's model of its merge of the file and its imports, for each containerd
    behaviour that reads this config version (1.x replaces imported plugin tables, 2.1+ merges
    them), saying so when the answer depends on the version."""
    name = config.containerd.runtime_name
    try:
        if config.containerd.config_path:
            active = discover.ActiveConfig(config.containerd.config_path,
                                           f"containerd.config_path in {config.source}")
        else:
            active = discover.active_config(host, manager or systemd.for_host(host.is_live))
        doc = discover.load_config(host, active.path)
        version = discover.schema.config_version(doc)
        views, judge = _containerd_views(host, active, doc, version)
    except GpunodeError as exc:
        return ContainerdFacts(config_path=None, config_reason="", error=Failure.of(exc))
    except discover.schema.SchemaError as exc:  # the file's layout: containerd refuses it too
        return ContainerdFacts(config_path=None, config_reason="",
                               error=Failure(str(exc), ContainerdConfigError.code))
    main_stat = host.stat(active.path)
    answers = {view.daemon: _runtime_answer(view, name) for view in views}
    first = next(iter(answers.values()))
    uncertain = None
    if len(set(answers.values())) > 1:
        groups: dict[_Answer, list[str]] = {}
        for daemon, answer in answers.items():
            groups.setdefault(answer, []).append(
                discover.schema.behaviour(daemon).removeprefix("containerd "))
        uncertain = "; ".join(f"containerd {' and '.join(who)}: {_say(answer, name)}"
                              for answer, who in groups.items())
    from gpunode.containerd import wiring

    cdi = {view.daemon: wiring.cdi_problem(view) for view in views}
    cdi_problem = cdi_uncertain = None
    if len(set(cdi.values())) == 1:
        cdi_problem = next(iter(cdi.values()))
    else:
        cdi_uncertain = "; ".join(
            f"{discover.schema.behaviour(d)}: {why or 'injects CDI devices'}"
            for d, why in cdi.items())
    file, binary, key, default_missing, problem = first
    view = views[0]
    mtimes = [st.st_mtime for st in (main_stat, host.stat(file) if file else None)
              if st is not None]
    return ContainerdFacts(
        config_path=active.path,
        config_reason=active.reason,
        runtime_file=file,
        binary_name=binary,
        binary_ok=binary is not None and host.is_executable_file(binary),
        runtime_names=tuple(sorted(view.runtimes)),
        config_mtime=max(mtimes) if mtimes else None,
        judge=judge,
        problem=problem if uncertain is None else None,
        uncertain=uncertain,
        default_missing=default_missing if uncertain is None else None,
        binary_key=key,
        cdi_problem=cdi_problem,
        cdi_uncertain=cdi_uncertain,
    )


def daemon_start(host: Host, manager: systemd.Systemd | None = None) -> DaemonStart:
    if not host.is_live:
        return DaemonStart(unknown=f"under --root {host.root} no service manager says when "
                           "containerd started")
    manager = manager or systemd.for_host(True)
    try:
        main = manager.main_process(CONTAINERD_UNIT)
    except GpunodeError as exc:
        return DaemonStart(unknown=str(exc))
    if main is None:
        return DaemonStart(unknown=manager.unavailable_reason or f"{CONTAINERD_UNIT} has no "
                           "running main process (something else runs containerd)")
    return DaemonStart(pid=main.pid, started=main.started)


def _containerd_views(host: Host, active: discover.ActiveConfig, doc: dict[str, Any],
                      version: int) -> tuple[list[discover.schema.View], str]:
    from gpunode.containerd.edit import readers

    schema = discover.schema
    bom = discover.starts_with_bom(host, active.path)

    def effective(daemon: discover.schema.Daemon) -> discover.schema.View:
        layers = discover.load_layers(host, active.path, doc, daemon=daemon, bom=bom)
        return schema.effective(layers, daemon)

    if host.is_live:
        from gpunode.containerd.probe import CommandProbe

        binary = active.binary
        probe = CommandProbe()
        probe.prefetch(binary, active.path)  # both questions at once
        try:
            daemon = probe.version(binary)
            dumped = probe.dump(binary, active.path) if daemon is not None else None
        finally:
            probe.discard()
        if daemon is not None and dumped is not None:
            model = effective(daemon)
            view = schema.effective([schema.Layer(active.path, dumped)], daemon)
            origin = {n: model.origin.get(n, active.path) for n in view.runtimes}
            view = dataclasses.replace(view, origin=origin, problem=model.problem)
            return [view], f"containerd {daemon[0]}.{daemon[1]}'s own config dump"
        if daemon is not None:
            view = effective(daemon)
            failed = (f"'{binary} --config {active.path} config dump' failed (logged as "
                      f"containerd.dump_unavailable): {schema.show(daemon)} cannot read it")
            return [dataclasses.replace(view, problem=view.problem or failed)], schema.show(daemon)
    # A version 1 file is read by 1.x only as written; 2.x ignores its CRI settings, which
    # status says (configure edits it for 1.x: its settings mean nothing to 2.x either way).
    daemons = schema.KNOWN_BEHAVIOURS if version == 1 else readers(version, None)
    views = [effective(d) for d in daemons]
    behaviours = ", ".join(schema.behaviour(v.daemon).removeprefix("containerd ")
                           for v in views)
    return views, f"gpunode's reading of containerd {behaviours}'s merge rules"


_Answer = tuple[str | None, str | None, str, str | None, str | None]


def _runtime_answer(view: discover.schema.View, name: str) -> _Answer:
    """(file, binary, binary option, missing default runtime, problem) of one containerd view."""
    schema = discover.schema
    runtime = view.runtimes.get(name)
    default = view.default_name
    missing = None if default in view.runtimes or view.problem else default
    if runtime is None:
        return None, None, "BinaryName", missing, view.problem
    file = view.origin.get(name) or None
    return (file, schema.runtime_binary(runtime), schema.binary_key(runtime) or "BinaryName",
            missing, view.problem)


def _say(answer: _Answer, name: str) -> str:
    file, binary, key, missing, problem = answer
    if problem:
        return problem
    text = f"runtime '{name}' runs {binary} ({file})" if binary else (
        f"runtime '{name}' has no options.{key}" if file else f"no runtime '{name}'")
    return text + (f", and the default runtime '{missing}' is gone" if missing else "")


def pending_change(host: Host) -> bool | str:
    """A change to containerd's config is pending: True; the lock holder ("pid 12, gpunode
    boot") when a gpunode command is making it right now (the node lock, probed without
    waiting); False when none is."""
    from gpunode.containerd import journal

    try:
        pending = journal.pending(host)
    except GpunodeError:
        pending = True  # something is at the journal's path: not gpunode's to judge, not clean
    if not pending:
        return False
    from gpunode.platform import nodelock  # only then: it names every file gpunode writes

    return nodelock.probe(host) or True


def runtime_check(facts: StatusFacts) -> Check:
    check = (_cdi_as_written(facts) if facts.gpu_access == "cdi"
             else _containerd_runtime_as_written(facts))
    if not facts.containerd_interrupted:
        return check
    from gpunode.containerd.journal import JOURNAL

    if isinstance(facts.containerd_interrupted, str):
        return Check(check.name, FAIL if check.state == FAIL else WARN,
                     f"{check.detail}; a gpunode command ({facts.containerd_interrupted}) is "
                     "changing containerd's config right now",
                     "wait for it to finish, then run 'gpunode status' again")
    return Check(check.name, FAIL if check.state == FAIL else WARN,
                 f"{check.detail}; an interrupted gpunode change to containerd's config is "
                 f"pending ({JOURNAL})",
                 "run 'gpunode containerd configure' (or 'gpunode boot'): it rolls the "
                 "interrupted change back first, then configures")


def _cdi_as_written(facts: StatusFacts) -> Check:
    """CDI mode: no runtime is asked for; containerd itself must inject CDI devices."""
    from gpunode.containerd.wiring import NO_CDI_HINT

    c = facts.containerd
    if c.error is not None:
        return Check("containerd_runtime", FAIL, c.error.message,
                     c.error.hint or "fix or restore containerd's config file", c.error.code)
    where = f"{c.config_path} ({c.config_reason})"
    if c.cdi_problem is not None:
        hint = NO_CDI_HINT if "no CDI support" in c.cdi_problem else (
            "run 'gpunode containerd configure' (gpunode boot does this at boot): it writes "
            "enable_cdi where containerd needs it")
        return Check("containerd_runtime", FAIL, f'containerd.gpu_access = "cdi", but '
                     f"{c.cdi_problem} (judged by {c.judge}); {where}", hint)
    if c.cdi_uncertain is not None:
        return Check("containerd_runtime", WARN, "whether containerd injects CDI devices "
                     f"depends on its version, which gpunode cannot ask here: "
                     f"{c.cdi_uncertain}",
                     "run 'gpunode status' on the live host (it asks containerd itself)")
    return Check("containerd_runtime", OK, 'containerd.gpu_access = "cdi": containerd injects '
                 f"CDI devices itself, no NVIDIA runtime needed; as {c.judge} has it; {where}")


def _containerd_runtime_as_written(facts: StatusFacts) -> Check:
    c = facts.containerd
    name = facts.runtime_name
    if c.error is not None:
        # The error's own hint, as boot's record and `containerd configure` give it.
        return Check("containerd_runtime", FAIL, c.error.message,
                     c.error.hint or "fix or restore containerd's config file; containerd will "
                     "not start with it either", c.error.code)
    where = f"{c.config_path} ({c.config_reason})"
    if c.problem is not None:
        return Check("containerd_runtime", FAIL, f"{c.problem} (judged by {c.judge})",
                     "fix containerd's config: gpunode edits only a config containerd reads as "
                     "written")
    if c.uncertain is not None:
        return Check("containerd_runtime", WARN, "what containerd makes of "
                     f"{c.config_path} and its imports depends on its version, which gpunode "
                     f"cannot ask here: {c.uncertain}",
                     "run 'gpunode status' on the live host (it asks containerd's own "
                     "'config dump'), or give the files settings every version reads alike")
    if c.runtime_file is None:
        have = ", ".join(c.runtime_names) or "none"
        hint = ("run 'gpunode containerd configure' (gpunode boot does this at boot); "
                "'--dry-run' shows the change first")
        if (c.config_path or "").startswith("/usr/"):
            hint = (f"{c.config_path} is on read-only /usr: 'gpunode containerd configure' copies "
                    "it to /etc/containerd/config.toml, adds the runtime there and points "
                    "containerd at the copy with a containerd.service.d drop-in")
        return Check("containerd_runtime", FAIL,
                     f"no '{name}' runtime in {where}; runtimes: {have}", hint)
    if c.binary_name is None:
        return Check("containerd_runtime", FAIL, f"runtime '{name}' in {c.runtime_file} has no "
                     f"options.{c.binary_key}, so it would run plain runc",
                     f"set options.{c.binary_key} to the NVIDIA container runtime")
    if not c.binary_ok:
        return Check("containerd_runtime", FAIL, f"runtime '{name}' runs {c.binary_name}, which "
                     "is not an executable file on this host",
                     "install the NVIDIA container toolkit, or point BinaryName at its "
                     "nvidia-container-runtime")
    if c.default_missing is not None:
        have = ", ".join(c.runtime_names) or "none"
        return Check("containerd_runtime", FAIL, f"containerd's default runtime "
                     f"'{c.default_missing}' is not among its runtimes ({have}) in {where}: "
                     "containerd 1.x then refuses to start its CRI plugin",
                     f"define runtime '{c.default_missing}' (containerd 1.x drops its built-in "
                     "runc once a file sets any runtime), or set default_runtime_name")
    judged = f"; as {c.judge} has it" if c.judge else ""
    cdi = ("; CDI devices injected too" if c.cdi_problem is None and c.cdi_uncertain is None
           else f"; no CDI by name ({c.cdi_problem})" if c.cdi_problem else "")
    return Check("containerd_runtime", OK, f"runtime '{name}' → {c.binary_name} in "
                 f"{c.runtime_file}{judged}; {where}{cdi}")


def process_check(facts: StatusFacts, name: str) -> Check:
    pids = facts.processes.running.get(name, [])
    if not pids:
        return Check(f"{name}_running", WARN, f"{name} is not running",
                     f"'systemctl status {name}' says why; during boot it starts after gpunode")
    running = f"{name} running (pid {', '.join(map(str, pids))})"
    if name == "containerd" and facts.containerd.config_mtime is not None:
        return _restart_pending(facts, pids, running)
    return Check(f"{name}_running", OK, running)


def _restart_pending(facts: StatusFacts, pids: list[int], running: str) -> Check:
    """Whether containerd runs with an older config than the file: only systemd's own record of
    when it started its main process can tell, to the microsecond."""
    start = facts.containerd_start
    changed = facts.containerd.config_mtime
    if start.started is None or start.pid not in pids:
        why = start.unknown if start.started is None else (
            f"{CONTAINERD_UNIT}'s main process is pid {start.pid}, not a running containerd")
        return Check("containerd_running", OK, f"{running}; cannot tell whether a restart is "
                     f"pending: {why}")
    if changed is not None and changed > start.started:
        return Check("containerd_running", WARN, f"{running}, but "
                     f"{facts.containerd.config_path} changed after it started: a restart is "
                     "pending",
                     "run 'systemctl restart containerd' when pods on this node can take it")
    return Check("containerd_running", OK, running)
