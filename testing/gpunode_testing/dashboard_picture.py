"""docs/dashboard.png: a picture of deploy/gpunode-dashboard.json, drawn from the tests' fleet.

    pip install matplotlib   # not a dependency of gpunode or its tests
    python -m gpunode_testing.dashboard_picture docs/dashboard.png

No Grafana can be had from the registries this project uses (Debian ships none; PyPI's and
npm's "grafana" packages are API clients and UI libraries, not the server), so this draws the
dashboard itself: each panel at the place and size its gridPos gives, with its title, kind
and units, and the values its PromQL query gives on the metrics fleet (metricsfleet.py) over
six scripted hours: every fixture machine, an ND96 that logs application Xids and then loses
a GPU off the bus, a T4 whose VM size has 4 GPUs, a CPU node. The series are gpunode's own
output (`gpunode metrics` after each watch pass); each query is evaluated here in Python, the
way tests/integration/test_metrics_rules.py has Prometheus evaluate the fleet panels.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpunode import metrics
from gpunode_testing import metricsfleet

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "gpunode-dashboard.json"
NODE = "nd96-fallen"  # the node the picture's $node shows
STEPS = 36  # ten-minute steps: six hours
# step → node → kernel lines logged just before that step's watch pass
SCRIPT: dict[int, dict[str, list[str]]] = {
    6: {NODE: ["NVRM: Xid (PCI:0002:00:00): 13, pid=7, name=python, Graphics Exception"] * 3},
    12: {"nc4as-t4-v3": ["NVRM: Xid (PCI:0001:00:00): 31, pid=9, name=train, MMU Fault"] * 2},
    20: {NODE: [metricsfleet.FELL_OFF]},
    24: {"nc4as-t4-v3": ["NVRM: Xid (PCI:0001:00:00): 43, pid=9, name=train, Reset Channel"]},
    30: {"nc6s-v3": ["NVRM: Xid (PCI:0001:00:00): 31, pid=4, name=jupyter, MMU Fault"] * 4},
}
Samples = list[tuple[str, dict[str, str], float]]


def timeline(root: Path) -> list[dict[str, Samples]]:
    """Per step, node → its samples, after that step's watch pass on every GPU node."""
    hosts = metricsfleet.build(root)
    steps = []
    for step in range(STEPS):
        for node, lines in SCRIPT.get(step, {}).items():
            metricsfleet.log_kernel(hosts[node], *lines)
        for node, host in hosts.items():
            if node != "cpu-booted":
                metricsfleet.watch_pass(host)
        steps.append({node: _samples(metrics.text(host, metricsfleet.CONFIG))
                      for node, host in hosts.items()})
    return steps


def _samples(text: str) -> Samples:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def _values(at: dict[str, Samples], name: str) -> list[tuple[str, dict[str, str], float]]:
    return [(node, labels, value) for node, samples in at.items()
            for n, labels, value in samples if n == name]


def panel_values(steps: list[dict[str, Samples]]) -> dict[str, object]:
    """Each panel's values (title → what it shows), as its query gives them."""
    now = steps[-1]
    ready = {node: v for node, _, v in _values(now, "gpunode_gpu_ready_condition")}
    counts: dict[str, dict[str, float]] = defaultdict(dict)
    for name in ("gpunode_gpus_detected", "gpunode_gpus_expected"):
        for node, _, v in _values(now, name):
            counts[node][name] = v
    drivers: dict[tuple[str, str, str], int] = defaultdict(int)
    for _, labels, _ in _values(now, "gpunode_driver_info"):
        drivers[(labels["version"], labels["flavour"], labels["strategy"] or "-")] += 1
    steps_by_name: dict[str, list[float]] = defaultdict(list)
    for _, labels, v in _values(now, "gpunode_boot_step_duration_seconds"):
        steps_by_name[labels["step"]].append(v)
    return {
        "GPU nodes ready": sum(1 for v in ready.values() if v == 1),
        "GPU nodes not ready": sum(1 for v in ready.values() if v == 0),
        "GPUs missing": sum(max(0, c["gpunode_gpus_expected"] - c["gpunode_gpus_detected"])
                            for c in counts.values() if "gpunode_gpus_expected" in c),
        "Boots failed": sum(1 for _, labels, v in _values(now, "gpunode_boot_outcome")
                            if labels["outcome"] == "failed" and v == 1),
        "Drivers": [[*key, str(n)] for key, n in sorted(drivers.items())],
        "Nodes not ready, and why": [[node, labels["reason"]] for node, labels, v in
                                     _values(now, "gpunode_gpu_ready_condition") if v == 0],
        "Xids per code": _increase(steps, lambda node, labels: f"Xid {labels['code']}"),
        "Boot step duration": {step: (sum(v) / len(v), max(v))
                               for step, v in steps_by_name.items()},
        "GPUs": [[labels["index"], labels["address"], labels["uuid"][:13] + "…",
                  labels["state"]] for _, labels, v in _values({NODE: now[NODE]},
                                                               "gpunode_gpu_state") if v == 1],
        "GPUReady": [(labels["reason"], v) for _, labels, v in
                     _values({NODE: now[NODE]}, "gpunode_gpu_ready_condition")],
        "GPUs on the bus": [(n.removeprefix("gpunode_gpus_"), v) for n, _, v in now[NODE]
                            if n in ("gpunode_gpus_detected", "gpunode_gpus_expected")],
        "Driver": [[labels["version"], labels["flavour"], labels["strategy"] or "-",
                    "1" if any(n == "gpunode_driver_userspace_matches" and m == 1
                               for n, _, m in now[NODE]) else "0"]
                   for _, labels, _ in _values({NODE: now[NODE]}, "gpunode_driver_info")],
        "Xids": _increase([{NODE: s[NODE]} for s in steps],
                          lambda node, labels: f"{labels['address']} Xid {labels['code']}"),
        "Boot steps": {labels["step"]: (v, v) for _, labels, v in
                       _values({NODE: now[NODE]}, "gpunode_boot_step_duration_seconds")},
    }


