"""The metrics file `gpunode watch` keeps for node-exporter's textfile collector.

Written after every pass has reported to the API server (a Node PATCH never waits for it; the
daemon first reads kernel records already waiting, daemon.py), atomically: the text goes to a
temporary file beside it, whose name does not end in `.prom`, so the collector never reads half
a file, and is renamed over it (Host.write_atomic). Not fsynced: the next pass rewrites it
within 30 s, and a crash costs nothing a scrape would miss.
The path is the agent config's `metrics.textfile` (docs/metrics.md says why its default);
"" writes none. A file that cannot be written is said once per distinct problem and never
fails the pass: the watch's job is GPUReady, the file is a view of it.
"""

from __future__ import annotations

from gpunode import log
from gpunode.config import AgentConfig
from gpunode.errors import GpunodeError
from gpunode.platform.host import Host

_said: str | None = None  # the last problem logged as a warning, in this process


def write(host: Host, config: AgentConfig) -> bool:
    """Write the node's metrics to metrics.textfile; whether a file was written."""
    global _said
    path = config.metrics.textfile
    if not path:
        return False
    from gpunode import metrics

    try:
        host.write_atomic(path, metrics.text(host, config).encode(), mode=0o644,
                          make_parents=True, durable=False)
    except GpunodeError as exc:
        problem = f"{exc.code}: {exc}"
        if problem != _said:
            _said = problem
            log.get().warning("watch.metrics_unwritten", file=host.display(path), exc=exc,
                              note="the watch goes on; said once per distinct problem")
        return False
    _said = None
    return True
