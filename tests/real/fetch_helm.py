"""Fetch (once, into the test cache) the real helm v3 and v4 the chart tests render with.

CI runs this before pytest (`make fetch-helm`) so that download time is not charged to a test:

    .venv/bin/python tests/real/fetch_helm.py 3 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script: make `tests/` importable so the module is the one the tests import.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from real.helm_bins import RELEASES, ensure_helm, version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("majors", nargs="*", help=f"of {sorted(RELEASES)}; default: all")
    args = parser.parse_args(argv)
    unknown = set(args.majors) - set(RELEASES)
    if unknown:
        parser.error(f"unknown helm major(s) {sorted(unknown)}; expected of {sorted(RELEASES)}")
    for major in args.majors or sorted(RELEASES):
        started = time.monotonic()
        helm = ensure_helm(major)
        print(f"helm {major}\t{helm.helm}\t{version(helm.helm)}\t"
              f"({time.monotonic() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
