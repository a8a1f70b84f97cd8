"""The real promtool (Prometheus' own checker) for the metrics, alert rules and dashboard tests.

`promtool check metrics` parses the text exposition format with the same Go parser a scrape
and node-exporter's textfile collector use, and lints names and help; `promtool check rules`
and `promtool test rules` parse and evaluate PromQL with Prometheus' own engine. Testing the
files against a Python imitation of either would test our assumptions, not Prometheus.

From Debian's `prometheus` package (bookworm: 2.42), fetched like the containerd binaries
(real/containerd_bins.py: `apt-get download` with a private apt state, `dpkg -x`) rather than
installed: installing the package starts a Prometheus server on the machine, which no test
wants. Only the promtool binary is kept, under

    $GPUNODE_TEST_CACHE/promtool/bin/promtool   (default /var/cache/gpunode-tests)

An flock on promtool/.lock makes concurrent pytest processes fetch once. Run as a script it
fetches (the Makefile's test target does so before pytest) and prints the version.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `tests/` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from real import cache
from real.containerd_bins import FETCH_TIMEOUT_S, _private_apt, _run

SUITE = "bookworm"
PACKAGE = "prometheus"
RUN_TIMEOUT_S = 60


def cache_dir() -> Path:
    return cache.root() / "promtool"


def ensure_promtool() -> Path:
    """The path of a working promtool; fetched once into the test cache."""
    directory = cache_dir()
    binary = directory / "bin" / "promtool"
    with cache.locked(directory):
        if not binary.exists():
            _fetch(directory)
    return binary


def run(args: Sequence[str | os.PathLike[str]], stdin: str | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """promtool with `args` (and `stdin`), its exit code and output returned, never raised."""
    return subprocess.run([str(ensure_promtool()), *map(str, args)], input=stdin, cwd=cwd,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _fetch(directory: Path) -> None:
    cache.remove_leftovers(directory, "fetch-*")  # left by a killed fetch; we hold the lock
    with tempfile.TemporaryDirectory(dir=directory, prefix="fetch-") as tmp_name:
        tmp = Path(tmp_name)
        apt = _private_apt(tmp, SUITE)
        _run([*apt, "update", "-o", "APT::Update::Error-Mode=any"],
             f"apt-get update for Debian {SUITE} failed (network or mirror down?)",
             timeout=FETCH_TIMEOUT_S)
        _run([*apt, "download", PACKAGE], f"apt-get download {PACKAGE} from Debian {SUITE} "
             "failed", cwd=tmp, timeout=FETCH_TIMEOUT_S)
        debs = sorted(tmp.glob(f"{PACKAGE}_*.deb"))
        if len(debs) != 1:
            raise RuntimeError(f"expected one {PACKAGE} .deb in {tmp}, found {debs}")
        _run(["dpkg", "-x", debs[0], tmp / "root"], f"dpkg -x {debs[0].name} failed")
        (directory / "bin").mkdir(exist_ok=True)
        (directory / "PACKAGE").write_text(debs[0].name + "\n")
        # Rename last: a binary in place means a complete fetch, whoever looks next.
        (tmp / "root" / "usr" / "bin" / "promtool").replace(directory / "bin" / "promtool")


if __name__ == "__main__":
    result = run(["--version"])
    print(f"{ensure_promtool()}: {(result.stdout or result.stderr).splitlines()[0]}")
    sys.exit(result.returncode)
