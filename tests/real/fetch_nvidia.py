"""Fetch (once, into the test cache) NVIDIA's real driver files and compile its kernel modules.

CI runs this before pytest so that download and compile time is not charged to a test:

    .venv/bin/python tests/real/fetch_nvidia.py                  # 550 + 535, open modules
    .venv/bin/python tests/real/fetch_nvidia.py --flavour open --flavour proprietary

It prints, per release, the version, the suite, what was downloaded and how long it took, and
per module build the kernel, the stripped and unstripped sizes and the compile time (a cached
tree or build: well under a second, no network, no compiler).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script: make `tests/` importable so the modules are the ones the tests import.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from real.nvidia_driver import RELEASES, ensure_driver
from real.nvidia_modules import FLAVOURS, ensure_headers, ensure_modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", choices=sorted(RELEASES),
                        help="driver releases to fetch (default: all)")
    parser.add_argument("--flavour", action="append", choices=FLAVOURS,
                        help="550 module flavours to compile (default: open)")
    args = parser.parse_args(argv)

    for release in args.release or sorted(RELEASES):
        started = time.monotonic()
        driver = ensure_driver(release)
        build = driver.build
        print(f"{release}\t{driver.version}\t{build['suite']}\t"
              f"{int(build['download_bytes']) / 1e6:.0f} MB in {len(build['packages'])} packages"
              f"\tfetched in {build['download_seconds']} s + unpacked in "
              f"{build['unpack_seconds']} s\t(now {time.monotonic() - started:.1f} s)\t"
              f"{driver.root}")
    for flavour in args.flavour or ["open"]:
        started = time.monotonic()
        built = ensure_modules(flavour)
        sizes = built.build["modules"]
        assert isinstance(sizes, dict)
        stripped = sum(size["stripped"] for size in sizes.values()) / 1e6
        unstripped = sum(size["unstripped"] for size in sizes.values()) / 1e6
        print(f"{flavour}\t{built.version}\t{built.kernel}\t{stripped:.0f} MB stripped "
              f"({unstripped:.0f} MB unstripped)\tcompiled in {built.build['compile_seconds']} s "
              f"({built.build['compile_cpu_seconds']} s CPU on {built.build['cpus']} cores)"
              f"\t(now {time.monotonic() - started:.1f} s)\t{built.directory}")
    started = time.monotonic()
    headers = ensure_headers()  # build.sh's split-tree test compiles against them
    print(f"headers\t{headers}\t(now {time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
