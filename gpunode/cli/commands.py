"""The commands of the `gpunode` command line, one function each: the arguments argparse
parsed (cli/args.py) in, the exit code out (docs/cli.md, "Exit codes").

Each imports what it needs when it runs, so a command pays only for its own modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from gpunode import log, metrics, watch
from gpunode.cli import containerd as cli_containerd
from gpunode.cli.common import EXIT_FAILED, EXIT_OK, Command, changes_node, print_json
from gpunode.config import AgentConfig
from gpunode.errors import GpunodeError
from gpunode.platform.host import Host


def detect(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.gpu.detect import detect, require_decided

    with log.step("detect") as fields:
        detection = detect(host, use_udev=config.detect.use_udev)
        fields.update(gpus=len(detection.gpus), functions=len(detection.functions))
    if args.json:
        print_json({"schema_version": 1, "root": str(host.root), **detection.to_json()})
    else:
        from gpunode.cli import render

        print(render.detection(detection))
    # A listing answers with what it found (exit 0 is detect's documented contract): a possible
    # GPU nobody could identify is in `undecided` and `problems`, and said once more as a
    # warning; boot, plan, status and the driver commands are the ones that refuse it.
    try:
        require_decided(detection)
    except GpunodeError as exc:
        log.get().warning("detect.undecided", exc=exc)
    return EXIT_OK


def plan(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """Exit 0 whenever it could plan, even a boot that would fail: that is the answer."""
    from gpunode.pipeline import boot

    with log.step("plan") as fields:
        the_plan = boot.plan(host, config, boot.adapters_for(host, config))
        actions, problems, detection = the_plan.actions, the_plan.problems, the_plan.detection
        fields.update(actions=len(actions), problems=[p.step for p in problems])
    from gpunode.status.baked import plan_note

    baked = plan_note(host)  # a baked image: what it downloads at boot (nothing, or why)
    if args.json:
        print_json({"schema_version": 1, "root": str(host.root), "baked": baked,
                    "gpu_count": len(detection.gpus) if detection else None,
                    "changes": bool(actions),
                    "actions": [{"step": a.step, "description": a.description}
                                for a in actions],
                    "would_fail": bool(problems),
                    "problems": [dataclasses.asdict(p) for p in problems]})
    elif not problems and detection is not None and not detection.gpus:
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
    if baked and not args.json:
        print(baked)
    return EXIT_OK


def label(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.cli import render
    from gpunode.kube import label, registration

    if args.registration:
        return registration.print_form(config, args.registration, args.pool,
                                       args.instance_type, args.json)
    registration.pool_settings(None, args.pool, args.instance_type)  # refused: no form given
    with log.step("label", dry_run=args.dry_run) as fields:
        want = label.for_host(host, config)
        fields.update(node=want.node, labels=len(want.labels),
                      condition=want.condition.status)
        # A node whose GPUs nobody can identify is labelled anyway: GPUReady=False with the
        # failing checks, and no nvidia.com/gpu.* labels. Refusing would leave the Node as the
        # last boot labelled it (perhaps GPUReady=True), so the cluster would keep sending GPU
        # pods to a node gpunode cannot vouch for; "no GPU, nothing to label" would hide the
        # problem. The command still exits 1 (after labelling), naming the problem.
        outcome = None
        if want.gpu is not False and not args.dry_run:
            outcome = label.apply(host, config, want)
            fields.update(labels_changed=outcome.labels_changed,
                          condition_changed=outcome.condition_changed,
                          calls=list(outcome.calls))
        if args.json:
            print_json(label.document(want, outcome, args.dry_run))
        else:
            print(render.label(want, outcome))
    label.require_decided(want, labelled=outcome is not None)  # exit 1, after the labels
    return EXIT_OK


def ignition(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """Everything is checked before anything is printed: stdout gets a whole snippet or
    nothing."""
    from gpunode.delivery import chart, ignition

    agent_config = None
    if args.agent_config:
        agent_config = ignition.agent_config(str(Path(args.agent_config).absolute()))
    pool = chart.pool_settings(args.format, args.pool, args.instance_type, args.nodes,
                              args.no_default_pool)
    snippet = ignition.snippet(args.sysext_url, args.sysext_sha512, agent_config,
                               Path(args.units) if args.units else None)
    sys.stdout.write(chart.render(snippet, args.format, pool)
                     if args.format in ignition.CHART_FORMATS else
                     ignition.checked_text(snippet, args.format))
    return EXIT_OK


@changes_node("driver load")
def driver_load(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.driver import step
    from gpunode.gpu.detect import detect_decided
    from gpunode.pipeline import boot

    adapters = boot.adapters_for(host, config)
    with log.step("driver") as fields:
        detection = detect_decided(host, use_udev=config.detect.use_udev)
        the_plan = step.plan(host, config.driver, detection, adapters.kmod)
        fields.update(strategy=the_plan.choice.strategy, action=the_plan.choice.action)
        outcome = step.apply(host, the_plan, config.driver, adapters.kmod, adapters.build)
        fields.update(outcome.fields())
    print("\n".join([*the_plan.describe(), *outcome.nodes]))
    return EXIT_OK


@changes_node("driver build")
def driver_build(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.driver import step
    from gpunode.gpu.detect import detect_decided
    from gpunode.pipeline import boot
    from gpunode.platform import kernelinfo

    adapters = boot.adapters_for(host, config)
    with log.step("driver.build") as fields:
        kernel = kernelinfo.release(host)
        gpus = detect_decided(host, use_udev=config.detect.use_udev).gpus
        inputs = step.build_inputs(host, config.driver, kernel, gpus)
        result, pruned = step.build_cached(host, inputs, adapters.build)
        fields.update(entry=result.entry.path, cache_hit=result.cache_hit, pruned=pruned)
    print(f"{result.entry.path} ({'cached' if result.cache_hit else 'built'})")
    return EXIT_OK


def driver_status(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import status
    from gpunode.driver import step, userspace
    from gpunode.pipeline import boot

    facts = status.observe(host, config, contact_api=False)
    report = status.driver_report(status.evaluate(facts))
    kmod = boot.adapters_for(host, config).kmod
    plan_lines, plan_error = step.load_preview(host, config.driver, facts.detection,
                                               facts.undecided, kmod)
    found, userspace_error = userspace.loaded_root(host, config.driver.prebuilt_dirs)
    if args.json:
        print_json({"schema_version": 1, "root": str(host.root), "ready": report.ready,
                    "plan": plan_lines, "plan_error": plan_error,
                    "driver_root": dataclasses.asdict(found) if found else None,
                    "driver_root_error": userspace_error,
                    "checks": [dataclasses.asdict(c) for c in report.checks]})
    else:
        from gpunode.cli import render

        print(render.status(report, str(host.root), colour=sys.stdout.isatty()))
        print("plan: " + ("; ".join(plan_lines) if plan_lines else f"cannot plan: {plan_error}"))
        print("user-space: " + (userspace.describe(found) if found else
                                f"not found: {userspace_error}"))
    return EXIT_OK if report.ready else EXIT_FAILED


def driver_verify(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """The full verification of every build cache entry, whatever its stamp says; exit 1 when
    one is unusable (its stamp is removed, so boot verifies it fully and refuses it too)."""
    from gpunode.driver import cache

    rows = []
    with log.step("driver.verify") as fields:
        for path, kernel, driver, flavour in cache.entries(host):
            try:
                entry, problem = cache.verify(host, path, kernel, driver, flavour)
            except GpunodeError as exc:  # a name that is no entry's, an unwritable stamp
                entry, problem = None, str(exc)
            rows.append({"entry": path, "kernel": kernel, "driver": driver, "flavour": flavour,
                         "usable": entry is not None, "problem": problem,
                         "files": len(entry.seen) if entry else None})
        fields.update(entries=len(rows), unusable=[r["entry"] for r in rows if not r["usable"]])
    if args.json:
        print_json({"schema_version": 1, "root": str(host.root), "entries": rows})
    else:
        print("\n".join(f"{r['entry']}: " + (f"ok, {r['files']} files as the manifest says"
                                              if r["usable"] else f"UNUSABLE: {r['problem']}")
                        for r in rows) or f"no build cache entries in {cache.CACHE_ROOT}")
    return EXIT_OK if all(r["usable"] for r in rows) else EXIT_FAILED


def cdi_generate(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """The spec on stdout, or written to --output (a host path) only when its bytes change."""
    from gpunode.cdi import node as cdinode
    from gpunode.cdi import spec as cdi
    from gpunode.gpu.detect import detect_decided
    from gpunode.platform import nodelock

    output = cdinode.check_output(host, args.output)
    with log.step("cdi", output=output) as fields:
        if not detect_decided(host, use_udev=config.detect.use_udev).gpus:
            fields.update(devices=0, changed=False)
            log.get().info("cdi.no_gpu", note="no NVIDIA GPU on this node: no CDI spec, "
                           "nothing written")
            return EXIT_OK
        document = cdinode.generate(host, config.driver.prebuilt_dirs,
                                    capabilities=config.cdi.wanted)
        data = cdi.render(document, args.format)
        fields.update(devices=len(document["devices"]), cdi_version=document["cdiVersion"])
        if output is None:
            sys.stdout.write(data.decode())
            return EXIT_OK
        with nodelock.held(host, "cdi generate", nodelock.WAIT_SECONDS):
            fields.update(changed=cdinode.write(host, output, data))
    return EXIT_OK


def nodes(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.kube import nodes  # the command lives there (a workstation's, not a node's)

    return nodes.command(config, args.kubeconfig, args.context, args.json)


def image_bake(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.bake import image

    return image.command(host, args)


@changes_node("boot")
def boot(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """The whole pipeline; a CPU node's boot is answered from sysfs before it is imported
    (pipeline/shortcut.py)."""
    from gpunode.pipeline import shortcut

    if shortcut.boot_without_gpu(host, config):
        _ready("no-gpu")
        log.get().info("boot.done", outcome="no-gpu", steps=["detect"])
        return EXIT_OK
    from gpunode.pipeline import boot as pipeline

    run = pipeline.boot(host, config, pipeline.adapters_for(host, config),
                        recorded=lambda run: _ready(run.outcome))
    log.get().info("boot.done", outcome=run.outcome, steps=[s["name"] for s in run.steps])
    return EXIT_FAILED if run.outcome == "failed" else EXIT_OK


def _ready(outcome: str) -> None:
    """gpunode.service (Type=notify) is done once the record is written: containerd and the
    kubelet start now, a failed boot's too (ordering only, as the unit says). Outside systemd
    (no NOTIFY_SOCKET) nothing is sent."""
    from gpunode.platform import sdnotify

    problem = sdnotify.ready(f"boot {outcome}")
    if problem is not None:
        log.get().warning("boot.notify_failed", problem=problem,
                          note="systemd does not hear that the boot is done: gpunode.service "
                          "fails when gpunode exits, and containerd starts then")


def status(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import status as checks

    with log.step("status") as fields:
        facts = checks.observe(host, config)
        report = checks.evaluate(facts)
        fields.update(verdict=report.verdict,
                      failed=[c.name for c in report.checks if c.state == checks.FAIL])
    if args.json:
        print_json(checks.to_json(facts, report))
    else:
        from gpunode.cli import render

        print(render.status(report, str(host.root), colour=sys.stdout.isatty()))
    return EXIT_OK if report.ready else EXIT_FAILED


COMMANDS: dict[str, Command] = {
    "detect": detect, "status": status, "plan": plan, "boot": boot, "label": label,
    "ignition": ignition, "driver load": driver_load, "driver build": driver_build,
    "driver status": driver_status, "driver verify": driver_verify,
    "containerd configure": cli_containerd.configure,
    "containerd revert": cli_containerd.revert, "cdi generate": cdi_generate,
    "nodes": nodes, "watch": watch.command, "metrics": metrics.command,
    "image bake": image_bake,
}
