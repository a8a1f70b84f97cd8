"""`gpunode containerd configure|revert`: the runtime step alone, with the command line's
overrides of the agent config's [containerd] keys."""

from __future__ import annotations

import argparse

from gpunode import log
from gpunode.cli.common import EXIT_OK, changes_node
from gpunode.config import AgentConfig, check_flag, with_flags
from gpunode.platform.host import Host


def settings(config: AgentConfig, args: argparse.Namespace) -> AgentConfig:
    """The agent config with this command line's overrides applied, checked by the same rules
    as the agent config's own keys (a name containerd rejects, a relative path: exit 2)."""
    revert_settings(config, args)
    return with_flags(config, "containerd", {
        "runtime_name": ("--runtime-name", args.runtime_name),
        "runtime_path": ("--runtime-path", args.runtime_path),
        "set_as_default": ("--set-as-default", args.set_as_default),
        "enable_cdi": ("--enable-cdi", args.enable_cdi)})


def revert_settings(config: AgentConfig, args: argparse.Namespace) -> AgentConfig:
    """containerd's --config names a host path (under --root), checked as
    containerd.config_path is: an empty or relative one names no file gpunode could edit or
    revert, and must not quietly mean the default."""
    check_flag("containerd --config", "containerd", "config_path", args.containerd_config)
    return config


@changes_node("containerd configure", settings)
def configure(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """`config` has the command line's overrides applied (settings)."""
    from gpunode.containerd import step
    from gpunode.platform import systemd

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


@changes_node("containerd revert", revert_settings)
def revert(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.containerd import revert
    from gpunode.platform import systemd

    with log.step("containerd.revert") as fields:
        outcome = revert.revert(host, systemd.for_host(host.is_live),
                                config.containerd.restart_timeout, args.containerd_config)
        fields.update(changed=outcome.changed, restarted=outcome.restarted)
    print("\n".join(outcome.descriptions))
    return EXIT_OK
