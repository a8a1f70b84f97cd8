"""The example node snippet, shared by tests/unit/test_ignition.py and
tests/integration/test_ignition_validate.py: the checkout's units and example agent config,
rendered for a made-up sysext URL and checksum."""

from __future__ import annotations

import hashlib

from conftest import REPO
from gpunode.delivery import chart, ignition

UNITS = REPO / "units"
URL = "https://downloads.example.com/gpunode/gpunode-0.1.0-x86-64.raw"
SHA512 = hashlib.sha512(b"example").hexdigest()
AGENT = (REPO / "ignition/example-config.toml").read_text()


def rendered(fmt: str) -> str:
    return ignition.render(ignition.snippet(URL, SHA512, AGENT, UNITS), fmt)


def snippet(agent: str | None = AGENT) -> ignition.Snippet:
    return ignition.snippet(URL, SHA512, agent, UNITS)


def chart_rendered(fmt: str, pool: chart.Pool | None = None) -> str:
    """The example as `gpunode ignition --format <fmt>` (cluster-azure, cluster-aws,
    cluster-secret) prints it."""
    return chart.render(snippet(), fmt, pool)
