"""`gpunode watch`: the node keeps telling the cluster the truth about its GPUs after boot.

xid.py reads the kernel's NVRM Xid lines (pure), state.py remembers what was reported this boot
(/run/gpunode/watch.json), once.py observes the host, decides the GPUReady condition and the
Events, and applies them (or, with --dry-run, prints them); daemon.py runs those passes for as
long as gpunode-watch.service runs, on what kmsg.py reads from /dev/kmsg, telling systemd
through notify.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from gpunode.config import AgentConfig
    from gpunode.platform.host import Host


def command(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """`gpunode watch` as the command line runs it: the daemon, or with --once one pass; the work
    (daemon.py, once.py) is imported only now."""
    if not args.once:
        from gpunode.watch import daemon

        return daemon.command(host, config, args.dry_run)
    from gpunode.watch import once

    return once.command(host, config, args.once, args.dry_run)
