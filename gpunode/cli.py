"""The `gpunode` command line: parse, load the agent config, run one command, map errors to exits.

Exit codes are a contract (README, "Command line"): 0 success, 1 a failed step or a node that is
not ready, 2 a usage error or an invalid agent config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gpunode import __version__, log
from gpunode.config import AgentConfig, load_config
from gpunode.errors import ConfigError, GpunodeError, UsageError
from gpunode.host import Host

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpunode", description="Make an NVIDIA GPU node ready "
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
    label.add_argument("--pool", default="gpu", help="node pool name (--registration "
                       "cluster-azure)")
    label.add_argument("--instance-type", default="Standard_NC4as_T4_v3",
                       help="instance type (--registration cluster-azure)")
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


def _detect(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.detect import detect

    with log.step("detect") as fields:
        detection = detect(host, use_udev=config.detect.use_udev)
        fields.update(gpus=len(detection.gpus), functions=len(detection.functions))
    if args.json:
        _print_json({"schema_version": 1, "root": str(host.root), **detection.to_json()})
    else:
        from gpunode import render

        print(render.detection(detection))
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
    from gpunode import boot

    with log.step("plan") as fields:
        detection, actions = boot.plan(host, config, boot.adapters_for(host, config))
        fields.update(actions=len(actions))
    if args.json:
        _print_json({"schema_version": 1, "root": str(host.root),
                     "gpu_count": len(detection.gpus), "changes": bool(actions),
                     "actions": [{"step": a.step, "description": a.description}
                                 for a in actions]})
    elif not detection.gpus:
        print("no NVIDIA GPU: nothing to do")
    elif not actions:
        print("nothing to change: the node is already configured")
    else:
        print("\n".join(f"{a.step}: {a.description}" for a in actions))
    return EXIT_OK


def _boot(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import boot

    run = boot.boot(host, config, boot.adapters_for(host, config))
    log.get().info("boot.done", outcome=run.outcome, steps=[s["name"] for s in run.steps])
    return EXIT_FAILED if run.outcome == "failed" else EXIT_OK


def _label(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.kube import step

    if args.registration:
        return _registration(config, args)
    with log.step("label", dry_run=args.dry_run) as fields:
        want = step.desired(host, config)
        fields.update(node=want.node, labels=len(want.labels),
                      condition=want.condition.status)
        if not any(k.startswith("nvidia.com/gpu.present") for k in want.labels):
            print("no NVIDIA GPU: nothing to label")
            return EXIT_OK
        if args.dry_run:
            if args.json:
                _print_json({"schema_version": 1, **want.to_json()})
            else:
                print("\n".join([f"node {want.node}", *(f"{k}={v}" for k, v in
                                                         sorted(want.labels.items())),
                                  f"condition GPUReady={want.condition.status} "
                                  f"({want.condition.reason}): {want.condition.message}"]))
            return EXIT_OK
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
    return EXIT_OK


def _registration(config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.kube import registration

    k = config.kubernetes
    if args.registration == "kubelet-flags":
        print(" ".join(registration.kubelet_flags(k.taints, dict(k.labels))))
        return EXIT_OK
    import yaml

    document = (registration.cluster_azure(args.pool, args.instance_type, k.taints,
                                           dict(k.labels))
                if args.registration == "cluster-azure"
                else registration.kubeadm(k.taints, dict(k.labels)))
    print(yaml.safe_dump(document, sort_keys=False), end="")
    return EXIT_OK


def _ignition(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import ignition

    agent_config = None
    if args.agent_config:
        agent_config = Path(args.agent_config).read_text()
        load_config(Host(), str(Path(args.agent_config).absolute()))  # refuse a bad one now
    snippet = ignition.snippet(args.sysext_url, args.sysext_sha512, agent_config,
                               Path(args.units) if args.units else None)
    text = ignition.render(snippet, args.format)
    sys.stdout.write(text)
    if args.format == "clc":
        print(f"gpunode: {len(text)} characters (Cluster API's additionalConfig limit: "
              f"{ignition.CLC_LIMIT})", file=sys.stderr)
        if len(text) > ignition.CLC_LIMIT:
            raise UsageError(f"the Container Linux Config is {len(text)} characters, over "
                             f"Cluster API's {ignition.CLC_LIMIT}")
    return EXIT_OK


def _driver_load(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import boot
    from gpunode.detect import detect
    from gpunode.driver import step

    adapters = boot.adapters_for(host, config)
    with log.step("driver") as fields:
        detection = detect(host, use_udev=config.detect.use_udev)
        the_plan = step.plan(host, config.driver, detection, adapters.kmod)
        fields.update(strategy=the_plan.choice.strategy, action=the_plan.choice.action)
        outcome = step.apply(host, the_plan, config.driver, adapters.kmod, adapters.build)
        fields.update(outcome.fields())
    print("\n".join([*the_plan.describe(), *outcome.nodes]))
    return EXIT_OK


def _driver_build(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import boot
    from gpunode.detect import detect
    from gpunode.driver import build, flavour, step

    adapters = boot.adapters_for(host, config)
    with log.step("driver.build") as fields:
        kernel = step.kernel_release(host)
        gpus = detect(host, use_udev=config.detect.use_udev).gpus
        chosen = flavour.choose(gpus, config.driver.flavour, step.on_azure(host))
        b = config.driver.build
        inputs = build.BuildInputs(
            kernel=kernel, driver=config.driver.version, flavour=chosen.flavour,
            dev_container_url=b.dev_container_url, dev_container_sha512=b.dev_container_sha512,
            driver_url=b.driver_url, driver_sha256=b.driver_sha256,
            allow_unverified=b.allow_unverified)
        fetcher, builder = adapters.build
        result = build.build(host, inputs, fetcher, builder, build.host_facts(host))
        fields.update(entry=result.entry.path, cache_hit=result.cache_hit,
                      pruned=build.prune(host, build.installed_kernels(host)))
    print(f"{result.entry.path} ({'cached' if result.cache_hit else 'built'})")
    return EXIT_OK


def _driver_status(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import boot, status
    from gpunode.detect import detect
    from gpunode.driver import step

    facts = status.observe(host, config)
    report = status.evaluate(facts)
    names = ("gpus", "nouveau", "gpu_binding", "driver", "driver_gpus", "device_nodes")
    checks = [c for c in report.checks if c.name in names]
    try:
        detection = detect(host, use_udev=config.detect.use_udev)
        the_plan = step.plan(host, config.driver, detection, boot.adapters_for(host, config).kmod)
        plan_lines, plan_error = the_plan.describe(), None
    except GpunodeError as exc:
        plan_lines, plan_error = [], str(exc)
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


def _containerd_configure(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import systemd
    from gpunode.containerd import step

    config = _containerd_settings(config, args)
    manager = systemd.for_host(host.is_live)
    with log.step("containerd", dry_run=args.dry_run) as fields:
        the_plan = step.plan(host, config.containerd, manager, args.containerd_config,
                             force=args.force)
        fields.update(config=the_plan.target, changed=the_plan.changed)
        if args.dry_run:
            print(the_plan.diff(), end="")
            return EXIT_OK
        outcome = step.apply(host, the_plan, manager, config.containerd.restart_timeout)
        fields.update(restarted=outcome.restarted)
    print("\n".join(outcome.descriptions))
    return EXIT_OK


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
    path = Path(root)
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_dir():
        raise UsageError(f"--root {root}: not a directory")
    return Host(path.resolve())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log.configure(args.log_format)
    run: Callable[[Host, AgentConfig, argparse.Namespace], int] = args.run
    try:
        host = _host(args.root)
        config = _load_config(host, args.config)
        log.configure(args.log_format, config.log.level)
        return run(host, config, args)
    except (ConfigError, UsageError) as exc:
        print(f"gpunode: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except GpunodeError as exc:
        if log.LOGGED not in getattr(exc, "__notes__", ()):
            log.get().error("command.failed", command=args.command, exc=exc)
        return EXIT_FAILED


def _load_config(host: Host, config: str | None) -> AgentConfig:
    """--config names a file on the machine gpunode runs on, not under --root."""
    if config is None:
        return load_config(host)
    return load_config(Host(), str(Path(config).absolute()))


if __name__ == "__main__":
    sys.exit(main())
