"""Hostile `gpunode ignition --format cluster-azure|cluster-aws|cluster-secret` inputs: pool
options the charts' schemas would refuse, options where no pool exists, a URL the bootstrap
unit cannot quote, and a unit of --units the chart's structured form cannot express. Each is
refused with exit 2 and one JSON error event, prints nothing and writes nothing."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from hostile.support import Cli, check_refusal

UNITS = Path(__file__).parents[2] / "units"
URL = "https://downloads.example.com/gpunode/gpunode-0.1.0-x86-64.raw"
SHA512 = hashlib.sha512(b"example").hexdigest()


def argv(fmt: str, *extra: str, url: str = URL) -> list[str]:
    return ["ignition", "--format", fmt, "--sysext-url", url, "--sysext-sha512", SHA512,
            "--units", str(UNITS), *extra]


CASES = {
    "pool-too-short": (argv("cluster-azure", "--pool", "gpu"), r"--pool 'gpu': .*5-20"),
    "pool-uppercase": (argv("cluster-aws", "--pool", "GPU-pool"), r"--pool 'GPU-pool'"),
    "pool-the-default-pools-name": (argv("cluster-azure", "--pool", "def00"),
                                    r"--pool def00: that is the name of cluster-azure's "
                                    r"default pool"),
    "pool-on-butane": (argv("butane", "--pool", "gpu00"),
                       r"--pool: only --format cluster-azure and cluster-aws"),
    "no-default-pool-on-clc": (argv("clc", "--no-default-pool"), r"--no-default-pool: only"),
    "aws-instance-type-of-azure": (argv("cluster-aws", "--instance-type",
                                        "Standard_NC4as_T4_v3"),
                                   r"not a cluster-aws instance type, e\.g\. g4dn\.xlarge"),
    "azure-instance-type-with-space": (argv("cluster-azure", "--instance-type", "NC 4"),
                                       r"not a cluster-azure instance type"),
    "too-many-nodes": (argv("cluster-azure", "--nodes", "1001"), r"--nodes 1001: .*0 to 1000"),
    "negative-nodes": (argv("cluster-aws", "--nodes", "-1"), r"--nodes -1"),
    "nodes-not-a-number": (argv("cluster-azure", "--nodes", "two"), r"invalid int value"),
    "url-with-a-quote": (argv("cluster-azure", url="https://example.com/a'b.raw"),
                         r"cannot go into the chart's unit"),
    "url-with-a-dollar": (argv("cluster-aws", url="https://example.com/$HOME.raw"),
                          r"cannot go into the chart's unit"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_chart_option_is_refused_before_anything_is_printed(
        tmp_path: Path, cli: Cli, case: str) -> None:
    args, pattern = CASES[case]
    result = check_refusal(cli, tmp_path, args, 2, pattern)
    assert result.out == ""


@pytest.mark.parametrize(("line", "pattern"), [
    ("ConditionPathExists=/usr/bin/gpunode", r"line 2: \[Unit\] ConditionPathExists=: the "
     "cluster "
     "chart's unit form has no place for it"),
    ("After=", r"line 2: \[Unit\] After=: an empty assignment"),
])
def test_a_unit_the_chart_cannot_express_is_refused_naming_file_and_setting(
        tmp_path: Path, cli: Cli, line: str, pattern: str) -> None:
    units = tmp_path / "units"
    shutil.copytree(UNITS, units)
    path = units / "gpunode.service"
    path.write_text(path.read_text().replace("[Unit]\n", f"[Unit]\n{line}\n", 1))
    args = [a if a != str(UNITS) else str(units) for a in argv("cluster-azure")]
    result = check_refusal(cli, tmp_path, args, 2, "gpunode.service: " + pattern)
    assert result.out == ""
