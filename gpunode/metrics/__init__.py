"""`gpunode metrics`: the node's GPU health in the Prometheus text format.

facts.py reads what gpunode already keeps (the boot record, the watch's state, detection, the
loaded driver, the VM size), families.py turns it into metric families (pure) and
exposition.py into text. `gpunode metrics` prints it; `gpunode watch` writes the same text on
every pass to the file node-exporter's textfile collector reads (textfile.py).
docs/metrics.md lists the series, the alert rules and the dashboard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from gpunode.config import AgentConfig
    from gpunode.platform.host import Host


def text(host: Host, config: AgentConfig) -> str:
    """The node's metrics as the text exposition format."""
    from gpunode.metrics import exposition, facts, families

    return exposition.render(families.families(facts.observe(host, config)))


def command(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    """`gpunode metrics`: the text on stdout, exit 0 (a node without GPUs has a few series)."""
    import sys

    sys.stdout.write(text(host, config))
    return 0
