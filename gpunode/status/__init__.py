"""`gpunode status`: live checks of everything a GPU node needs, each with a verdict and a hint.

`observe()` reads the host into `StatusFacts` (status/reading.py, status/containerd.py);
`evaluate()` is pure and turns facts into checks (status/checks.py, status/containerd.py), so
every verdict can be tested from data alone; status/facts.py holds the types, the JSON document
and the labels the Node should carry.
"""

from gpunode.status.checks import DRIVER_CHECKS, driver_report, evaluate
from gpunode.status.facts import (
    FAIL,
    OK,
    SKIP,
    WARN,
    Check,
    ContainerdFacts,
    DaemonStart,
    DeviceNodes,
    DevNode,
    NodeFacts,
    Report,
    StatusFacts,
    label_facts,
    to_json,
    wanted_labels,
)
from gpunode.status.reading import observe

__all__ = ["DRIVER_CHECKS", "FAIL", "OK", "SKIP", "WARN", "Check", "ContainerdFacts", "DaemonStart",
           "DevNode", "DeviceNodes", "NodeFacts", "Report", "StatusFacts", "driver_report",
           "evaluate", "label_facts", "observe", "to_json", "wanted_labels"]
