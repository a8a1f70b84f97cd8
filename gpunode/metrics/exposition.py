"""The Prometheus text exposition format (version 0.0.4), written from plain records.

The format is what node-exporter's textfile collector and a scrape read (Prometheus'
docs/instrumenting/exposition_formats.md): per family a `# HELP` and a `# TYPE` line, then one
line per sample, `name{label="value",...} value`; in HELP text a backslash and a newline are
escaped, in a label value also a double quote. No timestamps: the textfile collector refuses a
file that has any (node_exporter collector/textfile.go).

Written here rather than with prometheus_client, whose import brings http.server, ssl and
email into the long-running watch, whose memory stays flat (benchmarks/watch_daemon.py). The tests
parse this output with prometheus_client's parser and with promtool, and compare it with what
prometheus_client's own writer makes of the same families (tests/unit/test_metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("gauge", "counter")


@dataclass(frozen=True)
class Sample:
    """One series of a family: its labels (name → value, in this order) and value."""

    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass
class Family:
    """One metric family: a name (a counter's ends in `_total`), its kind, help and samples."""

    name: str
    kind: str  # one of KINDS
    help: str
    samples: list[Sample] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> Family:
        self.samples.append(Sample(tuple(labels.items()), value))
        return self


def render(families: list[Family]) -> str:
    """The families as the text format; a family without samples is left out."""
    lines = []
    for family in families:
        if not family.samples:
            continue
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sample.labels)
            lines.append(f"{family.name}{{{labels}}} {_number(sample.value)}" if labels
                         else f"{family.name} {_number(sample.value)}")
    return "".join(line + "\n" for line in lines)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    """An integral value without a fraction (a count, a timestamp), else Python's shortest
    repr, which Go's ParseFloat reads back exactly."""
    if value != value or value in (float("inf"), float("-inf")):
        return {"inf": "+Inf", "-inf": "-Inf"}.get(str(value), "NaN")
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))
