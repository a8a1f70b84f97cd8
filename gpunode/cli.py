"""The `gpunode` command line: parse, load the agent config, run one command, map errors to exits.

Exit codes are a contract (README, "Command line"): 0 success, 1 a failed step or a node that is
not ready, 2 a usage error or an invalid agent config.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from gpunode import __version__, log
from gpunode.config import AgentConfig, load_config
from gpunode.errors import ConfigError, GpunodeError, UsageError
from gpunode.host import Host

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_POOL, DEFAULT_INSTANCE_TYPE = "gpu", "Standard_NC4as_T4_v3"

CONFIG_HINT = ("correct the agent config (README, 'Agent config', lists every key and its "
               "valid values), or name another file with --config")


class ArgumentsError(UsageError):
    """argparse refused the command line; main() reports it like any usage error."""

    def __init__(self, message: str, usage: str, prog: str) -> None:
        self.usage = usage
        self.prog = prog
        super().__init__(message, hint=f"see '{prog} --help'")


class _Parser(argparse.ArgumentParser):
    """argparse, but a refused command line is raised (main() logs it in the chosen format)
    instead of printed and exited on the spot. Subcommand parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentsError(message, self.format_usage(), self.prog)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but words nobody understood are blamed on the (sub)command they
        follow, whose --help lists what it takes."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            words = [getattr(parsed, "command", None), getattr(parsed, "action", None)]
            prog = " ".join([self.prog, *(w for w in words if w)])
            raise ArgumentsError(f"unrecognized arguments: {' '.join(extras)}",
                                 self.format_usage(), prog)
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpunode", description="Make an NVIDIA GPU node ready "
                     "for Kubernetes at boot, and explain its state.")
    parser.add_argument("--version", action="version", version=f"gpunode {__version__}")
    parser.add_argument("--root", default="/", metavar="DIR",
                        help="host root to observe and change (default: /)")
    parser.add_argument("--config", metavar="FILE",
                        help="agent config (default: <root>/etc/gpunode/config.toml; missing "
                        "means defaults)")
    parser.add_argument("--log-format", choices=("console", "json"),
                        help="log format (default: console on a TTY, json otherwise)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    detect = commands.add_parser("detect", help="list NVIDIA PCI functions")
    detect.add_argument("--json", action="store_true", help="print a JSON document")
    detect.set_defaults(run=_detect)

    status = commands.add_parser("status", help="live checks and the last boot record")
    status.add_argument("--json", action="store_true", help="print a JSON document")
    status.set_defaults(run=_status)

    plan = commands.add_parser("plan", help="what 'boot' would change; touches nothing")
    plan.add_argument("--json", action="store_true", help="print a JSON document")
    plan.set_defaults(run=_plan)

    boot = commands.add_parser("boot", help="the whole pipeline (what gpunode.service runs)")
    boot.set_defaults(run=_boot)

    label = commands.add_parser("label", help="label the own Node and set its GPUReady "
                                "condition, with the kubelet's credentials")
    label.add_argument("--dry-run", action="store_true",
                       help="print the labels and condition; do not contact the API")
    label.add_argument("--json", action="store_true", help="print a JSON document")
    label.add_argument("--registration", choices=("cluster-azure", "kubeadm", "kubelet-flags"),
                       help="print the taints and labels to set at registration in that form "
                       "(a kubelet may not change its taints later)")
    label.add_argument("--pool", help="node pool name (--registration cluster-azure; "
                       f"default {DEFAULT_POOL})")
    label.add_argument("--instance-type", help="instance type (--registration cluster-azure; "
                       f"default {DEFAULT_INSTANCE_TYPE})")
    label.set_defaults(run=_label)

    ignition = commands.add_parser("ignition", help="render the node snippet that installs "
                                   "gpunode (sysext, units, config)")
    ignition.add_argument("--format", choices=("butane", "ignition", "clc"), default="butane")
    ignition.add_argument("--sysext-url", required=True, metavar="URL",
                          help="where nodes download gpunode-<version>-x86-64.raw")
    ignition.add_argument("--sysext-sha512", required=True, metavar="HEX",
                          help="the image's sha512 (make sysext writes it beside the image)")
    ignition.add_argument("--agent-config", metavar="FILE",
                          help="agent config to install as /etc/gpunode/config.toml (checked "
                          "first)")
    ignition.add_argument("--units", metavar="DIR", help="directory holding the units "
                          "(default: units/ of this checkout, else /usr/lib/systemd/system)")
    ignition.set_defaults(run=_ignition)

    driver = commands.add_parser("driver", help="the driver step alone")
    driver_actions = driver.add_subparsers(dest="action", required=True, metavar="ACTION")
    driver_actions.add_parser("load", help="make the NVIDIA modules loaded (and device nodes)"
                              ).set_defaults(run=_driver_load)
    driver_actions.add_parser("build", help="build the modules for the running kernel into "
                              "the cache (once per kernel, driver and flavour)"
                              ).set_defaults(run=_driver_build)
    driver_status = driver_actions.add_parser("status", help="what the driver step would do, "
                                              "and the driver checks")
    driver_status.add_argument("--json", action="store_true", help="print a JSON document")
    driver_status.set_defaults(run=_driver_status)

    containerd = commands.add_parser("containerd", help="the container runtime step alone")
    actions = containerd.add_subparsers(dest="action", required=True, metavar="ACTION")
    configure = actions.add_parser("configure", help="add or reconcile the nvidia runtime")
    configure.add_argument("--config", dest="containerd_config", metavar="PATH",
                           help="containerd config file to edit in place (default: the one "
                           "containerd.service uses)")
    configure.add_argument("--runtime-name", metavar="NAME")
    configure.add_argument("--runtime-path", metavar="PATH")
    configure.add_argument("--set-as-default", action="store_true", default=None)
    configure.add_argument("--enable-cdi", action="store_true", default=None)
    configure.add_argument("--force", action="store_true",
                           help="configure even if the runtime binary does not exist")
    configure.add_argument("--dry-run", action="store_true",
                           help="print a unified diff and write nothing")
    configure.set_defaults(run=_containerd_configure)
    revert = actions.add_parser("revert", help="remove what gpunode added")
    revert.add_argument("--config", dest="containerd_config", metavar="PATH",
                        help="the file gpunode changed (default: the one its ledger names)")
    revert.set_defaults(run=_containerd_revert)
    return parser


Command = Callable[[Host, AgentConfig, argparse.Namespace], int]


Settings = Callable[[AgentConfig, argparse.Namespace], AgentConfig]


def _changes_node(name: str, settings: Settings | None = None) -> Callable[[Command], Command]:
    """The command holds the node lock (gpunode/nodelock.py) while it runs; `--dry-run`
    changes nothing and takes none. `boot` waits longer for it than the others.

    `settings` checks the command line and applies it to the agent config before the lock is
    taken: a refused argument (exit 2) is refused before any work, so it leaves the root as it
    was — not even /run/gpunode/lock is made."""

    def wrap(command: Command) -> Command:
        @functools.wraps(command)
        def locked(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
            from gpunode import nodelock

            if settings is not None:
                config = settings(config, args)
            if getattr(args, "dry_run", False):
                return command(host, config, args)
            wait = nodelock.BOOT_WAIT_SECONDS if name == "boot" else nodelock.WAIT_SECONDS
            with nodelock.held(host, name, wait):
                return command(host, config, args)

        return locked

    return wrap


def _detect(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.detect import detect, require_decided

    with log.step("detect") as fields:
        detection = detect(host, use_udev=config.detect.use_udev)
        fields.update(gpus=len(detection.gpus), functions=len(detection.functions))
    if args.json:
        _print_json({"schema_version": 1, "root": str(host.root), **detection.to_json()})
    else:
        from gpunode import render

        print(render.detection(detection))
    # A listing answers with what it found (exit 0 is detect's documented contract): a possible
    # GPU nobody could identify is in `undecided` and `problems`, and said once more as a
    # warning; boot, plan, status and the driver commands are the ones that refuse it.
    try:
        require_decided(detection)
    except GpunodeError as exc:
        log.get().warning("detect.undecided", exc=exc)
    return EXIT_OK


def _status(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import status

    with log.step("status") as fields:
        facts = status.observe(host, config)
        report = status.evaluate(facts)
        fields.update(verdict=report.verdict,
                      failed=[c.name for c in report.checks if c.state == status.FAIL])
    if args.json:
        _print_json(status.to_json(facts, report))
    else:
        from gpunode import render

        print(render.status(report, str(host.root), colour=sys.stdout.isatty()))
    return EXIT_OK if report.ready else EXIT_FAILED


def _plan(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """Exit 0 whenever it could plan, even a boot that would fail: that is the answer."""
    from gpunode import boot

    with log.step("plan") as fields:
        the_plan = boot.plan(host, config, boot.adapters_for(host, config))
        actions, problems = the_plan.actions, the_plan.problems
        fields.update(actions=len(actions), problems=[p.step for p in problems])
    if args.json:
        _print_json({"schema_version": 1, "root": str(host.root),
                     "gpu_count": len(the_plan.detection.gpus), "changes": bool(actions),
                     "actions": [{"step": a.step, "description": a.description}
                                 for a in actions],
                     "would_fail": bool(problems),
                     "problems": [dataclasses.asdict(p) for p in problems]})
    elif not the_plan.detection.gpus:
        print("no NVIDIA GPU: nothing to do")
    elif not actions and not problems:
        print("nothing to change: the node is already configured")
    else:
        lines = [f"{a.step}: {a.description}" for a in actions]
        for p in problems:
            lines.append(f"{p.step}: would fail: {p.error}")
            if p.hint:
                lines.append(f"  hint: {p.hint}")
        print("\n".join(lines))
    return EXIT_OK


@_changes_node("boot")
def _boot(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import boot

    run = boot.boot(host, config, boot.adapters_for(host, config))
    log.get().info("boot.done", outcome=run.outcome, steps=[s["name"] for s in run.steps])
    return EXIT_FAILED if run.outcome == "failed" else EXIT_OK


def _label(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.kube import step

    if args.registration:
        return _registration(config, args)
    _pool_settings(args)  # refused without --registration cluster-azure
    with log.step("label", dry_run=args.dry_run) as fields:
        want = step.desired(host, config)
        fields.update(node=want.node, labels=len(want.labels),
                      condition=want.condition.status)
        # A node whose GPUs nobody can identify is labelled anyway: GPUReady=False with the
        # failing checks, and no nvidia.com/gpu.* labels. Refusing would leave the Node as the
        # last boot labelled it (perhaps GPUReady=True), so the cluster would keep sending GPU
        # pods to a node gpunode cannot vouch for; "no GPU, nothing to label" would hide the
        # problem. The command still exits 1 (after labelling), naming the problem.
        if want.gpu is False:
            if args.json:  # the same document, saying there is nothing to do
                _print_json({"schema_version": 1, "node": want.node, "gpu": False,
                             "labels": {}, "condition": None, "undecided": None,
                             "message": NOTHING_TO_LABEL,
                             **({} if args.dry_run else {"labels_changed": False,
                                                         "condition_changed": False,
                                                         "calls": []})})
            else:
                print(NOTHING_TO_LABEL)
            return EXIT_OK
        if args.dry_run:
            if args.json:
                _print_json({"schema_version": 1, **want.to_json()})
            else:
                print("\n".join([f"node {want.node}", *(f"{k}={v}" for k, v in
                                                         sorted(want.labels.items())),
                                  f"condition GPUReady={want.condition.status} "
                                  f"({want.condition.reason}): {want.condition.message}"]))
            return _undecided_exit(want.undecided)
        outcome = step.apply(host, config, want)
        fields.update(labels_changed=outcome.labels_changed,
                      condition_changed=outcome.condition_changed, calls=list(outcome.calls))
    if args.json:
        _print_json({"schema_version": 1, **want.to_json(),
                     "labels_changed": outcome.labels_changed,
                     "condition_changed": outcome.condition_changed,
                     "calls": list(outcome.calls)})
    else:
        print(f"node {outcome.node}: labels {'updated' if outcome.labels_changed else 'current'}"
              f", GPUReady={want.condition.status} "
              f"{'updated' if outcome.condition_changed else 'current'}")
    return _undecided_exit(want.undecided)


NOTHING_TO_LABEL = "no NVIDIA GPU: nothing to label"


def _undecided_exit(undecided: str | None) -> int:
    """Exit 0, or — the node's GPUs cannot be identified — raise the refusal boot and
    `driver load` give, after the honest labels were printed or set."""
    if undecided is None:
        return EXIT_OK
    from gpunode.detect import UndecidedError

    raise UndecidedError(f"labelled GPUReady=False: {undecided}")


def _registration(config: AgentConfig, args: argparse.Namespace) -> int:
    """The registration form on stdout: YAML (the flags on one line for kubelet-flags), or
    with --json the very same document as JSON (kubelet-flags: a JSON array of the flags)."""
    from gpunode.kube import registration

    k = config.kubernetes
    pool, instance_type = _pool_settings(args)
    if args.registration == "kubelet-flags":
        flags = registration.kubelet_flags(k.taints, dict(k.labels))
        if args.json:
            _print_json(flags)
        else:
            print(" ".join(flags))
        return EXIT_OK
    document = (registration.cluster_azure(pool, instance_type, k.taints, dict(k.labels))
                if args.registration == "cluster-azure"
                else registration.kubeadm(k.taints, dict(k.labels)))
    if args.json:
        _print_json(document)
        return EXIT_OK
    import yaml

    print(yaml.safe_dump(document, sort_keys=False), end="")
    return EXIT_OK


def _pool_settings(args: argparse.Namespace) -> tuple[str, str]:
    """--pool and --instance-type, checked (exit 2): they name a cluster-azure node pool, and
    mean nothing to the other forms, so they are refused there rather than ignored."""
    from gpunode.kube import registration

    given = [flag for flag, value in (("--pool", args.pool),
                                      ("--instance-type", args.instance_type))
             if value is not None]
    if args.registration != "cluster-azure":
        if given:
            form = (f"--registration {args.registration}" if args.registration
                    else "label without --registration")
            raise UsageError(f"{' and '.join(given)}: only --registration cluster-azure takes "
                             f"{'it' if len(given) == 1 else 'them'}, not {form}")
        return DEFAULT_POOL, DEFAULT_INSTANCE_TYPE
    pool = DEFAULT_POOL if args.pool is None else args.pool
    instance_type = DEFAULT_INSTANCE_TYPE if args.instance_type is None else args.instance_type
    for flag, value, check in (("--pool", pool, registration.pool_problem),
                               ("--instance-type", instance_type,
                                registration.instance_type_problem)):
        problem = check(value)
        if problem is not None:
            raise UsageError(f"{flag} {registration.shown(value)}: {problem}")
    return pool, instance_type


def _ignition(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """Everything is checked before anything is printed: stdout gets a whole snippet or
    nothing."""
    from gpunode import ignition

    agent_config = None
    if args.agent_config:
        agent_config = _snippet_agent_config(str(Path(args.agent_config).absolute()))
    snippet = ignition.snippet(args.sysext_url, args.sysext_sha512, agent_config,
                               Path(args.units) if args.units else None)
    text = ignition.render(snippet, args.format)
    if args.format == "clc":
        if len(text) > ignition.CLC_LIMIT:
            raise UsageError(f"the Container Linux Config is {len(text)} characters, over "
                             f"Cluster API's additionalConfig limit of {ignition.CLC_LIMIT}",
                             "shorten the agent config (comments, defaults), or deliver it "
                             "another way (format ignition or butane)")
        log.get().info("ignition.clc_size", characters=len(text), limit=ignition.CLC_LIMIT)
    sys.stdout.write(text)
    return EXIT_OK


def _snippet_agent_config(path: str) -> str:
    """The agent config to install: a UTF-8 regular file read through the Host, and refused
    now, exactly as the node would refuse it, if it is not valid."""
    from gpunode import ignition

    try:
        text = ignition.read_input(Host(), path)
    except ignition.InputRefused as exc:
        raise ConfigError(path, None, exc.reason) from exc
    except GpunodeError as exc:  # the Host could not read it
        raise ConfigError(path, None, f"cannot be read: {exc}") from exc
    load_config(Host(), path)
    return text


@_changes_node("driver load")
def _driver_load(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import boot
    from gpunode.detect import detect_decided
    from gpunode.driver import step

    adapters = boot.adapters_for(host, config)
    with log.step("driver") as fields:
        detection = detect_decided(host, use_udev=config.detect.use_udev)
        the_plan = step.plan(host, config.driver, detection, adapters.kmod)
        fields.update(strategy=the_plan.choice.strategy, action=the_plan.choice.action)
        outcome = step.apply(host, the_plan, config.driver, adapters.kmod, adapters.build)
        fields.update(outcome.fields())
    print("\n".join([*the_plan.describe(), *outcome.nodes]))
    return EXIT_OK


@_changes_node("driver build")
def _driver_build(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import boot
    from gpunode.detect import detect_decided
    from gpunode.driver import step

    adapters = boot.adapters_for(host, config)
    with log.step("driver.build") as fields:
        kernel = step.kernel_release(host)
        gpus = detect_decided(host, use_udev=config.detect.use_udev).gpus
        inputs = step.build_inputs(host, config.driver, kernel, gpus)
        result, pruned = step.build_cached(host, inputs, adapters.build)
        fields.update(entry=result.entry.path, cache_hit=result.cache_hit, pruned=pruned)
    print(f"{result.entry.path} ({'cached' if result.cache_hit else 'built'})")
    return EXIT_OK


def _driver_status(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import boot, status
    from gpunode.detect import undecided_reason
    from gpunode.driver import step

    facts = status.observe(host, config, contact_api=False)
    report = status.evaluate(facts)
    names = ("gpus", "pci_scan", "nouveau", "gpu_binding", "driver", "driver_gpus",
             "device_nodes")
    checks = [c for c in report.checks if c.name in names]
    plan_lines: list[str] = []
    # The detection status made, refused as `driver load` refuses it (detect.detect_decided).
    plan_error = undecided_reason(facts.detection, facts.detection_error)
    if plan_error is None and facts.detection is not None:
        try:
            the_plan = step.plan(host, config.driver, facts.detection,
                                 boot.adapters_for(host, config).kmod)
            plan_lines = the_plan.describe()
        except GpunodeError as exc:
            plan_error = str(exc)
    ready = not any(c.state == status.FAIL for c in checks)
    if args.json:
        _print_json({"schema_version": 1, "root": str(host.root), "ready": ready,
                     "plan": plan_lines, "plan_error": plan_error,
                     "checks": [dataclasses.asdict(c) for c in checks]})
    else:
        from gpunode import render

        sub = status.Report(tuple(checks), "ready" if ready else "not-ready")
        print(render.status(sub, str(host.root), colour=sys.stdout.isatty()))
        print("plan: " + ("; ".join(plan_lines) if plan_lines else f"cannot plan: {plan_error}"))
    return EXIT_OK if ready else EXIT_FAILED


def _containerd_settings(config: AgentConfig, args: argparse.Namespace) -> AgentConfig:
    """The agent config with this command line's overrides applied, checked by the same rules
    as the agent config's own keys (a name containerd rejects, a relative path: exit 2)."""
    from gpunode.config import _absolute_path, _runtime_name

    _check_config_flag(args)
    for flag, value, check in (("--runtime-name", args.runtime_name, _runtime_name),
                               ("--runtime-path", args.runtime_path, _absolute_path)):
        problem = check(value) if value is not None else None
        if problem is not None:
            raise UsageError(f"{flag} {value!r}: {problem}")
    overrides = {key: value for key, value in (
        ("runtime_name", args.runtime_name), ("runtime_path", args.runtime_path),
        ("set_as_default", args.set_as_default), ("enable_cdi", args.enable_cdi))
        if value is not None}
    return dataclasses.replace(config, containerd=dataclasses.replace(config.containerd,
                                                                       **overrides))


def _check_config_flag(args: argparse.Namespace) -> None:
    """containerd's --config names a host path (under --root): an empty or relative one names
    no file gpunode could edit or revert, and must not quietly mean the default."""
    from gpunode.config import _absolute_path

    value = args.containerd_config
    problem = _absolute_path(value) if value is not None else None
    if problem is not None:
        raise UsageError(f"containerd --config {value!r}: {problem}")


def _revert_settings(config: AgentConfig, args: argparse.Namespace) -> AgentConfig:
    _check_config_flag(args)
    return config


@_changes_node("containerd configure", _containerd_settings)
def _containerd_configure(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """`config` has the command line's overrides applied (_containerd_settings)."""
    from gpunode import systemd
    from gpunode.containerd import step

    manager = systemd.for_host(host.is_live)
    with log.step("containerd", dry_run=args.dry_run) as fields:
        if args.dry_run:  # an interrupted change pending: the rollback configure starts with
            preview = step.preview(host, config.containerd, manager, args.containerd_config,
                                   force=args.force)
            # Nothing is written: what would change is planned_change, as in a real run's event.
            fields.update(config=preview.target, planned_change=preview.changed, changed=False)
            print(preview.diff(), end="")
            return EXIT_OK
        # The step fills config, planned_change and changed as they happen (step.apply): a
        # failed write's event says changed: false.
        _, outcome = step.configure(host, config.containerd, manager,
                                    config.containerd.restart_timeout, args.containerd_config,
                                    force=args.force, report=fields)
        fields.update(restarted=outcome.restarted)
    print("\n".join(outcome.descriptions))
    return EXIT_OK


@_changes_node("containerd revert", _revert_settings)
def _containerd_revert(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import systemd
    from gpunode.containerd import step

    with log.step("containerd.revert") as fields:
        outcome = step.revert(host, systemd.for_host(host.is_live),
                              config.containerd.restart_timeout, args.containerd_config)
        fields.update(changed=outcome.changed, restarted=outcome.restarted)
    print("\n".join(outcome.descriptions))
    return EXIT_OK


def _print_json(document: object) -> None:
    print(json.dumps(document, indent=2, sort_keys=False))


def _host(root: str) -> Host:
    if not root:
        raise UsageError("--root is empty: name the node's root directory (/ for this machine)")
    path = Path(root)
    if not path.is_absolute():
        path = Path.cwd() / path
    try:
        is_dir = path.is_dir()
        resolved = path.resolve()
    except (OSError, ValueError, RuntimeError) as exc:
        raise UsageError(f"--root {root}: cannot be used ({exc})") from None
    if not is_dir:
        raise UsageError(f"--root {root}: not a directory")
    return Host(resolved)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except ArgumentsError as exc:
        chosen = _log_format(argv)
        log.configure(chosen)
        return _refused(exc, None, _console(chosen))
    log.configure(args.log_format)
    run: Callable[[Host, AgentConfig, argparse.Namespace], int] = args.run
    try:
        host = _host(args.root)
        config = _load_config(host, args.config)
        log.configure(args.log_format, config.log.level)
        return run(host, config, args)
    except (ConfigError, UsageError) as exc:
        return _refused(exc, args.command, _console(args.log_format))
    except GpunodeError as exc:
        if log.LOGGED not in getattr(exc, "__notes__", ()):
            log.get().error("command.failed", command=args.command, exc=exc)
        return EXIT_FAILED


def _refused(exc: UsageError | ConfigError, command: str | None, console: bool) -> int:
    """A usage or agent-config error: exit 2, on a console the plain `gpunode: …` line
    (argparse's usage first, as it prints it) and a hint line, else one JSON event."""
    if log.LOGGED in getattr(exc, "__notes__", ()):
        return EXIT_USAGE  # its step already logged it (in the chosen format)
    if not exc.hint:
        exc.hint = CONFIG_HINT if isinstance(exc, ConfigError) else "see 'gpunode --help'"
    if console:
        if isinstance(exc, ArgumentsError):
            print(f"{exc.usage}{exc.prog}: error: {exc}", file=sys.stderr)
        else:
            print(f"gpunode: {exc}", file=sys.stderr)
        print(f"gpunode: hint: {exc.hint}", file=sys.stderr)
        return EXIT_USAGE
    fields: dict[str, object] = {"command": command, "exit_code": EXIT_USAGE}
    if isinstance(exc, ConfigError):
        fields.update(file=exc.file, key=exc.key, line=exc.line)
    if isinstance(exc, ArgumentsError):
        fields.update(usage=exc.usage.strip())
    log.get().error("command.refused", exc=exc, **fields)
    return EXIT_USAGE


def _log_format(argv: Sequence[str]) -> str | None:
    """--log-format as given, read without argparse (which just refused the command line);
    None (console on a TTY, JSON otherwise) when absent or not a valid choice."""
    for i, word in enumerate(argv):
        if word == "--":
            break
        name, eq, value = word.partition("=")
        if len(name) >= 3 and "--log-format".startswith(name):
            if not eq:
                value = argv[i + 1] if i + 1 < len(argv) else ""
            return value if value in ("console", "json") else None
    return None


def _console(log_format: str | None) -> bool:
    """As log.configure decides: console when asked, or by default on a terminal."""
    return log_format == "console" or (log_format is None and sys.stderr.isatty())


def _load_config(host: Host, config: str | None) -> AgentConfig:
    """--config names a file on the machine gpunode runs on, not under --root."""
    if config is None:
        return load_config(host)
    return load_config(Host(), str(Path(config).absolute()))


if __name__ == "__main__":
    sys.exit(main())