def _increase(steps: list[dict[str, Samples]], legend: object) -> dict[str, list[float]]:
    """sum by legend of increase(gpunode_xids_total[step]) at every step."""
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(steps))
    for i in range(1, len(steps)):
        before = {(node, tuple(sorted(labels.items()))): v
                  for node, labels, v in _values(steps[i - 1], "gpunode_xids_total")}
        for node, labels, v in _values(steps[i], "gpunode_xids_total"):
            grown = v - before.get((node, tuple(sorted(labels.items()))), 0)
            series[legend(node, labels)][i] += grown  # type: ignore[operator]
    return dict(series)


def draw(values: dict[str, object], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    unit_w, unit_h, rows = 1.0, 0.42, 29  # one row of margin below
    fig = plt.figure(figsize=(24 * unit_w * 0.8, rows * unit_h * 0.8), dpi=100,
                     facecolor="#111217")
    seen: dict[str, int] = defaultdict(int)
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        left, width = grid["x"] / 24, grid["w"] / 24
        top, height = grid["y"] / rows, grid["h"] / rows
        if panel["type"] == "row":
            fig.text(left + 0.004, 1 - top - height / 2, panel["title"].replace("$node", NODE),
                     color="#ccccdc", fontsize=13, weight="bold", va="center")
            continue
        ax = fig.add_axes((left + 0.003, 1 - top - height + 0.006, width - 0.006,
                           height - 0.012))
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.set_title(panel["title"], color="#ccccdc", fontsize=10, loc="left")
        seen[panel["title"]] += 1
        _draw_panel(ax, panel, values[panel["title"]])
    fig.text(0.995, 0.988, f"drawn by gpunode_testing.dashboard_picture from the tests' fleet; "
             f"$node = {NODE}; not a Grafana screenshot", color="#6e7079", fontsize=8,
             ha="right")
    fig.savefig(out, facecolor=fig.get_facecolor())


def _draw_panel(ax: object, panel: dict[str, object], value: object) -> None:
    import matplotlib.pyplot as plt

    a: plt.Axes = ax  # type: ignore[assignment]
    kind = panel["type"]
    text = "#ccccdc"
    if kind == "stat":
        a.set_xticks([]), a.set_yticks([])
        shown = value if isinstance(value, list) else [(None, value)]
        for i, (label, number) in enumerate(shown):
            colour = "#73bf69"
            if panel["title"] == "GPUReady":
                colour, number = ("#f2495c", "False") if number == 0 else ("#73bf69", "True")
            elif panel["title"] not in ("GPU nodes ready", "GPUs on the bus") and number:
                colour = "#f2495c"
            x = (i + 0.5) / len(shown)
            a.text(x, 0.45, f"{number:g}" if isinstance(number, float | int) else number,
                   color=colour, fontsize=26, weight="bold", ha="center", va="center",
                   transform=a.transAxes)
            if label:
                a.text(x, 0.12, label, color=text, fontsize=9, ha="center",
                       transform=a.transAxes)
    elif kind == "table":
        a.set_xticks([]), a.set_yticks([])
        heads = {"Drivers": ["version", "flavour", "strategy", "nodes"],
                 "Nodes not ready, and why": ["instance", "reason"],
                 "GPUs": ["index", "address", "uuid", "state"],
                 "Driver": ["version", "flavour", "strategy", "user-space matches"]}
        rows = [heads[str(panel["title"])], *value]  # type: ignore[misc]
        for r, row in enumerate(rows[:9]):
            for c, cell in enumerate(row):
                colour = text
                if r and cell in ("fell-off-bus", "xid-fatal", "missing"):
                    colour = "#f2495c"
                elif r and cell == "ready":
                    colour = "#73bf69"
                a.text(0.02 + c / len(row), 0.88 - r * 0.1, cell, color=colour, fontsize=8,
                       weight="bold" if r == 0 else "normal", transform=a.transAxes)
    elif kind == "timeseries":
        a.tick_params(colors="#8e8e8e", labelsize=7)
        bottom = [0.0] * STEPS
        hours = [i / 6 for i in range(STEPS)]
        for legend, counts in sorted(value.items()):  # type: ignore[attr-defined]
            a.bar(hours, counts, width=1 / 7, bottom=bottom, label=legend)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        a.set_xlabel("hours", color="#8e8e8e", fontsize=7)
        a.legend(fontsize=7, facecolor="#181b1f", labelcolor=text, edgecolor="#2c3235",
                 loc="upper left")
    elif kind == "bargauge":
        a.tick_params(colors="#8e8e8e", labelsize=8)
        names = list(value)  # type: ignore[call-overload]
        averages = [value[n][0] for n in names]  # type: ignore[index]
        slowest = [value[n][1] for n in names]  # type: ignore[index]
        a.barh(names, slowest, color="#5794f2", alpha=0.45, label="max")
        a.barh(names, averages, color="#5794f2", label="avg")
        a.set_xlabel("seconds", color="#8e8e8e", fontsize=7)


def main(argv: list[str] | None = None) -> int:
    out = Path((argv if argv is not None else sys.argv[1:] or ["docs/dashboard.png"])[0])
    with tempfile.TemporaryDirectory(prefix="gpunode-dashboard-") as root:
        values = panel_values(timeline(Path(root)))
    draw(values, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
